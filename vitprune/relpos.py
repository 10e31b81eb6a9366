"""Relative-position-bias models (timm's ``Beit`` and ``VisionTransformerRelPos``): the
bias follows the kept tokens.

Their attention adds a ``(1, H, L, L)`` bias over the full token grid. After a pruning
stage every block (from the first stage on, so all are swapped) gathers the rows and
columns of its own tokens, per image, giving ``(B, H, l, l)``; a fusion token gets zero
bias to and from every token (it stands for many places). Prefix tokens keep theirs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from timm.models.beit import Attention as BeitAttention
from timm.models.beit import Block as BeitBlock
from timm.models.vision_transformer_relpos import RelPosAttention, RelPosBlock, ResPostRelPosBlock

from .attention import Scored, attend, project_qkv
from .blocks import Following

#: The attention classes of bias blocks that the swapped blocks know how to run.
BIAS_ATTENTION = (BeitAttention, RelPosAttention)


def follow_bias(bias: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The bias among the current tokens.

    Args:
        bias: ``(1, H, L, L)`` over the full token sequence.
        tokens: ``(B, l)`` indices into ``L``; the index ``L`` stands for a fusion token.

    Returns:
        ``(B, H, l, l)``; entries to or from a fusion token are 0.
    """
    table = torch.nn.functional.pad(bias[0], (0, 1, 0, 1))  # (H, L + 1, L + 1), zero last row and column
    return table[:, tokens[:, :, None], tokens[:, None, :]].transpose(0, 1)


def token_index(positions: torch.Tensor, num_prefix: int, length: int) -> torch.Tensor:
    """Indices into the full sequence of ``length`` tokens: prefix first, then the patches
    in ``positions`` (``-1``, a fusion token, maps to ``length``)."""
    B = positions.shape[0]
    prefix = torch.arange(num_prefix, device=positions.device).expand(B, num_prefix)
    patches = torch.where(positions >= 0, positions + num_prefix, length)
    return torch.cat([prefix, patches], dim=1)


def full_bias(attn: torch.nn.Module, shared: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The bias timm's attention adds, over the full grid: BEiT adds its own table and the
    shared one; relpos uses its own when it has one, else the shared one."""
    if isinstance(attn, BeitAttention):
        own = attn._get_rel_pos_bias() if attn.relative_position_bias_table is not None else None
        if own is None:
            return shared
        return own if shared is None else own + shared
    return attn.rel_pos.get_bias() if attn.rel_pos is not None else shared


def bias_attention_with_row(attn: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                            num_prefix: int, source: str) -> Tuple[torch.Tensor, Scored]:
    """``attn(x)`` for BEiT's or relpos's attention with ``bias`` already for these tokens,
    and the row the indicators score (with the bias, as the attention sees it)."""
    B, N, C = x.shape
    q, k, v = project_qkv(attn, x)
    if isinstance(attn, RelPosAttention):
        q, k = attn.q_norm(q), attn.k_norm(k)
    out, row = attend(q, k, v, scale=attn.scale, fused=attn.fused_attn, attn_drop=attn.attn_drop,
                      num_prefix=num_prefix, source=source, bias=bias)
    return attn.proj_drop(attn.proj(out.transpose(1, 2).reshape(B, N, C))), row


class _BiasFollowing(Following):
    """Bias-family blocks from the first stage on."""

    def _attend(self, x: torch.Tensor, shared: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Scored]:
        state = self.vitprune_state
        sizes = state.begin(x, self.vitprune_stage, self.vitprune_follow)  # x: the block input or its norm
        bias, positions = full_bias(self.attn, shared), self._followed_positions()
        if bias is not None and positions is not None:
            bias = follow_bias(bias, token_index(positions, state.num_prefix, bias.shape[-1]))
        if sizes is not None:
            bias = sizes if bias is None else bias + sizes
        return bias_attention_with_row(self.attn, x, bias, state.num_prefix, state.row_source)

    def _prune(self, x: torch.Tensor, scored: Scored) -> torch.Tensor:
        if self.vitprune_stage is None:
            return x
        return self.vitprune_state.prune(x, scored, self.vitprune_stage)


class PruneBeitBlock(_BiasFollowing, BeitBlock):
    """timm BEiT ``Block`` after the first stage: its tokens' bias, and pruning at a stage."""

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        out, row = self._attend(self.norm1(x), shared_rel_pos_bias)
        if self.gamma_1 is not None:
            out = self.gamma_1 * out
        x = self._prune(x + self.drop_path1(out), row)
        out = self.mlp(self.norm2(x))
        if self.gamma_2 is not None:
            out = self.gamma_2 * out
        return x + self.drop_path2(out)


class PruneRelPosBlock(_BiasFollowing, RelPosBlock):
    """timm ``RelPosBlock`` (pre-norm) after the first stage, likewise."""

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        out, row = self._attend(self.norm1(x), shared_rel_pos)
        x = self._prune(x + self.drop_path1(self.ls1(out)), row)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class PruneResPostRelPosBlock(_BiasFollowing, ResPostRelPosBlock):
    """timm ``ResPostRelPosBlock`` (norm after each branch) after the first stage, likewise."""

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        out, row = self._attend(x, shared_rel_pos)
        x = self._prune(x + self.drop_path1(self.norm1(out)), row)
        return x + self.drop_path2(self.norm2(self.mlp(x)))


#: Original bias block class -> its bias-following, pruning subclass.
BIAS_BLOCKS = {BeitBlock: PruneBeitBlock, RelPosBlock: PruneRelPosBlock, ResPostRelPosBlock: PruneResPostRelPosBlock}
