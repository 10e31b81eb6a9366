"""Analytic FLOPs from the token schedule (fvcore's convention: one multiply-add = one flop).

Counts the matrix products, which are all but a fraction of a percent of a ViT's work:
patch embedding, per block the qkv / attention / projection / MLP products at the
number of tokens each sees, the scoring row and fusion in pruning blocks, and the head.
Norms, activations and softmaxes are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from torch import nn

from .config import PruneConfig, keep_count
from .patching import is_patched, get_config


@dataclass(frozen=True)
class BlockTokens:
    """Tokens one block sees: ``attn`` in its attention, ``mlp`` in its MLP (fewer after pruning)."""

    attn: int
    mlp: int


def token_schedule(config: Optional[PruneConfig], depth: int, num_prefix: int, num_patches: int) -> List[BlockTokens]:
    """The tokens each block sees under ``config`` (``None``: unpruned)."""
    stage_of = {}
    if config is not None:
        config = config.resolve(depth)
        stage_of = {index: number for number, index in enumerate(config.stages)}
    n = num_patches
    schedule = []
    for index in range(depth):
        before = num_prefix + n
        if index in stage_of:
            k = keep_count(config.keep_rate[stage_of[index]], n)
            n = k + 1 if config.fuse and k < n else k
        schedule.append(BlockTokens(attn=before, mlp=num_prefix + n))
    return schedule


def _grid(model: nn.Module, img_size: Optional[Tuple[int, int]]) -> int:
    embed = model.patch_embed
    if img_size is None:
        grid = embed.grid_size
    elif hasattr(embed, "dynamic_feat_size"):
        grid = embed.dynamic_feat_size(tuple(img_size))
    else:
        grid = tuple(s // p for s, p in zip(img_size, embed.patch_size))
    return int(grid[0]) * int(grid[1])


def analytic_flops(model: nn.Module, img_size: Optional[Sequence[int]] = None) -> int:
    """FLOPs of one image through ``model`` (patched or not), from its token schedule.

    Args:
        model: A timm ``VisionTransformer`` with ``Block`` blocks.
        img_size: ``(H, W)`` of the input; the model's own size when ``None``.
    """
    embed = model.patch_embed
    C = model.embed_dim
    num_patches = _grid(model, None if img_size is None else tuple(img_size))
    P = model.num_prefix_tokens
    config = get_config(model) if is_patched(model) else None
    schedule = token_schedule(config, len(model.blocks), P, num_patches)

    kh, kw = embed.proj.kernel_size
    total = num_patches * C * embed.proj.in_channels * kh * kw
    for index, tokens in enumerate(schedule):
        block = model.blocks[index]
        hidden = block.mlp.fc1.out_features
        L = tokens.attn
        total += L * C * 3 * C + 2 * L * L * C + L * C * C
        if config is not None and index in config.stages:  # the class row, then the fusion sum
            total += L * C + (L - tokens.mlp) * C
        total += 2 * tokens.mlp * C * hidden
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        total += head.in_features * head.out_features
    return total
