"""The patch grid a model makes from an input size (overlapping embeddings included)."""

from __future__ import annotations

import math
from numbers import Integral
from typing import Optional, Sequence, Tuple

from torch import nn


def input_size(model: nn.Module, img_size: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """``(H, W)``: ``img_size`` (an int means square), or the model's own input size.

    Raises:
        TypeError: ``img_size`` is not an int or a pair of ints.
        ValueError: A side is smaller than the patch embedding's kernel (no patch fits).
    """
    embed = getattr(model, "patch_embed", None)
    if img_size is None:
        if embed is None or getattr(embed, "img_size", None) is None:
            raise TypeError(f"pass img_size: this {type(model).__name__} does not say its input size")
        return tuple(int(s) for s in embed.img_size)
    pair = (img_size, img_size) if isinstance(img_size, Integral) else img_size
    if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
            or not all(isinstance(s, Integral) and not isinstance(s, bool) for s in pair)):
        raise TypeError(f"img_size must be an int or a pair of ints (H, W), got {img_size!r}")
    pair = tuple(int(s) for s in pair)
    conv = getattr(embed, "proj", None)
    kernel = tuple(conv.kernel_size) if isinstance(conv, nn.Conv2d) else (1, 1)
    if any(s < k for s, k in zip(pair, kernel)):
        raise ValueError(f"img_size must be at least the patch size {kernel} on each side, got {pair}")
    return pair


def num_patches(model: nn.Module, img_size: Optional[Sequence[int]] = None, stride: Optional[int] = None) -> int:
    """Patch tokens the patch embedding makes from an ``img_size`` input.

    Follows the convolution (kernel, stride, padding), so overlapping embeddings count
    right too; ``stride`` overrides the convolution's. With ``dynamic_img_pad`` the input
    is first padded to a multiple of the patch size, as timm does.
    """
    embed = model.patch_embed
    conv = embed.proj
    sizes = input_size(model, img_size)
    if getattr(embed, "dynamic_img_pad", False):
        sizes = tuple(math.ceil(s / p) * p for s, p in zip(sizes, embed.patch_size))
    strides = conv.stride if stride is None else (stride, stride)
    grid = [(s + 2 * p - k) // st + 1 for s, p, k, st in zip(sizes, conv.padding, conv.kernel_size, strides)]
    return grid[0] * grid[1]
