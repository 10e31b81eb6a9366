"""The patch grid a model makes from an input size (overlapping embeddings included).

timm ViTs say their input size and patch convolution in ``model.patch_embed``;
``transformers`` vision models say them in their (vision) config, and their patch
convolution is the one whose kernel is the config's patch size. A hybrid's patch
convolution cuts its CNN stem's feature map, not the image (``core.stem``).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, Optional, Sequence, Tuple

from torch import nn

from .numeric import TEXT_OR_BYTES, is_whole
from .stem import run_stem, stem_of


def vision_config(model: nn.Module) -> Any:
    """A ``transformers`` model's vision config (its own config for a vision model), or ``None``."""
    config = getattr(model, "config", None)
    config = getattr(config, "vision_config", config)
    return config if hasattr(config, "image_size") and hasattr(config, "patch_size") else None


def _pair(value: Any) -> Tuple[int, int]:
    if is_whole(value):
        return int(value), int(value)
    height, width = value
    return int(height), int(width)


def patch_conv(model: nn.Module) -> Optional[nn.Conv2d]:
    """The convolution that cuts the image (a hybrid: its stem's feature map) into patch
    tokens, or ``None`` when there is none to find (a hybrid without a projection, a
    module of no known kind)."""
    conv = getattr(getattr(model, "patch_embed", None), "proj", None)
    if isinstance(conv, nn.Conv2d):
        return conv
    config = vision_config(model)
    if config is not None:
        kernel = _pair(config.patch_size)
        return next((m for m in model.modules() if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == kernel),
                    None)
    return None


def own_input_size(model: nn.Module) -> Optional[Tuple[int, int]]:
    """``(H, W)`` the model says it takes, or ``None`` when it does not say."""
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is not None:
        return _pair(size)
    config = vision_config(model)
    return None if config is None else _pair(config.image_size)


def forward_options(model: nn.Module, size: Tuple[int, int]) -> Dict[str, bool]:
    """Keyword arguments ``model`` needs to run on ``size`` images: a ``transformers`` model
    away from its own size refuses the input unless asked to ``interpolate_pos_encoding``;
    timm's (``dynamic_img_size``) and everything else need none."""
    own = own_input_size(model)
    if own is None or own == tuple(size):
        return {}
    takes = "interpolate_pos_encoding" in inspect.signature(model.forward).parameters
    return {"interpolate_pos_encoding": True} if takes else {}


