"""Peak memory of one step: CUDA allocator statistics, or a fresh process's RSS on CPU."""

from __future__ import annotations

import multiprocessing
import resource
from typing import Callable

import torch

_PAGE = resource.getpagesize()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def cuda_peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Peak bytes the CUDA caching allocator held during ``step``, above what it held before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _child(build: Callable[[], Callable[[], None]], queue: "multiprocessing.Queue[int]") -> None:
    step = build()
    before = _rss_bytes()
    _reset_peak_rss()
    step()
    queue.put(max(0, _peak_rss_bytes() - before))


def cpu_peak_bytes(build: Callable[[], Callable[[], None]], timeout: float = 600.0) -> int:
    """Peak resident-memory growth over one step, measured in a fresh process.

    ``build`` (picklable: a module-level function or a ``functools.partial`` of one)
    makes the model, its input and the step in the child; the child resets the kernel's
    peak-RSS mark, runs the step once and reports how far its peak resident size rose
    above its size just before. A fresh process keeps memory cached by earlier steps
    out of the figure. In training it includes the gradients and optimizer state that
    the first step allocates. (Where ``/proc/self/clear_refs`` cannot be written, the
    peak since the child started is used, and growth below it is not seen.)
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(build, queue))
    process.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
