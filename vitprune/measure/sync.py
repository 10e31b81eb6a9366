"""Waiting for a device: what a timer calls before reading the clock."""

from __future__ import annotations

from typing import Callable

import torch


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits until ``device`` has finished the work queued on it: CUDA's
    ``synchronize``, or nothing on a device whose operators finish before they return (CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