def input_size(model: nn.Module, img_size: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """``(H, W)``: ``img_size`` (an int means square), or the model's own input size.

    Raises:
        TypeError: ``img_size`` is not an int or a pair of ints, or it is ``None`` and the
            model does not say its input size.
        ValueError: A side is smaller than the patch embedding's kernel (no patch fits).
    """
    if img_size is None:
        own = own_input_size(model)
        if own is None:
            raise TypeError(f"pass img_size: this {type(model).__name__} does not say its input size")
        return own
    pair = (img_size, img_size) if is_whole(img_size) else img_size
    if (isinstance(pair, TEXT_OR_BYTES) or not isinstance(pair, Sequence) or len(pair) != 2
            or not all(is_whole(s) for s in pair)):
        raise TypeError(f"img_size must be an int or a pair of ints (H, W), got {img_size!r}")
    pair = int(pair[0]), int(pair[1])
    conv = patch_conv(model)
    kernel = tuple(conv.kernel_size) if conv is not None else (1, 1)
    if any(s < k for s, k in zip(pair, kernel)):
        raise ValueError(f"img_size must be at least the patch size {kernel} on each side, got {pair}")
    return pair


def runnable_size(model: nn.Module, img_size: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """:func:`input_size`, for a count of what ``model`` runs at that size: refused where the
    model cannot run there.

    Raises:
        TypeError, ValueError: As :func:`input_size`; ``ValueError`` also where timm built the
            model for one input size (``strict_img_size``: no ``dynamic_img_size``) and
            ``img_size`` is another.
    """
    size = input_size(model, img_size)
    own = own_input_size(model)
    if getattr(getattr(model, "patch_embed", None), "strict_img_size", False) and own is not None and size != own:
        raise ValueError(f"this {type(model).__name__} takes {own} inputs only (timm built it without "
                         f"dynamic_img_size), so it cannot run at img_size={size}: build it with "
                         "dynamic_img_size=True, or call model.set_input_size(img_size=...) first")
    return size


def num_patches(model: nn.Module, img_size: Optional[Sequence[int]] = None, stride: Optional[int] = None) -> int:
    """Patch tokens the patch embedding makes from an ``img_size`` input: the product of
    :func:`patch_grid`'s rows and columns (which says how it follows the embedding)."""
    rows, cols = patch_grid(model, img_size, stride)
    return rows * cols


def patch_grid(model: nn.Module, img_size: Optional[Sequence[int]] = None,
               stride: Optional[int] = None) -> Tuple[int, int]:
    """Rows and columns of patch tokens the patch embedding makes from an ``img_size`` input.

    Follows the convolution (kernel, stride, padding), so overlapping embeddings count
    right too; ``stride`` overrides the convolution's. With ``dynamic_img_pad`` the input
    is first padded to a multiple of the patch size, as timm does. A hybrid's convolution
    follows its CNN stem's feature map (or is that map, where it has no projection): the
    one timm measured at the model's own input size, else one blank image through the
    stem (:func:`~vitprune.core.stem.run_stem`).

    Raises:
        TypeError: The model has no patch convolution to follow, or ``stride`` is given
            for a hybrid (a stem's feature map cannot overlap).
    """
    conv, stem = patch_conv(model), stem_of(model)
    if conv is None and stem is None:
        raise TypeError(f"found no patch-embedding convolution in this {type(model).__name__}")
    embed = getattr(model, "patch_embed", None)
    sizes: Tuple[int, ...] = input_size(model, img_size)
    if stem is not None:
        if stride is not None:
            raise TypeError(f"a stride applies to a patch convolution over the image, not to this "
                            f"{type(model).__name__}'s CNN stem (hybrid stems cannot overlap)")
        own = getattr(embed, "feature_size", None)  # timm measured it at the model's own size
        if own is not None and sizes == own_input_size(model):
            sizes = _pair(own)
        else:
            sizes = run_stem(stem, (sizes[0], sizes[1])).size
    if getattr(embed, "dynamic_img_pad", False):
        sizes = tuple(math.ceil(s / p) * p for s, p in zip(sizes, _pair(getattr(embed, "patch_size"))))
    if conv is None:  # a hybrid whose stem's feature map is the grid (no projection)
        return sizes[0], sizes[1]
    return conv_grid(conv, (sizes[0], sizes[1]), stride)


def conv_padding(conv: nn.Conv2d) -> Tuple[int, int]:
    """Pixels ``conv`` pads before its first row and column: none for ``"valid"``, torch's
    ``(k - 1) // 2`` for ``"same"`` (which pads the rest after), else its own padding."""
    if conv.padding == "same":
        return (conv.kernel_size[0] - 1) // 2, (conv.kernel_size[1] - 1) // 2
    if isinstance(conv.padding, str):  # "valid"
        return 0, 0
    return conv.padding[0], conv.padding[1]


def conv_grid(conv: nn.Conv2d, img_size: Tuple[int, int], stride: Optional[int] = None) -> Tuple[int, int]:
    """Rows and columns of tokens ``conv`` makes from an ``img_size`` input (``stride``
    overriding its own): ``(L + 2 p - k) // s + 1`` per side, one per pixel with ``"same"``."""
    if conv.padding == "same":  # only allowed with stride 1
        return img_size
    (ph, pw), (kh, kw) = conv_padding(conv), conv.kernel_size
    sh, sw = conv.stride if stride is None else (stride, stride)
    return (img_size[0] + 2 * ph - kh) // sh + 1, (img_size[1] + 2 * pw - kw) // sw + 1
