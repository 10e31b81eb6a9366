"""FLOP counts, in fvcore's convention (one multiply-add = one flop).

Two independent counts that cross-check each other:

- :func:`count_flops` traces the model with fvcore. fvcore has no handle for
  ``aten::scaled_dot_product_attention``, which timm uses, and would silently count the
  attention products as zero; we register one.
- :func:`analytic_flops` counts the matrix products from the token schedule: patch
  embedding, per block the qkv / attention / projection / MLP products at the number of
  tokens each sees, the scoring row and fusion in pruning blocks, and the head. Norms,
  activations and softmaxes are left out (fvcore counts norms: about 0.2 %).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
from timm.models.vision_transformer import Block, ResPostBlock
from torch import nn

from ..core.config import PruneConfig, token_counts
from ..core.grid import input_size, num_patches
from ..core.merging import bipartite_rounds
from ..core.patching import is_patched, get_config


@dataclass(frozen=True)
class BlockTokens:
    """Tokens one block sees: ``attn`` in its attention, ``mlp`` in its MLP (fewer after pruning)."""

    attn: int
    mlp: int


def token_schedule(config: Optional[PruneConfig], depth: int, num_prefix: int, num_patches: int) -> List[BlockTokens]:
    """The tokens each block sees under ``config`` (``None``: unpruned)."""
    counts = (num_patches,) * depth
    if config is not None:
        config = config.resolve(depth, num_patches)
        counts = token_counts(config.keep_rate, config.stages, depth, num_patches, config.reduction == "fuse")
    before = (num_patches,) + counts[:-1]
    return [BlockTokens(attn=num_prefix + a, mlp=num_prefix + m) for a, m in zip(before, counts)]


def reduction_flops(config: PruneConfig, n: int, out: int, C: int, block: nn.Module) -> int:
    """Products of one reduction step from ``n`` to ``out`` non-prefix tokens of width ``C``:
    key similarities (``d``-wide averaged keys) between removed or candidate tokens and the
    kept or destination ones, then the fusion or merge sums."""
    if out == n:
        return 0
    kept = out - 1 if config.reduction == "fuse" else out
    removed = n - kept
    total = (n - out) * C  # the fusion or merge sums
    if config.selection != "top" or config.reduction == "merge":
        d = C // block.attn.num_heads if hasattr(block, "attn") else C
        if config.selection == "top":
            total += removed * kept * d
        else:
            if config.selection == "bipartite":  # each round: candidates x destinations
                for before in [n] + bipartite_rounds(n, kept)[:-1]:
                    total += (before // 2) * ((before + 1) // 2) * d
            else:
                split = max(1, min(kept, n // 2))
                total += (n - split) * split * d
    return total


def _check_analytic(model: nn.Module) -> None:
    blocks = getattr(model, "blocks", None)
    plain = blocks is not None and all(
        isinstance(b, (Block, ResPostBlock)) and isinstance(getattr(getattr(b, "mlp", None), "fc1", None), nn.Linear)
        for b in blocks)
    embed = getattr(model, "patch_embed", None)
    if not plain or not isinstance(getattr(embed, "proj", None), nn.Conv2d) or hasattr(embed, "backbone"):
        raise TypeError(
            f"analytic FLOPs cover ViTs with Block or ResPostBlock blocks (Linear MLP) and a convolutional "
            f"patch embedding; use vitprune.count_flops (fvcore) for this {type(model).__name__}"
        )


def analytic_flops(model: nn.Module, img_size: Optional[Sequence[int]] = None) -> int:
    """FLOPs of one image through ``model`` (patched or not), from its token schedule.

    Args:
        model: A timm ``VisionTransformer`` with ``Block`` or ``ResPostBlock`` blocks.
        img_size: ``(H, W)`` or an int; the model's own input size when ``None``.
    """
    return schedule_flops(model, get_config(model) if is_patched(model) else None, img_size)


def schedule_flops(model: nn.Module, config: Optional[PruneConfig], img_size: Optional[Sequence[int]] = None) -> int:
    """FLOPs of one image through ``model`` if it were patched with ``config`` (``None``: unpruned).

    ``config.overlap_stride``, when set, replaces the patch embedding's stride.

    Raises:
        TypeError: For models this formula does not describe (parallel blocks, a CNN
            stem, other families): use :func:`count_flops` (fvcore) for those.
    """
    _check_analytic(model)
    conv = model.patch_embed.proj
    C = model.embed_dim
    patches = num_patches(model, img_size, None if config is None else config.overlap_stride)
    depth = len(model.blocks)
    if config is not None:
        config = config.resolve(depth, patches)
    schedule = token_schedule(config, depth, model.num_prefix_tokens, patches)

    kh, kw = conv.kernel_size
    total = patches * C * conv.in_channels * kh * kw
    for index, tokens in enumerate(schedule):
        hidden = model.blocks[index].mlp.fc1.out_features
        L = tokens.attn
        total += L * C * 3 * C + 2 * L * L * C + L * C * C
        if config is not None and index in config.stages:
            total += L * C + reduction_flops(config, L - model.num_prefix_tokens,
                                             tokens.mlp - model.num_prefix_tokens, C, model.blocks[index])
        total += 2 * tokens.mlp * C * hidden
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        total += head.in_features * head.out_features
    return total


def _sdpa_flops(inputs: List[Any], outputs: List[Any]) -> int:
    """fvcore handle: ``q @ k^T`` and ``attn @ v``, i.e. ``B * H * Lq * Lk * (d_qk + d_v)``."""
    from fvcore.nn.jit_handles import get_shape

    q, k, v = (get_shape(value) for value in inputs[:3])
    return math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])


def count_flops(model: nn.Module, img_size: Optional[Sequence[int]] = None) -> int:
    """FLOPs of one image through ``model`` (patched or not), traced by fvcore.

    Args:
        model: Any module taking a ``(1, 3, H, W)`` image; a timm ViT for ``img_size=None``.
        img_size: ``(H, W)`` or an int; the model's own input size when ``None``.
    """
    with warnings.catch_warnings():  # fvcore's import path touches the deprecated torch.jit.script
        warnings.simplefilter("ignore", FutureWarning)
        from fvcore.nn import FlopCountAnalysis

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    param = next(model.parameters(), None)
    stem = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)  # the stem's input
    if param is None or stem is None:
        raise TypeError(
            f"count_flops traces a model that takes (1, C, H, W) images through a convolutional stem; "
            f"this {type(model).__name__} has {'no parameters' if param is None else 'no Conv2d'}"
        )
    channels = stem.in_channels
    x = torch.zeros(1, channels, *input_size(model, img_size),
                    dtype=param.dtype, device=param.device)
    was_training = model.training
    model.eval()
    try:
        analysis = FlopCountAnalysis(model, x).set_op_handle("aten::scaled_dot_product_attention", _sdpa_flops)
        analysis.unsupported_ops_warnings(False)
        analysis.uncalled_modules_warnings(False)
        analysis.tracer_warnings("none")
        with torch.no_grad():
            return int(analysis.total())
    finally:
        model.train(was_training)
