"""The library proper: the validated config, the scores and reductions (pure tensor maths),
the per-forward state, the family registry, and ``patch``/``unpatch``."""
