"""Pictures of what a pruned model keeps, per stage: pruned patches dimmed and kept ones
clear, or every group of patches merged into one token in its mean colour."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import SHOW, Show, pyplot
from ..core.grid import conv_grid, conv_padding, forward_options, input_size, patch_conv, patch_grid
from ..core.modes import evaluating
from ..core.numeric import real_or_type_error
from ..core.patching import get_config, kept_positions, state_of, token_groups
from ..core.stem import stem_of

if TYPE_CHECKING:  # matplotlib is an optional extra, imported when a figure is drawn
    from matplotlib.figure import Figure


def _check_stages(model: nn.Module) -> None:
    if not get_config(model).stages:
        raise ValueError("this patch has no pruning stages (stages=()), so nothing is pruned and there is "
                         "nothing to draw; patch with stages, e.g. vitprune.patch(model, keep_rate=0.7)")


def patch_footprints(model: nn.Module, img_size: Tuple[int, int]) -> torch.Tensor:
    """``(N, H, W)`` bool: the input pixels each patch token's convolution reads.

    Follows the patch embedding's kernel, stride and padding, so overlapping patches
    (``overlap_stride``) have overlapping footprints. A hybrid's tokens (a CNN stem before
    the projection) tile the image evenly by their grid: each its cell, though the stem's
    receptive fields reach wider. Patches are in row-major order (timm's and
    ``transformers``').
    """
    H, W = img_size
    if stem_of(model) is not None:
        rows, cols = patch_grid(model, (H, W))
        cell = (torch.arange(H) * rows // H)[:, None] * cols + (torch.arange(W) * cols // W)[None, :]  # (H, W)
        return cell == torch.arange(rows * cols)[:, None, None]
    conv = patch_conv(model)
    if conv is None:
        raise TypeError(f"found no patch-embedding convolution in this {type(model).__name__}")
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv_padding(conv)
    rows, cols = conv_grid(conv, (H, W))
    masks = torch.zeros(rows * cols, H, W, dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            top, left = r * sh - ph, c * sw - pw
            masks[r * cols + c, max(top, 0):top + kh, max(left, 0):left + kw] = True
    return masks


def kept_masks(model: nn.Module, img_size: Tuple[int, int],
               positions: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """``(B, S, H, W)`` bool: the pixels covered by a patch still kept after each stage.

    Args:
        model: A patched model that has run a forward on ``img_size`` inputs.
        img_size: ``(H, W)`` of those inputs (an int for a square).
        positions: :func:`vitprune.kept_positions` output; read from the model when ``None``.

    Raises:
        TypeError: ``img_size`` is not an int or a pair of ints.
        ValueError: The patch has no stages, no forward has run on this thread, or
            ``img_size`` is not that forward's.
    """
    _check_stages(model)
    img_size = input_size(model, img_size)
    recorded = None
    if positions is None:
        positions, recorded = kept_positions(model), state_of(model).records.patches
    positions = list(positions)
    if not positions:
        raise ValueError("no pruning has been recorded on this thread: run a forward pass of the patched model first")
    footprints = patch_footprints(model, img_size).float()  # (N, H, W)
    n = footprints.shape[0]
    if recorded is not None and recorded != n:
        raise ValueError(f"the last forward had {recorded} patches, but a {tuple(img_size)} input has {n}: "
                         "pass the img_size of the images that forward ran on")
    stages = []
    for stage in positions:
        stage = stage.detach().cpu()
        if int(stage.max()) >= n:
            raise ValueError(f"kept positions reach patch {int(stage.max())} but a {img_size} input has {n} patches")
        chosen = torch.zeros(stage.shape[0], n)
        chosen.scatter_add_(1, stage.clamp_min(0), (stage >= 0).float())  # -1 (fusion) adds 0
        stages.append(torch.einsum("bn,nhw->bhw", chosen, footprints) > 0)
    return torch.stack(stages, dim=1)


def draw_panels(images: torch.Tensor, masks: torch.Tensor, dim: float = 0.25) -> torch.Tensor:
    """``(B, 1 + S, H, W, 3)`` float RGB in [0, 1]: the image, then one panel per stage.

    Pixels outside the kept footprint are scaled by ``dim`` and tinted blue-grey.

    Args:
        images: ``(B, C, H, W)`` with values in [0, 1]; 1 or 3 channels.
        masks: ``(B, S, H, W)`` bool from :func:`kept_masks`.
    """
    rgb = _rgb(images)
    pruned = _dimmed(rgb, dim)
    panels = [rgb] + [torch.where(masks[:, s, :, :, None], rgb, pruned) for s in range(masks.shape[1])]
    return torch.stack(panels, dim=1)


def _rgb(images: torch.Tensor) -> torch.Tensor:
    """``(B, H, W, 3)`` float in [0, 1] from ``(B, C, H, W)`` images of 1 or 3 channels."""
    rgb = images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images[:, :3]
    return rgb.permute(0, 2, 3, 1).float().clamp(0, 1)


def _dimmed(rgb: torch.Tensor, dim: float) -> torch.Tensor:
    """Pixels of removed patches: scaled by ``dim`` and tinted blue-grey."""
    return rgb * dim + torch.tensor([0.15, 0.18, 0.3]) * (1 - dim) * 0.5


def group_panels(images: torch.Tensor, groups: Sequence[torch.Tensor], footprints: torch.Tensor,
                 dim: float = 0.25) -> torch.Tensor:
    """``(B, 1 + S, H, W, 3)`` float RGB in [0, 1]: the image, then per stage every group of
    patches (:func:`vitprune.token_groups`) filled with its mean colour, so the patches merged
    into one token show as one flat region, outlined; dropped patches are dimmed as in
    :func:`draw_panels`.

    Args:
        images: ``(B, C, H, W)`` with values in [0, 1]; 1 or 3 channels.
        groups: One ``(B, N)`` per stage.
        footprints: ``(N, H, W)`` from :func:`patch_footprints`.
        dim: Brightness of dropped pixels.
    """
    rgb = _rgb(images)
    footprints = footprints.float()
    dimmed = _dimmed(rgb, dim)
    area = footprints.sum(dim=(1, 2))  # (N,)
    colour_sum = torch.einsum("nhw,bhwc->bnc", footprints, rgb)  # each patch's pixels, summed
    panels = [rgb]
    for group in groups:
        group = group.detach().cpu()
        held, alive = group.clamp_min(0), (group >= 0).float()
        tokens = int(group.max()) + 1
        totals = torch.zeros(group.shape[0], tokens, 3).index_put_(
            (torch.arange(group.shape[0])[:, None], held), colour_sum * alive[..., None], accumulate=True)
        pixels = torch.zeros(group.shape[0], tokens).scatter_add_(1, held, area * alive)
        mean = totals / pixels.clamp_min(1e-12)[..., None]  # (B, tokens, 3): each group's mean colour
        of_patch = mean.gather(1, held[..., None].expand(-1, -1, 3)) * alive[..., None]
        cover = torch.einsum("nhw,bn->bhw", footprints, alive)  # overlapping patches: average them
        painted = torch.einsum("nhw,bnc->bhwc", footprints, of_patch) / cover.clamp_min(1e-12)[..., None]
        panel = torch.where(cover[..., None] > 0, painted, dimmed)
        outlined = (panel + torch.tensor(BORDER)) / 2  # half the border colour: the colours still show
        panels.append(torch.where(_borders(group, footprints)[..., None], outlined, panel))
    return torch.stack(panels, dim=1)


#: The colour of the lines between groups.
BORDER = (1.0, 0.55, 0.1)


def _borders(group: torch.Tensor, footprints: torch.Tensor) -> torch.Tensor:
    """``(B, H, W)`` bool: pixels whose right or lower neighbour belongs to another group (a
    pixel's group is that of the first patch covering it; uncovered pixels are their own)."""
    covered = footprints.any(dim=0)
    first = footprints.float().argmax(dim=0)  # (H, W): the first patch covering each pixel
    pixel_group = torch.where(covered, group[:, first], -2)  # (B, H, W)
    borders = torch.zeros_like(pixel_group, dtype=torch.bool)
    borders[:, :, :-1] |= pixel_group[:, :, 1:] != pixel_group[:, :, :-1]
    borders[:, :-1, :] |= pixel_group[:, 1:, :] != pixel_group[:, :-1, :]
    return borders


def to_display(images: torch.Tensor) -> torch.Tensor:
    """Each image min-max scaled to [0, 1], for showing a normalised model input."""
    flat = images.flatten(1)
    low, high = flat.min(dim=1).values, flat.max(dim=1).values
    scale = (high - low).clamp_min(1e-12)
    return (images - low.view(-1, 1, 1, 1)) / scale.view(-1, 1, 1, 1)


def _as_batch(images: torch.Tensor, name: str) -> torch.Tensor:
    """``(B, C, H, W)`` from ``(C, H, W)`` or ``(B, C, H, W)`` with ``B >= 1``; else ``ValueError``."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(images).__name__}")
    if images.dim() not in (3, 4):
        raise ValueError(f"{name} must be (C, H, W) or (B, C, H, W), got shape {tuple(images.shape)}")
    images = images.unsqueeze(0) if images.dim() == 3 else images
    if images.shape[0] == 0:
        raise ValueError(f"{name} holds no image (a batch of 0): there is nothing to draw")
    return images


def visualize(model: nn.Module, images: torch.Tensor, display: Optional[torch.Tensor] = None, *,
              titles: Optional[List[str]] = None, dim: float = 0.25, panel_inches: float = 2.2,
              show: Show = "kept") -> "Figure":
    """Run ``images`` through a patched model and draw what each stage keeps.

    Args:
        model: A model patched with :func:`vitprune.patch`.
        images: ``(C, H, W)`` or ``(B, C, H, W)`` model inputs (already preprocessed); a
            ``transformers`` model is called with ``interpolate_pos_encoding=True`` when
            they are not its config's size.
        display: The same images in [0, 1] for drawing (e.g. before normalisation);
            the inputs min-max scaled when ``None``.
        titles: One label per image (e.g. the predicted class), shown on the left.
        dim: Brightness of pruned pixels relative to kept ones.
        panel_inches: Size of one panel in the figure.
        show: ``"kept"``: the patches still kept at full brightness, the rest dimmed.
            ``"groups"``: every group of patches one token holds (:func:`vitprune.token_groups`)
            in its mean colour, so merges show as flat regions; dropped patches dimmed.

    Returns:
        A ``matplotlib.figure.Figure``: one row per image, one column for the input and one
        per stage ("after block b: k kept").

    Raises:
        ValueError: ``show``, ``dim`` (a number in [0, 1]) or ``panel_inches`` (a number
            > 0) is out of range, checked before the model runs; or the images or titles do
            not fit each other.
        TypeError: ``dim`` or ``panel_inches`` is no number (checked before the model runs).
    """
    if show not in SHOW:
        raise ValueError(f"unknown show {show!r}; accepted: {', '.join(map(repr, SHOW))}")
    if not 0 <= real_or_type_error("dim", dim, "a number in [0, 1]") <= 1:
        raise ValueError(f"dim is the brightness of pruned pixels against kept ones, in [0, 1], got {dim!r}")
    if not 0 < real_or_type_error("panel_inches", panel_inches, "a number > 0") < math.inf:
        raise ValueError(f"panel_inches must be > 0 and finite, got {panel_inches!r}")
    plt = pyplot()  # the caller's backend: no switching under a notebook

    config = get_config(model)
    _check_stages(model)
    images = _as_batch(images, "images")
    display = to_display(images) if display is None else _as_batch(display, "display")
    if display.shape[0] != images.shape[0] or display.shape[-2:] != images.shape[-2:]:
        raise ValueError(f"display must match images in batch and size: {tuple(display.shape)} "
                         f"vs {tuple(images.shape)}")
    if titles is not None and len(titles) != images.shape[0]:
        raise ValueError(f"titles needs one label per image: {images.shape[0]} images, {len(titles)} titles")
    size = int(images.shape[-2]), int(images.shape[-1])
    with evaluating(model), torch.no_grad():
        model(images, **forward_options(model, size))
    positions = kept_positions(model)
    stages, rates = config.schedule()
    footprints = patch_footprints(model, size)
    if show == "groups":
        panels = group_panels(display.cpu(), token_groups(model), footprints, dim)
    else:
        panels = draw_panels(display.cpu(), kept_masks(model, size, positions), dim)

    B, columns = panels.shape[:2]
    figure, axes = plt.subplots(B, columns, figsize=(panel_inches * columns, panel_inches * B), squeeze=False)
    total = footprints.shape[0]
    for b in range(B):
        for c in range(columns):
            axis = axes[b][c]
            axis.imshow(panels[b, c].numpy(), interpolation="nearest")
            axis.set_xticks([])
            axis.set_yticks([])
            if b == 0:
                if c == 0:
                    axis.set_title(f"input ({total} patches)", fontsize=9)
                else:
                    if show == "groups":
                        label = f"{positions[c - 1].shape[1]} tokens"
                    else:
                        label = f"{int((positions[c - 1][0] >= 0).sum())} kept"
                    axis.set_title(f"after block {stages[c - 1]}: {label}", fontsize=9)
        if titles is not None:
            axes[b][0].set_ylabel(titles[b], fontsize=9)
    method = f"{config.indicator}, {config.selection}" if config.indicator else config.selection
    figure.suptitle(f"{method}, {config.reduction}, keep {rates[0]:g}"
                    + (f", stride {config.overlap_stride}" if config.overlap_stride else ""), fontsize=10)
    figure.tight_layout()
    return figure
