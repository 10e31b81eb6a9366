"""Whether a CUDA forward is bound by the host: the time the CPU takes to enqueue one
forward against the time the forward takes, for unpruned deit_small, vitprune's defaults
and the paper's method at keep 0.7 (batch 256, bf16 autocast, random weights):

    python examples/gpu_host_time.py

When the enqueue time reaches the forward's, the GPU waits on Python and kernel launches,
and fewer FLOPs buy nothing; ``torch.compile`` or CUDA graphs remove that cost. For each
setting it also counts the operators one forward calls from Python (what the host pays
for, one launch or more each) and the calls that make the host wait for the GPU
(``torch.cuda.set_sync_debug_mode``): a forward that synchronises pays its host time and
its GPU time one after the other instead of overlapping them.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Callable, Tuple

import timm
import torch

import vitprune
from vitprune.core.config import PAPER_OPTIONS


def host_counts(run: Callable[[], None]) -> Tuple[int, int]:
    """Operators ``run`` calls from Python (the profiler's top-level events) and how many
    of its calls synchronise with the GPU (the warnings of sync debug mode)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    operators = sum(1 for event in prof.events() if event.cpu_parent is None)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("called a synchronizing" in str(w.message) for w in caught)
    return operators, syncs


def main() -> None:
    torch.manual_seed(0)
    model = timm.create_model("deit_small_patch16_224").cuda().eval()
    paper = dict(indicator="var", **PAPER_OPTIONS)
    models = {"unpruned": model, "defaults": vitprune.patch(copy.deepcopy(model), keep_rate=0.7),
              "var": vitprune.patch(copy.deepcopy(model), keep_rate=0.7, **paper)}
    x = torch.randn(256, 3, 224, 224, device="cuda")

    def forward(m: torch.nn.Module) -> None:
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            m(x)

    for m in models.values():
        for _ in range(3):
            forward(m)
    for name, m in models.items():
        total, enqueue = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            forward(m)
            queued = time.perf_counter()
            torch.cuda.synchronize()
            total.append(time.perf_counter() - start)
            enqueue.append(queued - start)
        operators, syncs = host_counts(lambda: forward(m))
        print(f"{name}: forward {statistics.median(total) * 1e3:.2f} ms, of which the CPU enqueues for "
              f"{statistics.median(enqueue) * 1e3:.2f} ms; {operators} operators, {syncs} synchronising calls")


if __name__ == "__main__":
    main()
