"""``vitprune demo``: prune the shipped small ViTs on their shipped real test images.

For each dataset: accuracy, GFLOPs and measured speedup of the unpruned model, of
vitprune's defaults (merging, size-aware attention) and of the paper's method (var and
medad, its three stages, one fusion token) at several keep rates, then a plot of accuracy
against GFLOPs and against the measured speedup (one line per method). Needs no download:
the models and test subsets ship in the package.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.config import PAPER_OPTIONS
from ..core.patching import patch
from ..data.accuracy import accuracy
from ..data.datasets import to_input
from ..data.shipped import load_shipped, load_test_subset
from ..measure.flops import analytic_flops
from ..pictures import pyplot
from ..pictures.frontier import AXES, draw_frontiers
from .bench import time_interleaved


def settings_of(indicators: Sequence[str],
                keep_rates: Sequence[float]) -> List[Tuple[str, float, Optional[Dict[str, Any]]]]:
    """``(method, keep rate, patch options or None)`` per setting: the unpruned model, then per
    keep rate vitprune's defaults and the paper's method with each indicator."""
    settings: List[Tuple[str, float, Optional[Dict[str, Any]]]] = [("unpruned", 1.0, None)]
    settings += [("default", rate, {}) for rate in keep_rates]
    settings += [(f"{ind} (paper)", rate, dict(indicator=ind, **PAPER_OPTIONS)) for ind in indicators
                 for rate in keep_rates]
    return settings


def run_dataset(dataset: str, indicators: Sequence[str], keep_rates: Sequence[float],
                rounds: int, advance: Callable[[], None] = lambda: None) -> List[Dict[str, Any]]:
    """One row per setting: the unpruned model, then per keep rate vitprune's defaults
    and the paper's method with each indicator."""
    base, record = load_shipped(dataset)
    images, labels = load_test_subset(dataset)
    x = to_input(images[:256])
    rows: List[Dict[str, Any]] = []
    steps: Dict[str, Callable[[], None]] = {}
    for method, rate, options in settings_of(indicators, keep_rates):
        label = "unpruned" if options is None else f"{method.split()[0]} keep {rate:g}"
        model = base if options is None else patch(copy.deepcopy(base), keep_rate=rate, **options)
        rows.append({"dataset": dataset, "setting": label, "method": method, "indicator": method.split()[0],
                     "keep_rate": rate, "accuracy": accuracy(model, images, labels),
                     "gflops": analytic_flops(model) / 1e9, "images": len(images),
                     "checkpoint_accuracy_full_test_set": record["test_accuracy"]})

        def step(model: torch.nn.Module = model) -> None:
            with torch.inference_mode():
                model(x)
        steps[label] = step
        advance()
    seconds = time_interleaved(steps, rounds, warmup=1, sync=lambda: None, progress=False)
    advance()
    for row in rows:
        row["speedup"] = seconds["unpruned"] / seconds[row["setting"]]
    return rows


def plot(rows: Sequence[Dict[str, Any]], path: str) -> None:
    """Accuracy against GFLOPs (top row) and against the measured speedup (bottom row), one
    column per dataset, one line per method (``draw_frontiers``)."""
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    figure, axes = pyplot(files_only=True).subplots(len(AXES), len(datasets), figsize=(5.5 * len(datasets), 8.4),
                                                     squeeze=False)
    for column, dataset in enumerate(datasets):
        subset = [{**r, "top1": 100 * r["accuracy"], "budget": None} for r in rows if r["dataset"] == dataset]
        draw_frontiers(subset, f"{dataset} ({subset[0]['images']} test images)", axes[:, column])
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def format_rows(rows: Sequence[Dict[str, Any]]) -> str:
    lines = [f"{'dataset':<15}{'setting':<18}{'accuracy':>9}{'vs unpruned':>13}{'GFLOPs':>9}{'speedup':>9}"]
    for r in rows:
        base = next(b for b in rows if b["dataset"] == r["dataset"] and b["indicator"] == "unpruned")
        delta = 100 * (r["accuracy"] - base["accuracy"])
        lines.append(f"{r['dataset']:<15}{r['setting']:<18}{100 * r['accuracy']:>8.2f}%{delta:>+12.2f}"
                     f"{r['gflops']:>9.4f}{r['speedup']:>8.2f}x")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    bad = [rate for rate in args.keep_rates if not 0 < rate <= 1]
    if bad or args.rounds < 1 or not args.out.lower().endswith(".png"):
        problem = (f"keep rates must be in (0, 1], got {bad}" if bad else
                   f"--rounds must be >= 1, got {args.rounds}" if args.rounds < 1 else
                   f"--out must be a .png file, got {args.out!r}")
        print(f"vitprune demo: error: {problem}", file=sys.stderr)
        return 2
    try:
        pyplot(files_only=True)  # before minutes of work, not after
    except ImportError as error:
        print(f"vitprune demo: error: {error}", file=sys.stderr)
        return 2
    from tqdm.auto import tqdm

    rows: List[Dict[str, Any]] = []
    steps = len(args.datasets) * (len(settings_of(args.indicators, args.keep_rates)) + 1)
    with tqdm(total=steps, desc="accuracy and timing", unit="step") as bar:
        for dataset in args.datasets:
            rows += run_dataset(dataset, args.indicators, args.keep_rates, args.rounds, bar.update)
    print("Shipped small ViTs (vitprune/assets): 'default' is vitprune.patch(model, keep_rate=...), a few "
          "tokens merged in every block but the last, which computes the class token alone (all the head "
          "reads); 'var'/'medad' the paper's method at blocks (1, 3, 4) of 6; speedup measured here, batch "
          "256, median of interleaved rounds")
    print(format_rows(rows))
    if any(rate >= 0.9 for rate in args.keep_rates):
        print("Keep 0.9 saves about a tenth of the FLOPs; on models this small the scoring, matching and "
              "gathering cost about as much, so speedups near 1.00x are expected there. The saving grows with "
              "the share pruned and the model's size (README, 'Measured on CPU').")
    plot(rows, args.out)
    print(f"wrote {args.out}")
    return 0
