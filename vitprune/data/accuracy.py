"""Top-1 accuracy of a model on uint8 images (vitprune's own data)."""

from __future__ import annotations

import torch

from ..core.modes import evaluating
from .datasets import to_input


@torch.inference_mode()
def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 500) -> float:
    """Fraction of ``images`` (uint8 ``(N, H, W)``) whose top-1 prediction is the label.

    Runs in eval mode and puts every module's own mode back afterwards.
    """
    correct = 0
    with evaluating(model):
        for start in range(0, len(images), batch):
            logits = model(to_input(images[start:start + batch]))
            correct += (logits.argmax(-1) == labels[start:start + batch]).sum().item()
    return correct / len(images)
