"""Whether a CUDA forward is bound by the host: the time the CPU takes to enqueue one
forward against the time the forward takes, for unpruned deit_small, vitprune's defaults
and the paper's method at keep 0.7 (batch 256, bf16 autocast, random weights):

    python examples/gpu_host_time.py

When the enqueue time reaches the forward's, the GPU waits on Python and kernel launches,
and fewer FLOPs buy nothing; ``torch.compile`` or CUDA graphs remove that cost.
"""

from __future__ import annotations

import copy
import statistics
import time

import timm
import torch

import vitprune
from vitprune.core.config import PAPER_OPTIONS


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
        print(f"{name}: forward {statistics.median(total) * 1e3:.2f} ms, of which the CPU enqueues for "
              f"{statistics.median(enqueue) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
