"""Throughput of a pruned ViT against the unpruned one, interleaved in one run.

    python examples/benchmark_speed.py                       # deit_small, batch 32, fp32 CPU
    python examples/benchmark_speed.py --model deit_tiny_patch16_224 --rounds 9

Every setting runs once per round, in turn (A B C ... A B C ...), after a warm-up, and
the median time per setting is reported; speed is given as a ratio to the unpruned model
measured in the same run, next to the ideal ratio from the FLOP counts. Run it with
nothing else busy on the machine: a second job on another core cuts the measured gains.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Dict, List, Tuple

import timm
import torch

import vitprune
from vitprune.flops import analytic_flops

SETTINGS: List[Tuple[str, float]] = [("var", 1.0), ("medad", 1.0), ("var", 0.7), ("medad", 0.7)]


def build_models(name: str, stages: Tuple[int, ...]) -> Dict[str, torch.nn.Module]:
    base = timm.create_model(name, pretrained=False).eval()
    models = {"unpruned": base}
    for indicator, keep in SETTINGS:
        patched = vitprune.patch(copy.deepcopy(base), indicator=indicator, keep_rate=keep, stages=stages)
        models[f"{indicator} keep {keep}"] = patched
    return models


def time_interleaved(models: Dict[str, torch.nn.Module], x: torch.Tensor, rounds: int) -> Dict[str, float]:
    """Median seconds per forward of each model, the models taking turns each round.

    The turn order rotates by one every round, so no setting always runs first.
    """
    times: Dict[str, List[float]] = {key: [] for key in models}
    keys = list(models)
    with torch.inference_mode():
        for model in models.values():  # warm-up: allocator, kernels, caches
            model(x)
        for round_ in range(rounds):
            for key in keys[round_ % len(keys):] + keys[:round_ % len(keys)]:
                start = time.perf_counter()
                models[key](x)
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds; the median is reported (>= 5)")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 6, 9])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    models = build_models(args.model, tuple(args.stages))
    size = models["unpruned"].patch_embed.img_size
    x = torch.randn(args.batch, 3, *size)
    seconds = time_interleaved(models, x, args.rounds)
    flops = {key: analytic_flops(model) for key, model in models.items()}

    print(f"{args.model}, batch {args.batch}, fp32 CPU, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} interleaved rounds, stages {tuple(args.stages)}")
    print(f"{'setting':<18}{'GFLOPs':>8}{'img/s':>9}{'speedup':>9}{'ideal':>8}{'achieved/ideal':>16}")
    base_s, base_f = seconds["unpruned"], flops["unpruned"]
    for key in models:
        speedup, ideal = base_s / seconds[key], base_f / flops[key]
        print(f"{key:<18}{flops[key] / 1e9:>8.2f}{args.batch / seconds[key]:>9.1f}"
              f"{speedup:>8.3f}x{ideal:>7.2f}x{speedup / ideal:>15.1%}")


if __name__ == "__main__":
    main()
