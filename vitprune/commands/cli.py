"""The ``vitprune`` command: parse (light, see ``parsers``), then import and run the subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from .. import __version__
from .parsers import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitprune", description="Token reduction for timm Vision Transformers: "
                                     "prune and merge patch tokens in place, measure what it buys.")
    parser.add_argument("--version", action="version", version=f"vitprune {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what the results files record as the command
    command = importlib.import_module(f"{__package__}.{args.command}")
    return command.main(args)


if __name__ == "__main__":
    sys.exit(main())
