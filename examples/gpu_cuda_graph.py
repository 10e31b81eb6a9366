"""On a GPU, replay each model from a CUDA graph and time it against the same model run eagerly:
whether graphs take away the host cost that holds the defaults' eager speedup down.

    python examples/gpu_cuda_graph.py [--models deit_small_patch16_224 ...] [--batches 256 1]

For each model and batch (bfloat16 weights, inference, random weights): the unpruned model,
vitprune's defaults and the paper's method (var) at keep 0.7, and token merging fitted to the
defaults' FLOPs; and two rows that take the defaults apart: with their matching and merging
replaced by a slice to the same token counts (``step_cost.free_step``: what the defaults
would read if their reduction step cost nothing), and without size-aware attention (no
additive bias, so the attention may take a kernel that accepts none). Each is run eagerly
and replayed from a graph captured once
(``torch.cuda.CUDAGraph``; a patched forward reads nothing back to the host, see
tests/test_device_only.py, which is what capture needs). Interleaved rounds, median; each
speedup is over the unpruned model run the same way, in the same rounds
(``vitprune bench``'s ``time_interleaved``: rotating order, two warm-up rounds). Before timing it
checks that a replay gives what an eager call gives on new images, and exits non-zero if not.
That check runs under ``torch.use_deterministic_algorithms``: token merging sums the tokens it
merges with ``index_add_``, whose CUDA kernel adds atomically in no fixed order, so two eager
calls on the same images differ in bfloat16's last bits (on an H200 at batch 256 the logits of
the defaults moved by up to 0.09 from one call to the next); the spread of two plain eager
calls is printed beside it.
``--device cpu`` times the eager column alone, to see that the script still runs before a GPU
is at hand; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from typing import Callable, Dict, Iterator

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for determinism
import timm  # noqa: E402
import torch  # noqa: E402

import vitprune  # noqa: E402
from vitprune.commands.bench import time_interleaved  # noqa: E402
from vitprune.core.config import PAPER_OPTIONS  # noqa: E402
from vitprune.measure.sync import device_sync  # noqa: E402
from step_cost import free_step  # noqa: E402  (examples/, first on sys.path when run as a script)

Forward = Callable[[torch.Tensor], torch.Tensor]


class FreeStep(torch.nn.Module):
    """``model`` (patched) called with its matching and merging replaced by a slice to the
    same token counts (``step_cost.free_step``); a graph captured from it replays that."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with free_step():
            return self.model(x)


def settings(model: torch.nn.Module, keep_rate: float = 0.7) -> Dict[str, torch.nn.Module]:
    """The unpruned ``model``; copies of it patched with the defaults, the paper's method and
    token merging at the defaults' analytic FLOPs; the defaults with a free reduction step
    (:class:`FreeStep`) and without size-aware attention."""
    defaults = vitprune.patch(copy.deepcopy(model), keep_rate=keep_rate)
    merging = vitprune.fit_merging(model, vitprune.analytic_flops(defaults) / 1e9)
    return {"unpruned": model, "defaults": defaults,
            "paper (var)": vitprune.patch(copy.deepcopy(model), keep_rate=keep_rate, indicator="var", **PAPER_OPTIONS),
            "token merging": vitprune.patch(copy.deepcopy(model), merging),
            "defaults, free step": FreeStep(vitprune.patch(copy.deepcopy(model), keep_rate=keep_rate)),
            "defaults, no size bias": vitprune.patch(copy.deepcopy(model), keep_rate=keep_rate, size_aware=False)}


def eager(model: torch.nn.Module) -> Forward:
    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(x)
    return forward


def graphed(model: torch.nn.Module, example: torch.Tensor, warmup: int = 3) -> Forward:
    """``model``'s inference forward captured once as a CUDA graph: each call copies its images
    into the captured input and replays (the returned tensor is the graph's, overwritten by the
    next call)."""
    static = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():  # warm-up off the capture stream, as torch asks
        for _ in range(warmup):
            model(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        out = model(static)

    def forward(x: torch.Tensor) -> torch.Tensor:
        static.copy_(x)
        graph.replay()
        return out
    return forward


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the block, restored after it."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def replay_difference(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Largest absolute difference between a graph replay of ``model`` and its eager forward on
    new images, both under deterministic algorithms (so it is the graph's doing alone)."""
    with deterministic():
        replay = graphed(model, x)
        fresh = torch.randn_like(x)
        return (replay(fresh).float() - eager(model)(fresh).float()).abs().max().item()


def eager_spread(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Largest absolute difference between two plain eager calls on the same images."""
    forward = eager(model)
    return (forward(x).float() - forward(x).float()).abs().max().item()


def repeated(call: Callable[[], object], times: int) -> Callable[[], None]:
    """``call`` run ``times`` times in a row: one reading of a step too short to time alone."""
    def run() -> None:
        for _ in range(times):
            call()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["deit_small_patch16_224", "vit_base_patch16_224"])
    parser.add_argument("--batches", nargs="+", type=int, default=[256, 1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cuda", help="where to run (default: cuda)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = device_sync(device)
    ok = True
    for name in args.models:
        torch.manual_seed(0)
        models = settings(timm.create_model(name).to(device, torch.bfloat16).eval())
        for batch in args.batches:
            generator = torch.Generator(device).manual_seed(batch)
            x = torch.randn(batch, 3, 224, 224, device=device, generator=generator, dtype=torch.bfloat16)
            calls: Dict[str, Callable[[], object]] = {}
            for label, model in models.items():
                calls[f"{label}, eager"] = lambda f=eager(model): f(x)
                if cuda:
                    difference = replay_difference(model, x)
                    ok &= difference == 0.0
                    print(f"{name} batch {batch} {label}: replay - eager on new images (deterministic "
                          f"algorithms), largest difference {difference:.3g}; two plain eager calls "
                          f"differ by {eager_spread(model, x):.3g}")
                    calls[f"{label}, graph"] = lambda f=graphed(model, x): f(x)
            repeats = 1 if batch >= 64 else 20
            seconds = time_interleaved({label: repeated(call, repeats) for label, call in calls.items()},
                                       args.rounds, warmup=2, sync=sync, progress=False)
            medians = {label: total / repeats for label, total in seconds.items()}
            print(f"\n{name}, batch {batch}, bf16, {device.type}, median of {args.rounds} interleaved rounds"
                  f"{'' if repeats == 1 else f' ({repeats} calls a reading)'}")
            for label, seconds in medians.items():
                reference = medians["unpruned, graph" if label.endswith("graph") else "unpruned, eager"]
                print(f"  {label:32s} {seconds * 1e3:8.3f} ms  {reference / seconds:6.3f}x")
            print()
    if not ok:
        print("FAILED: a replay differs from the eager forward")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
