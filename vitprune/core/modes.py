"""Running a model in eval mode for a while without losing any module's own mode."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block; afterwards, even after an error, every
    submodule is back in its own mode (``model.train(was_training)`` would also switch a
    frozen, eval-mode batch norm inside a training model back to training)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, mode in modes:
            module.training = mode
