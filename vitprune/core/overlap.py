"""Overlapping patch embeddings (docs/method.md §8): the same kernel, a smaller stride.

The patch-embedding convolution keeps its weights and kernel (the patch size) and
takes stride ``s``, so the grid grows to ``floor((L - p) / s) + 1`` per side. The
absolute position embeddings are resampled to the new grid by bicubic interpolation
(prefix-token entries unchanged). Everything changed is recorded so it can be put back
exactly. While overlapped, the embedding's class is :class:`OverlapPatchEmbed`, whose
``dynamic_feat_size`` knows the stride (``forward_intermediates``' NCHW maps and dynamic
image sizes use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import torch
import torch.nn.functional as F
from timm.layers import PatchEmbed, resample_abs_pos_embed, to_2tuple
from torch import nn


def overlapped_grid(img_size: Tuple[int, int], patch_size: Tuple[int, int], stride: int) -> Tuple[int, int]:
    """Grid of a stride-``stride`` convolution with kernel ``patch_size``: ``(L - p) // s + 1`` per side."""
    (height, width), (ph, pw) = img_size, patch_size
    return (height - ph) // stride + 1, (width - pw) // stride + 1


def resample_grid_embed(pos_embed: torch.Tensor, num_prefix: int, old_grid: Tuple[int, int],
                        new_grid: Tuple[int, int]) -> torch.Tensor:
    """Bicubically resample the grid part of ``(1, num_prefix + H * W, C)`` position embeddings.

    The first ``num_prefix`` entries are kept as they are. Interpolation runs in float32
    (``align_corners=False``, no antialiasing) and the result has the input's dtype; an
    unchanged grid returns the input's values unchanged.
    """
    if tuple(old_grid) == tuple(new_grid):
        return pos_embed.clone()
    prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
    C = grid.shape[-1]
    image = grid.reshape(1, *old_grid, C).permute(0, 3, 1, 2).float()
    image = F.interpolate(image, size=tuple(new_grid), mode="bicubic", align_corners=False)
    grid = image.permute(0, 2, 3, 1).reshape(1, -1, C).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


