"""How one transformer block's CPU time grows with its token count, and what that allows a
token reduction at most.

A reduction cuts FLOPs in proportion to tokens, but a block's time is about ``a + b N``
for ``N`` tokens (attention's ``N^2`` is a small part at these sizes), and at small batches the fixed part ``a`` (reading the block's weights,
per-operation costs) is a large share: no reduction of tokens removes it. This script
times one block of a timm model (random weights) at token counts from all of them down to
a fifth, in turns in one process (interleaved, rotating order, median; see ``vitprune
bench``), fits ``a, b`` by least squares, and prints:

- per token count: the time against the full count's, and the tokens' share;
- the fixed share ``a / t(N)`` at the full count;
- with ``--distinct``, the same again for every block of the model in turn, timed in the same
  rounds against the first block called as many times: each block then reads its own weights
  (as in a forward) instead of one block's weights staying in the cache, which tells the
  fixed part's memory traffic from its per-operation costs;
- for the defaults at ``--keep-rate`` (``class_only_last=False``: every block a plain
  block), the time the fit predicts from the schedule's token counts (each block at the
  mean of the tokens entering and leaving it), against the unpruned model's, beside the
  analytic FLOP ratio: the share of the FLOP ratio a free reduction step could reach;
- with ``--range LOW HIGH``, every token count from ``LOW`` to ``HIGH`` (prefix included)
  instead of the shares, and how far the counts on a multiple of ``--multiple`` (default 8)
  sit from the fitted line against the others (docs/speed.md, "Token counts on a multiple
  of 8": ``--range 100 197 --rounds 15``).

    python examples/block_cost.py --batch 1 --json docs/bench/cpu_deit_small_block_cost_b1.json
    python examples/block_cost.py --batch 32 --json docs/bench/cpu_deit_small_block_cost_b32.json
    python examples/block_cost.py --batch 1 --distinct --json docs/bench/cpu_deit_small_block_cost_distinct_b1.json

Run it with nothing else on the machine: a second busy core moves the ratios by a fifth.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from typing import Callable, List, Sequence

import timm
import torch

from vitprune.commands.bench import time_interleaved
from vitprune.core.config import PruneConfig, token_counts
from vitprune.core.grid import num_patches
from vitprune.measure.flops import schedule_flops

#: Shares of the full token count timed (the full count itself first).
SHARES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)


def repeat_for(call: Callable[[], None], seconds: float) -> int:
    """How many calls take about ``seconds`` (at least one): short calls are timed in runs,
    so the clock's resolution and one-off stalls weigh less."""
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-6)
    return max(1, round(seconds / once))


def fit(tokens: Sequence[int], seconds: Sequence[float]) -> List[float]:
    """``[a, b]`` of ``t(N) = a + b N``, least squares."""
    n = torch.tensor(tokens, dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), n], dim=1)
    solution = torch.linalg.lstsq(design, torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)).solution
    return solution.flatten().tolist()


def predicted(coefficients: Sequence[float], tokens: float) -> float:
    a, b = coefficients
    return a + b * tokens


def multiple_residuals(rows: Sequence[dict], multiple: int) -> "tuple[float, float]":
    """Mean ``ms - fit_ms`` of the rows whose token count is a multiple of ``multiple``, and of the others."""
    on = [r["ms"] - r["fit_ms"] for r in rows if r["tokens"] % multiple == 0]
    off = [r["ms"] - r["fit_ms"] for r in rows if r["tokens"] % multiple]
    return sum(on) / max(1, len(on)), sum(off) / max(1, len(off))


