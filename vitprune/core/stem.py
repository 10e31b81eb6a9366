"""A hybrid ViT's CNN stem (timm's ``HybridEmbed.backbone``): the feature map it hands the
patch projection, and the products it runs, read from one forward on a blank image.

A stem's convolutions see the image, not the tokens, so what it costs does not depend on
pruning: it is worked out once per input size. Its feature map decides how many patch
tokens there are (the projection cuts the map, not the image).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .modes import evaluating


class StemPass(NamedTuple):
    """What one image through a stem gave: its feature map's rows and columns, and the
    multiply-adds of its convolutions and Linear layers (fvcore's convention, no biases)."""

    size: Tuple[int, int]
    flops: int


def stem_of(model: nn.Module) -> Optional[nn.Module]:
    """The CNN stem in ``model``'s patch embedding (a hybrid's ``backbone``), or ``None``."""
    stem = getattr(getattr(model, "patch_embed", None), "backbone", None)
    return stem if isinstance(stem, nn.Module) else None


def _products(module: nn.Module, output: torch.Tensor) -> int:
    if isinstance(module, nn.Linear):
        return output.numel() // module.out_features * module.in_features * module.out_features
    conv: nn.modules.conv._ConvNd = module  # type: ignore[assignment]
    return output.numel() * conv.in_channels // conv.groups * math.prod(conv.kernel_size)


def run_stem(stem: nn.Module, img_size: Tuple[int, int]) -> StemPass:
    """One blank ``img_size`` image through ``stem``, in eval mode (a training-mode batch norm
    would update its statistics) and without gradients; every module's mode is restored.

    Raises:
        TypeError: The stem has no 2-d convolution to read its input channels from.
    """
    first = next((m for m in stem.modules() if isinstance(m, nn.Conv2d)), None)
    if first is None:
        raise TypeError(f"found no Conv2d in this {type(stem).__name__} stem to take the image")
    counted: List[int] = []
    handles = [m.register_forward_hook(lambda module, _, output: counted.append(_products(module, output)))
               for m in stem.modules() if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear))]
    image = torch.zeros(1, first.in_channels, *img_size, dtype=first.weight.dtype, device=first.weight.device)
    try:
        with evaluating(stem), torch.no_grad():
            features = stem(image)
    finally:
        for handle in handles:
            handle.remove()
    if isinstance(features, (list, tuple)):  # a features_only network: timm takes the last map
        features = features[-1]
    rows, cols = features.shape[-2:]
    return StemPass((int(rows), int(cols)), sum(counted))
