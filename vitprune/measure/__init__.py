"""Measuring what a patch buys: FLOPs (analytic and fvcore), FLOP budgets, peak memory,
and the token-merging baseline at a given cost."""
