"""The ``vitprune`` command and its subcommands."""
