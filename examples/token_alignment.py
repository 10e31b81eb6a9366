"""Whether token counts on a multiple of 8 run faster at batch 1 on CPU, in a patched forward.

At batch 1 a block's matrix products have one row per token. A pure timing of timm's
deit_small block at every count from 100 to 197 tokens (interleaved, 15 rounds) read the
counts that are multiples of 8 about 0.15 ms (some 2 % of a block) below the straight line
through all of them, on this project's 2-core AMD EPYC (AVX2, MKL). This script asks
whether a patch gains that in a whole forward, at the same FLOPs.

For each schedule in ``--stages`` (named, as ``patch`` takes them, at ``--keep-rate``) it
times, in one process (interleaved, rotating order, median), against the unpruned model:

- ``S``: ``patch(model, keep_rate=K, stages=S)`` as it runs;
- ``S, aligned``: the same stage blocks, each stage's token count (prefix tokens
  included) moved to the nearest multiple of ``--multiple``, then the latest stages lowered
  by the multiple until the token total (every block's attention and MLP) is within the
  schedule's (:func:`aligned_counts`); run as per-block keep rates (:func:`explicit_config`);
- ``S, control``: every aligned count one token lower: fewer FLOPs than the aligned
  schedule, and no count on a multiple.

If the aligned rows are faster than the control rows, which cost less, the multiple
pays; against ``S`` itself the counts differ by a few tokens a block as well.

    python examples/token_alignment.py --rounds 41 --json docs/bench/cpu_deit_small_token_alignment_b1.json

Random weights (timing only). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
from typing import Dict, List, Sequence, Tuple

import timm
import torch

import vitprune
from vitprune.commands.bench import time_interleaved
from vitprune.core.config import PruneConfig, keep_count, token_counts
from vitprune.measure.flops import schedule_flops


def stage_counts(config: PruneConfig, depth: int, num_patches: int) -> List[int]:
    """Non-prefix tokens left after each stage block of a resolved ``config`` (no fusion token)."""
    stages, rates = config.schedule()
    after = token_counts(rates, stages, depth, num_patches, fuse=False)
    return [after[stage] for stage in stages]


def token_total(stages: Sequence[int], counts: Sequence[int], depth: int, n: int, prefix: int) -> int:
    """Tokens summed over every block's attention and MLP when block ``stages[i]`` leaves
    ``counts[i]`` non-prefix tokens (the reduction sits between a block's attention and MLP)."""
    after = dict(zip(stages, counts))
    total = 0
    for block in range(depth):
        total += prefix + n  # attention
        n = after.get(block, n)
        total += prefix + n  # MLP
    return total


def aligned_counts(stages: Sequence[int], counts: Sequence[int], depth: int, n: int, prefix: int,
                   multiple: int) -> List[int]:
    """``counts`` with ``prefix + count`` moved to the nearest multiple of ``multiple`` (ties
    up, never above the count before), then the latest stages lowered by ``multiple`` until
    the token total is within that of ``counts``."""
    budget = token_total(stages, counts, depth, n, prefix)
    aligned, before = [], n
    for count in counts:
        near = (prefix + count + multiple // 2) // multiple * multiple - prefix
        aligned.append(min(near, before))
        before = aligned[-1]
    stage = len(aligned) - 1
    while token_total(stages, aligned, depth, n, prefix) > budget:
        if aligned[stage] - multiple < 1:
            raise ValueError(f"cannot align {counts} to multiples of {multiple} within their tokens")
        aligned[stage] -= multiple
        for later in range(stage + 1, len(aligned)):  # counts never grow down the blocks
            aligned[later] = min(aligned[later], aligned[stage])
        stage = stage - 1 if stage > 0 else len(aligned) - 1
    return aligned


def explicit_config(base: PruneConfig, counts: Sequence[int], num_patches: int) -> PruneConfig:
    """``base``'s stages with per-stage keep rates that leave exactly ``counts`` at the
    model's own size (``count / tokens entering``; ``keep_count`` gives the count back)."""
    stages, _ = base.schedule()
    rates, n = [], num_patches
    for count in counts:
        rates.append(count / n)
        if keep_count(rates[-1], n) != count:
            raise AssertionError(f"keep rate {rates[-1]} of {n} keeps {keep_count(rates[-1], n)}, not {count}")
        n = count
    return PruneConfig(keep_rate=tuple(rates), stages=tuple(stages), class_only_last=base.class_only_last)


def settings(model: torch.nn.Module, names: Sequence[str], keep_rate: float, multiple: int
             ) -> Dict[str, Tuple[PruneConfig, List[int]]]:
    """Each schedule as ``patch`` resolves it, aligned, and the control; with their stage counts."""
    depth, prefix, n = len(model.blocks), model.num_prefix_tokens, model.patch_embed.num_patches
    out = {}
    for name in names:
        base = vitprune.get_config(vitprune.patch(copy.deepcopy(model), keep_rate=keep_rate, stages=name))
        stages, _ = base.schedule()
        counts = stage_counts(base, depth, n)
        aligned = aligned_counts(stages, counts, depth, n, prefix, multiple)
        control = [c - 1 for c in aligned]
        out[name] = (base, counts)
        out[f"{name}, aligned"] = (explicit_config(base, aligned, n), aligned)
        out[f"{name}, control"] = (explicit_config(base, control, n), control)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--stages", nargs="+", default=["spread", "spread3"])
    parser.add_argument("--keep-rate", type=float, default=0.7)
    parser.add_argument("--multiple", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = timm.create_model(args.model).eval()
    configs = settings(model, args.stages, args.keep_rate, args.multiple)
    models = {"unpruned": model, **{k: vitprune.patch(copy.deepcopy(model), c) for k, (c, _) in configs.items()}}
    flops = {"unpruned": schedule_flops(model, None), **{k: schedule_flops(model, c) for k, (c, _) in configs.items()}}
    x = torch.randn(args.batch, 3, *model.patch_embed.img_size)

    def step(net: torch.nn.Module):
        def run() -> None:
            with torch.inference_mode():
                net(x)
        return run

    seconds = time_interleaved({k: step(m) for k, m in models.items()}, args.rounds, args.warmup, lambda: None,
                               progress=False)
    prefix = model.num_prefix_tokens
    rows = []
    print(f"{args.model}, fp32, batch {args.batch}, keep {args.keep_rate}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds, torch {torch.__version__}, timm {timm.__version__}, {platform.machine()}")
    print(f"{'setting':18s} {'tokens after each stage (prefix incl.)':56s} GFLOPs  speedup  ideal  achieved / ideal")
    for name in models:
        counts = [] if name == "unpruned" else [c + prefix for c in configs[name][1]]
        speedup, ideal = seconds["unpruned"] / seconds[name], flops["unpruned"] / flops[name]
        rows.append({"setting": name, "tokens": counts, "gflops": flops[name] / 1e9, "speedup": speedup,
                     "ideal_speedup": ideal, "achieved_over_ideal": speedup / ideal, "seconds": seconds[name]})
        print(f"{name:18s} {str(counts):56s} {flops[name] / 1e9:6.3f} {speedup:7.3f}x {ideal:5.2f}x {100 * speedup / ideal:8.1f} %")
    if args.json:
        record = {"command": "python examples/token_alignment.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if v is not None and k != "json"),
            "torch": torch.__version__, "timm": timm.__version__, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