def run(once: Callable[[Sequence[torch.nn.Module], int], None], blocks: Sequence[torch.nn.Module], n: int,
        repeats: int) -> None:
    """``repeats`` calls of ``once(blocks, n)``: one timed step."""
    for _ in range(repeats):
        once(blocks, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--keep-rate", type=float, default=0.7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--distinct", action="store_true",
                        help="also time every block in turn (per block), against the first block as often")
    parser.add_argument("--range", nargs=2, type=int, metavar=("LOW", "HIGH"),
                        help="time every token count LOW..HIGH (prefix included) instead of the shares")
    parser.add_argument("--multiple", type=int, default=8,
                        help="with --range: compare the counts on this multiple with the others")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = timm.create_model(args.model, pretrained=False).eval()
    prefix, depth = model.num_prefix_tokens, len(model.blocks)
    patches = num_patches(model)
    counts = [prefix + max(1, round(share * patches)) for share in SHARES]
    if args.range:
        low, high = args.range
        counts = list(range(high, low - 1, -1))  # the full count first, as with the shares
    inputs = {n: torch.randn(args.batch, n, model.embed_dim) for n in counts}
    # each mode: the blocks one call runs, in turn, on the same input
    modes = {"one block": [model.blocks[0]]}
    if args.distinct:
        modes = {"one block": [model.blocks[0]] * depth, "every block": list(model.blocks)}

    def once(blocks: Sequence[torch.nn.Module], n: int) -> None:
        with torch.inference_mode():
            for block in blocks:
                block(inputs[n])

    steps = {}
    for mode, blocks in modes.items():
        for n in counts:
            repeats = repeat_for(lambda: once(blocks, n), 0.02)
            steps[(mode, n)] = (functools.partial(run, once, blocks, n, repeats), repeats * len(blocks))
    medians = time_interleaved({f"{mode}, {n}": step for (mode, n), (step, _) in steps.items()}, args.rounds,
                               args.warmup, lambda: None)

    config = PruneConfig(keep_rate=args.keep_rate, class_only_last=False).resolve(depth, patches)
    left = token_counts(config.keep_rate, config.stages, depth, patches, fuse=False)
    entering = (patches,) + left[:-1]
    flop_ratio = schedule_flops(model, None) / schedule_flops(model, config)
    full = counts[0]
    results = {}
    for mode in modes:
        seconds = {n: medians[f"{mode}, {n}"] / steps[(mode, n)][1] for n in counts}  # per block call
        coefficients = fit(counts, [seconds[n] for n in counts])
        rows = [{"tokens": n, "ms": 1e3 * seconds[n], "time_share": seconds[n] / seconds[full],
                 "token_share": n / full, "fit_ms": 1e3 * predicted(coefficients, n)} for n in counts]
        timed = f"its {depth} blocks in turn, per block" if mode == "every block" else "one block"
        print(f"{args.model}, {timed}, batch {args.batch}, {args.threads} threads, median of {args.rounds} rounds")
        print(f"{'tokens':>7} {'ms':>8} {'time share':>11} {'token share':>12} {'fit ms':>8}")
        for row in rows:
            print(f"{row['tokens']:>7} {row['ms']:>8.3f} {row['time_share']:>11.3f} {row['token_share']:>12.3f} "
                  f"{row['fit_ms']:>8.3f}")
        a = coefficients[0]
        fixed_share = a / predicted(coefficients, full)
        print(f"fit: t(N) = {1e3 * a:.3f} ms + {1e6 * coefficients[1]:.3f} us N; fixed share at {full} tokens: "
              f"{fixed_share:.1%}")
        residuals = multiple_residuals(rows, args.multiple) if args.range else None
        if residuals is not None:
            print(f"off the fitted line: counts on a multiple of {args.multiple} {residuals[0]:+.3f} ms on average, "
                  f"the others {residuals[1]:+.3f} ms")
        pruned = sum(predicted(coefficients, prefix + (i + o) / 2) for i, o in zip(entering, left))
        ceiling = depth * predicted(coefficients, full) / pruned
        print(f"defaults at keep {args.keep_rate} (class_only_last=False): FLOP ratio {flop_ratio:.3f}x; the fit "
              f"predicts {ceiling:.3f}x with a free reduction step: {ceiling / flop_ratio:.1%} of the FLOP ratio")
        results[mode] = {"rows": rows, "fit_seconds": coefficients, "fixed_share": fixed_share,
                         "defaults_flop_ratio": flop_ratio, "defaults_predicted_speedup_free_step": ceiling}
        if residuals is not None:
            results[mode]["off_line_ms_on_multiple_and_not"] = residuals
    if args.json:
        with open(args.json, "w") as handle:
            found = {"modes": results} if args.distinct else results["one block"]
            json.dump({"command": vars(args), "torch": torch.__version__, "timm": timm.__version__,
                       "machine": platform.machine(), **found}, handle, indent=1)
            handle.write("\n")


if __name__ == "__main__":
    main()