class OverlapPatchEmbed(PatchEmbed):
    """timm ``PatchEmbed`` while its stride is smaller than its kernel: the grid of an image
    size follows the stride (``PatchEmbed`` assumes stride == patch size), in the forward at
    dynamic image sizes and in ``set_input_size`` alike."""

    def dynamic_feat_size(self, img_size: Tuple[int, int]) -> Tuple[int, int]:
        (height, width), (ph, pw) = img_size, self.patch_size
        if self.dynamic_img_pad:  # padded up to whole patches, as PatchEmbed.forward pads
            height, width = -(-height // ph) * ph, -(-width // pw) * pw
        return overlapped_grid((height, width), (ph, pw), self.proj.stride[0])

    def _init_img_size(self, img_size: Any) -> Tuple[Any, Any, Any]:
        # what PatchEmbed.set_input_size (and so the model's) sets the grid from
        size, grid, count = super()._init_img_size(img_size)
        if size is None:
            return size, grid, count
        grid = overlapped_grid(size, self.patch_size, self.proj.stride[0])
        return size, grid, grid[0] * grid[1]

    def set_input_size(self, img_size: Any = None, patch_size: Any = None) -> None:
        """timm's, for a new image size; a new patch size is refused (before anything changes)."""
        if patch_size is not None and to_2tuple(patch_size) != tuple(self.patch_size):
            raise ValueError(
                f"cannot change the patch size ({tuple(self.patch_size)} to {to_2tuple(patch_size)}) while "
                f"vitprune's overlap_stride={self.proj.stride[0]} is applied: vitprune.unpatch(model), "
                "set the size, then patch again"
            )
        super().set_input_size(img_size=img_size)


@dataclass
class OverlapRecord:
    """What :func:`apply_overlap` changed, to put back exactly."""

    stride: Tuple[int, int]
    img_size: Tuple[int, int]
    grid_size: Tuple[int, int]
    num_patches: int
    pos_embed: "torch.Tensor | None"


def check_overlap(model: nn.Module, stride: int, current: "OverlapRecord | None" = None) -> None:
    """Raise unless ``model``'s patch embedding can take ``stride`` (before anything changes).

    ``current``: the record of an overlap the model has now, which patching again undoes first.
    """
    embed: Any = getattr(model, "patch_embed", None)  # timm's attributes, untyped
    if type(embed) not in (PatchEmbed, OverlapPatchEmbed) or not isinstance(getattr(embed, "proj", None), nn.Conv2d):
        raise TypeError(
            f"overlap_stride needs timm's PatchEmbed with a Conv2d projection; this model has "
            f"{type(embed).__name__} (hybrid CNN stems cannot overlap)"
        )
    original_stride = tuple(embed.proj.stride) if current is None else tuple(current.stride)
    if original_stride != tuple(embed.patch_size):
        raise TypeError(f"the patch embedding already has stride {original_stride} "
                        f"for patch size {tuple(embed.patch_size)}")
    if stride > min(embed.patch_size):
        raise ValueError(
            f"overlap_stride must be in [1, {min(embed.patch_size)}] (at most the patch size "
            f"{tuple(embed.patch_size)}), got {stride}"
        )


def _grid_prefix(model: nn.Module) -> int:
    """Position-embedding entries before the grid: prefix tokens, unless they have none."""
    return 0 if getattr(model, "no_embed_class", False) else int(getattr(model, "num_prefix_tokens"))


@torch.no_grad()
def apply_overlap(model: nn.Module, stride: int) -> OverlapRecord:
    """Give the patch embedding stride ``stride`` and resample the position embeddings, in place.

    The position embedding stays the same ``nn.Parameter`` object (its data is replaced),
    so its device, dtype and ``requires_grad`` are kept; its shape changes.
    """
    embed: Any = model.patch_embed  # timm's attributes, untyped
    pos_embed = getattr(model, "pos_embed", None)
    record = OverlapRecord(
        stride=tuple(embed.proj.stride), img_size=tuple(embed.img_size), grid_size=tuple(embed.grid_size),
        num_patches=embed.num_patches,
        pos_embed=None if pos_embed is None else pos_embed.data,
    )
    new_grid = overlapped_grid(embed.img_size, embed.patch_size, stride)
    if pos_embed is not None:
        pos_embed.data = resample_grid_embed(pos_embed.data, _grid_prefix(model), embed.grid_size, new_grid)
    embed.proj.stride = (stride, stride)
    embed.__class__ = OverlapPatchEmbed
    embed.grid_size = new_grid
    embed.num_patches = new_grid[0] * new_grid[1]
    return record


@torch.no_grad()
def remove_overlap(model: nn.Module, record: OverlapRecord) -> None:
    """Undo :func:`apply_overlap` exactly, from its record. The position embedding gets its
    original values in the dtype and on the device it has now (the model may have been
    moved or cast since). If the image size was changed since (timm's ``set_input_size``),
    the model is left as that call would have left the unpatched model: the original
    position embedding resampled as timm resamples it, to the size's unoverlapped grid."""
    embed: Any = model.patch_embed  # timm's attributes, untyped
    embed.__class__ = PatchEmbed
    embed.proj.stride = record.stride
    embed.grid_size = record.grid_size
    embed.num_patches = record.num_patches
    resized = tuple(embed.img_size) != record.img_size
    if resized:
        embed.img_size, embed.grid_size, embed.num_patches = embed._init_img_size(embed.img_size)
    if record.pos_embed is not None:
        pos_embed: Any = model.pos_embed
        original = record.pos_embed.to(device=pos_embed.device, dtype=pos_embed.dtype)
        if resized and tuple(embed.grid_size) != record.grid_size:
            original = resample_abs_pos_embed(original, new_size=list(embed.grid_size), old_size=list(record.grid_size),
                                              num_prefix_tokens=_grid_prefix(model))
        pos_embed.data = original
