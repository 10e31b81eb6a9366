"""Rope models (timm's ``Eva`` class: eva02, vit_*_rope_*, dinov3, PE): the rotary
embedding of every token follows it through pruning.

timm computes one rotary table for the full patch grid and hands it to every block. After
a pruning stage the tokens are a per-image subset in a new order, so every block from the
first stage on is swapped for a subclass that gathers the table rows of its tokens (by
``PruneState.positions``, the same indices ``kept_positions`` reports). The fusion token
gets the identity rotation (sin 0, cos 1): it stands for many places, so it carries no
position. Pruning blocks also run the attention themselves, through the module's own
submodules, to get the scored row.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from timm.layers import AttentionRope, apply_rot_embed_cat
from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm

from .attention import Scored, attend, project_qkv
from .blocks import Following, refuse_masks

#: The attention classes of Eva blocks that pruning blocks know how to run.
ROPE_ATTENTION = (EvaAttention, AttentionRope)


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


def rope_attention_with_row(
        attn: torch.nn.Module,
        x: torch.Tensor,
        rope: Optional[torch.Tensor],
        num_prefix: int,
        source: str,
        bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Scored]:
    """``attn(x, rope=rope)`` for timm's ``EvaAttention`` or ``AttentionRope``, and the
    row the indicators score (after the rotation, as the attention sees it)."""
    B, N, _ = x.shape
    gate = attn.gate(x).sigmoid() if attn.gate is not None else None
    q, k, v = project_qkv(attn, x)
    q, k = attn.q_norm(q), attn.k_norm(k)
    if rope is not None:
        npt, half = attn.num_prefix_tokens, getattr(attn, "rotate_half", False)
        q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=half)], dim=2).type_as(v)
        k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=half)], dim=2).type_as(v)
    groups = getattr(attn, "num_kv_groups", 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out, row = attend(q, k, v, scale=attn.scale, fused=attn.fused_attn, attn_drop=attn.attn_drop,
                      num_prefix=num_prefix, source=source, bias=bias)
    out = attn.norm(out.transpose(1, 2).flatten(2))
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out)), row


class _RopeFollowing(Following):
    """Eva blocks from the first stage on."""

    def _rope(self, rope: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        positions = self._followed_positions()
        return rope if rope is None or positions is None else follow_rope(rope, positions)


class PruneEvaBlock(_RopeFollowing, EvaBlock):
    """timm ``EvaBlock`` after the first stage: its tokens' rope, and pruning at a stage."""

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        refuse_masks(attn_mask, is_causal)
        state = self.vitprune_state
        bias, rope = state.begin(x, self.vitprune_stage, self.vitprune_follow), self._rope(rope)
        if self.vitprune_stage is None:
            return EvaBlock.forward(self, x, rope=rope, attn_mask=bias)
        out, scored = rope_attention_with_row(self.attn, self.norm1(x), rope, state.num_prefix, state.row_source, bias)
        if self.gamma_1 is not None:
            out = self.gamma_1 * out
        x = state.prune(x + self.drop_path1(out), scored, self.vitprune_stage)
        out = self.mlp(self.norm2(x))
        if self.gamma_2 is not None:
            out = self.gamma_2 * out
        return x + self.drop_path2(out)


class PruneEvaBlockPostNorm(_RopeFollowing, EvaBlockPostNorm):
    """timm ``EvaBlockPostNorm`` after the first stage, likewise."""

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        refuse_masks(attn_mask, is_causal)
        state = self.vitprune_state
        bias, rope = state.begin(x, self.vitprune_stage, self.vitprune_follow), self._rope(rope)
        if self.vitprune_stage is None:
            return EvaBlockPostNorm.forward(self, x, rope=rope, attn_mask=bias)
        out, scored = rope_attention_with_row(self.attn, x, rope, state.num_prefix, state.row_source, bias)
        x = state.prune(x + self.drop_path1(self.norm1(out)), scored, self.vitprune_stage)
        return x + self.drop_path2(self.norm2(self.mlp(x)))


#: Original Eva block class -> its rope-following, pruning subclass.
ROPE_BLOCKS = {EvaBlock: PruneEvaBlock, EvaBlockPostNorm: PruneEvaBlockPostNorm}
