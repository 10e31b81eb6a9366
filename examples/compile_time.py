"""How long ``torch.compile`` takes for a patched model, against the unpruned one.

    python examples/compile_time.py [--model deit_small_patch16_224] [--batch 32] [--keep-rate 0.7]

For the unpruned model, vitprune's defaults and the paper's method (var, three stages),
each in a fresh process with an empty inductor cache (so no setting reuses another's
compiled kernels): the seconds of the first compiled call (tracing, compiling, running),
its ratio to the unpruned model's, the median of five later calls, and the number of
distinct token counts the blocks see. Inductor compiles kernels for each distinct shape,
so a reduction in every block (the defaults, and token merging) has more to compile than
three stages, and those more than none. Random weights, CPU, inference (``fullgraph=True``,
inductor); nothing else should run on the machine meanwhile. Prints one line per setting;
``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = ("unpruned", "defaults", "paper (var)")


def measure(model_name: str, setting: str, batch: int, keep_rate: float) -> dict:
    """One setting, in this process: the first compiled call's seconds, then later calls'."""
    import timm
    import torch

    import vitprune
    from vitprune.core.config import PAPER_OPTIONS

    torch.manual_seed(0)
    model = timm.create_model(model_name).eval()
    if setting == "defaults":
        vitprune.patch(model, keep_rate=keep_rate)
    elif setting == "paper (var)":
        vitprune.patch(model, keep_rate=keep_rate, indicator="var", **PAPER_OPTIONS)
    counts = []
    hooks = [block.register_forward_pre_hook(lambda _, args: counts.append(int(args[0].shape[1])))
             for block in model.blocks]
    x = torch.randn(batch, 3, *model.patch_embed.img_size)
    with torch.inference_mode():
        model(x)
    for hook in hooks:
        hook.remove()
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        start = time.perf_counter()
        compiled(x)
        first = time.perf_counter() - start
        later = []
        for _ in range(5):
            start = time.perf_counter()
            compiled(x)
            later.append(time.perf_counter() - start)
    return {"model": model_name, "setting": setting, "batch": batch, "keep_rate": keep_rate,
            "first_call_s": first, "later_call_s": statistics.median(later),
            "distinct_token_counts": len(set(counts)), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--keep-rate", type=float, default=0.7)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # a child process's setting
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.one, args.batch, args.keep_rate)))
        return
    rows = []
    for setting in SETTINGS:
        with tempfile.TemporaryDirectory() as cache:
            child = subprocess.run([sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
                                    "--keep-rate", str(args.keep_rate), "--one", setting],
                                   env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                                   capture_output=True, text=True, check=True)
        row = json.loads(child.stdout.strip().splitlines()[-1])
        rows.append(row)
        row["first_call_over_unpruned"] = row["first_call_s"] / rows[0]["first_call_s"]
        print(f"{setting:12s} first compiled call {row['first_call_s']:6.1f} s "
              f"({row['first_call_over_unpruned']:.2f}x the unpruned model's), later calls "
              f"{row['later_call_s'] * 1e3:7.1f} ms, {row['distinct_token_counts']} distinct token counts")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(rows, stream, indent=2)


if __name__ == "__main__":
    main()
