"""Whether a CUDA forward is bound by the host: the time the CPU takes to enqueue one
forward against the time the forward takes, for unpruned deit_small, vitprune's defaults
and the paper's method at keep 0.7, and the defaults' method in every second and every
third block only at the defaults' FLOPs (batch 256, bf16 autocast, random weights):

    python examples/gpu_host_time.py [--device cuda] [--batch 256]

When the enqueue time reaches the forward's, the GPU waits on Python and kernel launches,
and fewer FLOPs buy nothing; ``torch.compile`` or CUDA graphs remove that cost. For each
setting it also counts the operators one forward calls from Python (what the host pays
for, one launch or more each) and the calls that make the host wait for the GPU
(``torch.cuda.set_sync_debug_mode``): a forward that synchronises pays its host time and
its GPU time one after the other instead of overlapping them. ``--device cpu`` runs the
same settings on the CPU (no synchronising calls counted there), to see that the script
still runs before a GPU is at hand; its times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Callable, Optional, Tuple

import timm
import torch

import vitprune
from vitprune.core.config import PAPER_OPTIONS
from vitprune.measure.sync import device_sync


def host_counts(run: Callable[[], None], cuda: bool) -> Tuple[int, Optional[int]]:
    """Operators ``run`` calls from Python (the profiler's top-level events) and, on CUDA, how
    many of its calls synchronise with the GPU (the warnings of sync debug mode)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    operators = sum(1 for event in prof.events() if event.cpu_parent is None)
    if not cuda:
        return operators, None
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="where to run (default: cuda)")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = device_sync(device)
    torch.manual_seed(0)
    model = timm.create_model("deit_small_patch16_224").to(device).eval()
    paper = dict(indicator="var", **PAPER_OPTIONS)
    models = {"unpruned": model, "defaults": vitprune.patch(copy.deepcopy(model), keep_rate=0.7),
              "var": vitprune.patch(copy.deepcopy(model), keep_rate=0.7, **paper)}
    budget = vitprune.analytic_flops(models["defaults"]) / 1e9
    for every, stages in ((2, (1, 3, 5, 7, 9)), (3, (2, 5, 8))):  # the defaults' FLOPs in fewer steps
        rate = vitprune.fit_keep_rate(model, budget, stages=stages)
        models[f"defaults every {every} blocks"] = vitprune.patch(copy.deepcopy(model), keep_rate=rate, stages=stages)
    x = torch.randn(args.batch, 3, 224, 224, device=device)

    def forward(m: torch.nn.Module) -> None:
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16):
            m(x)

    for m in models.values():
        for _ in range(3):
            forward(m)
    for name, m in models.items():
        total, enqueue = [], []
        for _ in range(10):
            sync()
            start = time.perf_counter()
            forward(m)
            queued = time.perf_counter()
            sync()
            total.append(time.perf_counter() - start)
            enqueue.append(queued - start)
        operators, syncs = host_counts(lambda: forward(m), cuda)
        print(f"{name}: forward {statistics.median(total) * 1e3:.2f} ms, of which the CPU enqueues for "
              f"{statistics.median(enqueue) * 1e3:.2f} ms; {operators} operators, "
              f"{'-' if syncs is None else syncs} synchronising calls")


if __name__ == "__main__":
    main()
