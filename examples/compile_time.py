"""How long ``torch.compile`` takes for a patched model, against the unpruned one.

    python examples/compile_time.py [--model deit_small_patch16_224] [--batch 32] [--keep-rate 0.7]

For the unpruned model, vitprune's defaults, the paper's method (var, three stages) and
the defaults with an opaque step (below), each in a fresh process with an empty inductor
cache (so no setting reuses another's compiled kernels): the seconds of the first compiled
call (tracing, compiling, running), its ratio to the first setting's, the median of five
later calls, how far the compiled output is from eager, and the number of distinct token
counts the blocks see. Inductor compiles kernels for each distinct shape,
so a reduction in every block (the defaults, and token merging) has more to compile than
three stages, and those more than none.

``defaults, opaque step`` is the defaults with their matching and merging
(``merging.bipartite_merge``) registered as one custom operator, so that inductor calls the
eager step in each block instead of generating code for its forty-odd operations: the same
outputs, and how much of the compile time the step's own code generation takes (inference
only: the operator has no backward).

Random weights, inference (``fullgraph=True``, inductor), CPU or ``--device cuda``; nothing
else should run on the machine meanwhile. ``--settings`` picks some; ``--timeout`` gives up on
a setting after that many seconds (its row then says so). Prints one line per setting;
``--json`` writes them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

#: The defaults with :func:`make_opaque_merge`'s step.
OPAQUE = "defaults, opaque step"
SETTINGS = ("unpruned", "defaults", "paper (var)", OPAQUE)

#: The custom operator's schema: ``merging.bipartite_merge``'s arguments, its ``Merged`` fields.
SCHEMA = ("(Tensor tokens, Tensor keys, Tensor sizes, int k, int num_prefix, float crowding)"
          " -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@functools.lru_cache(maxsize=None)
def merge_operator() -> Any:
    """``merging.bipartite_merge`` as the custom operator ``vitprune_examples::bipartite_merge``
    (defined once per process): opaque to ``torch.compile``, which calls it as it is."""
    import torch

    from vitprune.core.merging import bipartite_merge

    def run(tokens: torch.Tensor, keys: torch.Tensor, sizes: torch.Tensor, k: int, num_prefix: int,
            crowding: float) -> "tuple[torch.Tensor, ...]":
        # contiguous: the strides the fake outputs below promise (one slice of the step is a view)
        return tuple(t.contiguous() for t in bipartite_merge(tokens, keys, sizes, k, num_prefix, crowding))

    operator = torch.library.custom_op("vitprune_examples::bipartite_merge", run, mutates_args=(), schema=SCHEMA)

    @operator.register_fake
    def _(tokens: torch.Tensor, keys: torch.Tensor, sizes: torch.Tensor, k: int, num_prefix: int,
          crowding: float) -> "tuple[torch.Tensor, ...]":
        B, n, C = tokens.shape[0], tokens.shape[1] - num_prefix, tokens.shape[2]
        stays, removed = k - (n + 1) // 2, n - k
        index = functools.partial(tokens.new_empty, dtype=torch.long)
        return (tokens.new_empty(B, num_prefix + k, C), sizes.new_empty(B, k), index(B, stays), index(B, removed),
                index(B, removed))

    return operator


def make_opaque_merge() -> Callable[..., Any]:
    """A stand-in for ``merging.bipartite_merge`` that calls it through :func:`merge_operator`
    (built here, outside any traced code)."""
    from vitprune.core.merging import Merged

    operator = merge_operator()

    def opaque_merge(tokens: Any, keys: Any, sizes: Any, k: int, num_prefix: int, crowding: float = 0.0) -> Merged:
        return Merged(*operator(tokens, keys, sizes, k, num_prefix, float(crowding)))

    return opaque_merge


def measure(model_name: str, setting: str, batch: int, keep_rate: float, device: str = "cpu") -> dict:
    """One setting, in this process: the first compiled call's seconds, then later calls', and
    how far the compiled output is from the eager one."""
    import timm
    import torch

    import vitprune
    import vitprune.core.state as state_module
    from vitprune.core.config import PAPER_OPTIONS
    from vitprune.measure.sync import device_sync

    torch.manual_seed(0)
    model = timm.create_model(model_name).eval().to(device)
    if setting in ("defaults", OPAQUE):
        vitprune.patch(model, keep_rate=keep_rate)
    elif setting == "paper (var)":
        vitprune.patch(model, keep_rate=keep_rate, indicator="var", **PAPER_OPTIONS)
    if setting == OPAQUE:
        state_module.bipartite_merge = make_opaque_merge()  # this process only
    counts = []
    hooks = [block.register_forward_pre_hook(lambda _, args: counts.append(int(args[0].shape[1])))
             for block in model.blocks]
    x = torch.randn(batch, 3, *model.patch_embed.img_size, device=device)
    with torch.inference_mode():
        eager = model(x)
    for hook in hooks:
        hook.remove()
    sync = device_sync(torch.device(device))
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        sync()
        start = time.perf_counter()
        out = compiled(x)
        sync()
        first = time.perf_counter() - start
        later = []
        for _ in range(5):
            start = time.perf_counter()
            compiled(x)
            sync()
            later.append(time.perf_counter() - start)
    return {"model": model_name, "setting": setting, "batch": batch, "keep_rate": keep_rate, "device": device,
            "first_call_s": first, "later_call_s": statistics.median(later),
            "max_abs_diff_from_eager": (out - eager).abs().max().item(),
            "distinct_token_counts": len(set(counts)), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--keep-rate", type=float, default=0.7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="which settings, in this order (the ratios are to the first)")
    parser.add_argument("--timeout", type=float, help="give up on a setting after this many seconds")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # a child process's setting
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.one, args.batch, args.keep_rate, args.device)))
        return
    rows = []
    for setting in args.settings:
        command = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
                   "--keep-rate", str(args.keep_rate), "--device", args.device, "--one", setting]
        with tempfile.TemporaryDirectory() as cache:
            try:
                child = subprocess.run(command, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                                       capture_output=True, text=True, check=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                rows.append({"model": args.model, "setting": setting, "batch": args.batch, "device": args.device,
                             "first_call_s": None, "timed_out_after_s": args.timeout})
                print(f"{setting:22s} not compiled within {args.timeout:g} s")
                continue
        row = json.loads(child.stdout.strip().splitlines()[-1])
        rows.append(row)
        first = rows[0]["first_call_s"]
        row["first_call_over_first_setting"] = row["first_call_s"] / first if first else None
        ratio = f"{row['first_call_over_first_setting']:.2f}x {rows[0]['setting']}'s" if first else "-"
        print(f"{setting:22s} first compiled call {row['first_call_s']:6.1f} s ({ratio}), later calls "
              f"{row['later_call_s'] * 1e3:7.1f} ms, {row['distinct_token_counts']} distinct token counts, "
              f"compiled - eager {row['max_abs_diff_from_eager']:.1e}")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(rows, stream, indent=2)


if __name__ == "__main__":
    main()
