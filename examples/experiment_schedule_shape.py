"""Experiment (f): how the defaults' merging is spread over the blocks, at equal FLOPs.

    python examples/experiment_schedule_shape.py --checkpoints runs/*_seed*.pt \\
        runs/fashion_mnist_shipped10k.pt --name schedule_shape
    python examples/experiment_schedule_shape.py --checkpoints runs/*_seed*.pt \\
        runs/fashion_mnist_shipped10k.pt --finetune --budgets 0.8 0.7 0.6 --shapes 0.5 1 \\
        --name schedule_shape_finetuned
    python examples/experiment_merging.py --report docs/results/schedule_shape.json \\
        --name schedule_shape

The defaults remove one common share of the tokens in every block (``stages="spread"``),
so the later blocks, holding fewer tokens, remove fewer; token merging removes the same
count ``r`` in every block. Between the two: block ``l`` holding ``n_l`` patch tokens
removes ``c * n_l ** shape`` of them, ``shape`` 1 being the common share and 0 the
constant count. For each shape the scale ``c`` is fitted to the FLOP budget (bisection on
vitprune's analytic counter, the counts rounded up, so the budget is met to about one
token); the method is otherwise the defaults' (bipartite, merge, size-aware). Token
merging (its own fit) runs beside them. ``--finetune`` fine-tunes each for 100 steps
with experiment (e)'s recipe before evaluating, and the unpruned model likewise;
``--repeats R`` does so R times per model, with experiment (e)'s repeat seeds.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from tqdm.auto import tqdm

import vitprune
from vitprune.core.config import PruneConfig
from vitprune.core.grid import num_patches
from vitprune.core.registry import blocks_of
from vitprune.data.accuracy import accuracy
from vitprune.data.datasets import load
from vitprune.data.shipped import load_checkpoint
from vitprune.measure.baseline import fit_merging
from vitprune.measure.flops import flop_counter, schedule_flops
from experiment_merging import BASELINE, STEPS, row, tune, write_rows

_BISECTION_STEPS = 60


def shape_counts(scale: float, shape: float, n: int, depth: int) -> List[int]:
    """Patch tokens left after each block: block ``l`` removes ``scale * x_l ** shape`` of the
    ``x_l`` (real-valued) it holds, rounded up to whole tokens and at most half of them
    (one round of bipartite matching), never fewer than one."""
    x, left, counts = float(n), n, []
    for _ in range(depth):
        x = max(1.0, x - scale * x ** shape)
        left = min(left, max(math.ceil(x - 1e-9), left - left // 2))
        counts.append(left)
    return counts


def shape_config(counts: Sequence[int], n: int) -> PruneConfig:
    """The defaults' method at these per-block token counts (``stages="all"``)."""
    rates, before = [], n
    for count in counts:
        rates.append(count / before)  # keep_count(count / before, before) == count
        before = count
    return PruneConfig(stages="all", keep_rate=tuple(rates))


def fit_shape(model: torch.nn.Module, shape: float, target_flops: float) -> PruneConfig:
    """The schedule of ``shape`` with the smallest scale whose analytic FLOPs fit the target."""
    n, depth = num_patches(model), len(blocks_of(model))
    flops = flop_counter(model)
    low, high = 0.0, float(n)  # flops(low) > target >= flops(high) once high removes all it can
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        if flops(shape_config(shape_counts(middle, shape, n, depth), n)) <= target_flops:
            high = middle
        else:
            low = middle
    config = shape_config(shape_counts(high, shape, n, depth), n)
    if flops(config) > target_flops:
        raise ValueError(f"shape {shape} cannot reach {target_flops / 1e9:.4g} GFLOPs on this model")
    return config


def method_name(shape: Optional[float]) -> str:
    if shape is None:
        return BASELINE
    if shape == 1:
        return "defaults' method, one common share per block (shape 1)"
    if shape == 0:
        return "defaults' method, one count per block (shape 0)"
    return f"defaults' method, removal ~ n^{shape:g} per block"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", required=True, help="from examples/train_small_vit.py")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.8, 0.7, 0.6, 0.5, 0.4])
    parser.add_argument("--shapes", nargs="+", type=float, default=[0, 0.25, 0.5, 0.75, 1])
    parser.add_argument("--limit", type=int, default=5000, help="the first LIMIT test images")
    parser.add_argument("--finetune", action="store_true", help=f"fine-tune {STEPS} steps before evaluating")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --finetune: fine-tune every model this many times, each with its own batch "
                             "order (experiment_merging.py's --repeats)")
    parser.add_argument("--name", default="schedule_shape", help="results file name (docs/results/NAME.json)")
    parser.add_argument("--docs", default="docs")
    args = parser.parse_args()

    rows = []
    for path in args.checkpoints:
        model, record = load_checkpoint(Path(path))
        dataset = record["dataset"]
        images, labels = load(dataset, "test")
        images, labels = images[:args.limit], labels[:args.limit]
        train_set = load(dataset, "train") if args.finetune else None
        full = schedule_flops(model, None)
        runs = [(1.0, None, True)] + [(b, s, False) for b in args.budgets for s in [*args.shapes, None]]
        jobs = [(repeat, *run) for repeat in range(args.repeats if args.finetune else 1) for run in runs]
        for repeat, budget, shape, unpruned in tqdm(jobs, desc=Path(path).stem, file=sys.stderr):
            if unpruned:
                tuned, name = copy.deepcopy(model), "unpruned"
            else:
                config = fit_merging(model, budget * full / 1e9) if shape is None else \
                    fit_shape(model, shape, budget * full)
                tuned, name = vitprune.patch(copy.deepcopy(model), config), method_name(shape)
            if args.finetune:
                tune(tuned, record, train_set, repeat, desc=f"{name} {budget}")
            result = row(record, name, budget, tuned, accuracy(tuned, images, labels))
            tuned_as = {"finetuned": STEPS, "repeat": repeat} if args.finetune else {}
            rows.append({**result, "shape": shape, **tuned_as})
    write_rows(args, rows)


if __name__ == "__main__":
    main()
