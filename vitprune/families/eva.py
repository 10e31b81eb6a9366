"""Rope models (timm's ``Eva`` class: eva02, vit_*_rope_*, dinov3, PE): the rotary
embedding of every token follows it through pruning.

timm computes one rotary table for the full patch grid and hands it to every block. After
a pruning stage the tokens are a per-image subset in a new order, so every block from the
first stage on is swapped for a subclass that gathers the table rows of its tokens (by
``PruneState.positions``, the same indices ``kept_positions`` reports). The fusion token
gets the identity rotation (sin 0, cos 1): it stands for many places, so it carries no
position. Stage blocks run the attention themselves (``attention_with_row`` with the
table), to get the scored row; blocks that only follow run timm's own forward. With
``class_only_last`` (a rope ViT whose head reads the class token alone) the last block
computes the prefix tokens alone, its keys rotated by their own rows.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from timm.layers import AttentionRope
from timm.models.eva import Eva, EvaAttention, EvaBlock, EvaBlockPostNorm

from ..core.registry import Family, register
from ..core.state import Scored
from .attention import attention_with_row, prefix_attention
from .layouts import PreNorm, PruningBlock, ResPost, refuse_masks
from .pooling import PrunedModel, timm_class_only_reason


def follow_rope(rope: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rotary table rows of the current tokens.

    Args:
        rope: timm's table in ``cat`` layout (sin then cos on the last axis), patch tokens
            on axis -2: ``(N, E)``, per head ``(H, N, E)`` (mixed rope), or per image
            ``(B, 1 or H, N, E)`` (after patch dropout).
        positions: ``(B, n)`` indices into the ``N`` patches, ``-1`` for a fusion token.

    Returns:
        ``(B, 1 or H, n, E)``, broadcasting over heads like timm's own batched tables.
    """
    N, E = rope.shape[-2], rope.shape[-1]
    identity = torch.cat([rope.new_zeros(E // 2), rope.new_ones(E - E // 2)])
    table = torch.cat([rope, identity.expand(*rope.shape[:-2], 1, E)], dim=-2)
    index = torch.where(positions >= 0, positions, N)
    if table.dim() == 2:
        return table[index].unsqueeze(1)
    if table.dim() == 3:
        return table[:, index].transpose(0, 1)
    B, heads, n = index.shape[0], table.shape[1], index.shape[1]
    return table.gather(2, index[:, None, :, None].expand(B, heads, n, E))


class _EvaBlock(PruningBlock):
    """An Eva block from the first stage on: its tokens' rope and the size bias; a block that
    only follows runs timm's own forward with them."""

    vitprune_follower_runs_timm = True

    def _vitprune_attention(self, tokens: torch.Tensor, context: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
                            ) -> Tuple[torch.Tensor, Scored]:
        (bias, rope), state = context, self.vitprune_state
        return attention_with_row(self.attn, tokens, state.num_prefix, state.row_source, bias, rope)

    def _vitprune_prefix_attention(self, tokens: torch.Tensor,
                                   context: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]) -> torch.Tensor:
        bias, rope = context
        return prefix_attention(self.attn, tokens, self.vitprune_state.num_prefix, bias, rope)

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        refuse_masks(attn_mask, is_causal)
        bias, positions = self._vitprune_begin(x), self._vitprune_positions()
        if rope is not None and positions is not None:
            rope = follow_rope(rope, positions)
        if self._vitprune_prefix_only():
            return self._vitprune_prefix_forward(x, (bias, rope))
        if self.vitprune_stage is None:
            return super().forward(x, rope=rope, attn_mask=bias)  # the timm block's own forward
        return self._vitprune_forward(x, (bias, rope))


class PruneEvaBlock(_EvaBlock, PreNorm, EvaBlock):
    """timm ``EvaBlock`` from the first stage on."""


class PruneEvaBlockPostNorm(_EvaBlock, ResPost, EvaBlockPostNorm):
    """timm ``EvaBlockPostNorm`` from the first stage on."""


class PruneEva(PrunedModel, Eva):
    """timm ``Eva`` while patched: its attention pool reads all tokens, prefix included."""

    def _vitprune_pool_prefix(self) -> bool:
        return self.attn_pool is not None


def class_only_reason(model: torch.nn.Module) -> Optional[str]:
    """Why ``class_only_last`` cannot apply to this Eva, or ``None``: it needs a head that
    reads the class token alone and a last block of timm's ``EvaBlock`` or
    ``EvaBlockPostNorm`` with timm's ``EvaAttention`` or ``AttentionRope``, its fused ``qkv``
    (if any) a ``Linear``: ``prefix_attention`` multiplies by slices of its weight."""
    return timm_class_only_reason(
        model, (EvaBlock, EvaBlockPostNorm), "timm's EvaAttention or AttentionRope with a fused qkv Linear or separate "
        "projections", lambda attn: type(attn) in (EvaAttention, AttentionRope)
        and (attn.qkv is None or isinstance(attn.qkv, torch.nn.Linear)))


register(Family(
    model=Eva, patched=PruneEva, blocks={EvaBlock: PruneEvaBlock, EvaBlockPostNorm: PruneEvaBlockPostNorm},
    attention=(EvaAttention, AttentionRope), follows=True, check_followers=False,
    examples="eva02_*, rope ViTs, DINOv3 and PE on timm's Eva", class_only=class_only_reason,
))
