"""Relative-position-bias models (timm's ``Beit`` and ``VisionTransformerRelPos``): the
bias follows the kept tokens.

Their attention adds a ``(1, H, L, L)`` bias over the full token grid. After a pruning
stage every block (from the first stage on, so all are swapped) gathers the rows and
columns of its own tokens, per image, giving ``(B, H, l, l)``; a fusion token gets zero
bias to and from every token (it stands for many places). Prefix tokens keep theirs. With
``class_only_last`` (a class token read alone by the head: ``vit_relpos_*_cls_*``, or any
of these built with ``global_pool="token"``) the last block computes the prefix tokens
alone and gathers only their rows of the bias.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from timm.models.beit import Attention as BeitAttention
from timm.models.beit import Beit
from timm.models.beit import Block as BeitBlock
from timm.models.vision_transformer_relpos import (RelPosAttention, RelPosBlock, ResPostRelPosBlock,
                                                   VisionTransformerRelPos)

from ..core.registry import Family, register
from ..core.state import Scored
from .attention import attention_with_row, prefix_attention
from .layouts import PreNorm, PruningBlock, ResPost
from .pooling import MeanPoolingHead, PrunedModel, timm_class_only_reason


def follow_bias(bias: torch.Tensor, tokens: torch.Tensor, queries: Optional[int] = None) -> torch.Tensor:
    """The bias among the current tokens.

    Args:
        bias: ``(1, H, L, L)`` over the full token sequence.
        tokens: ``(B, l)`` indices into ``L``; the index ``L`` stands for a fusion token.
        queries: Only the rows of the first ``queries`` tokens (``None``: every row).

    Returns:
        ``(B, H, l or queries, l)``; entries to or from a fusion token are 0.
    """
    table = torch.nn.functional.pad(bias[0], (0, 1, 0, 1))  # (H, L + 1, L + 1), zero last row and column
    rows = tokens if queries is None else tokens[:, :queries]
    return table[:, rows[:, :, None], tokens[:, None, :]].transpose(0, 1)


def token_index(positions: torch.Tensor, num_prefix: int, length: int) -> torch.Tensor:
    """Indices into the full sequence of ``length`` tokens: prefix first, then the patches
    in ``positions`` (``-1``, a fusion token, maps to ``length``)."""
    B = positions.shape[0]
    prefix = torch.arange(num_prefix, device=positions.device).expand(B, num_prefix)
    patches = torch.where(positions >= 0, positions + num_prefix, length)
    return torch.cat([prefix, patches], dim=1)


def full_bias(attn: torch.nn.Module, shared: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The bias timm's attention adds, over the full grid, as ``(1, H, L, L)``: BEiT adds its
    own table and the shared one (BEiT's shared table comes as ``(H, L, L)``); relpos uses its
    own when it has one, else the shared one."""
    bias: Optional[torch.Tensor]
    if isinstance(attn, BeitAttention):
        own = attn._get_rel_pos_bias() if attn.relative_position_bias_table is not None else None
        bias = shared if own is None else own if shared is None else own + shared
    else:
        rel_pos: Any = attn.rel_pos  # timm's RelPosAttention: a RelPosMlp, RelPosBias or None
        bias = rel_pos.get_bias() if rel_pos is not None else shared
    return bias if bias is None or bias.dim() == 4 else bias.reshape(1, *bias.shape[-3:])


class _BiasBlock(PruningBlock):
    """A BEiT or relpos block from the first stage on: the bias among its own tokens plus the
    size bias, through vitprune's attention (timm's adds the full-grid table itself)."""

    def _vitprune_bias(self, tokens: torch.Tensor, shared: Optional[torch.Tensor],
                       queries: Optional[int] = None) -> Optional[torch.Tensor]:
        """The relative bias among ``tokens`` plus the size bias. After a stage the bias is
        gathered for the current tokens, the rows of the first ``queries`` of them only
        (``None``: every row); before any stage it is the full grid's, whose prefix rows
        ``prefix_attention`` takes itself."""
        sizes = self._vitprune_begin(tokens)
        bias, positions = full_bias(self.attn, shared), self._vitprune_positions()
        if bias is not None and positions is not None:
            bias = follow_bias(bias, token_index(positions, self.vitprune_state.num_prefix, bias.shape[-1]), queries)
        if sizes is not None:
            bias = sizes if bias is None else bias + sizes
        return bias

    def _vitprune_attention(self, tokens: torch.Tensor, shared: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Scored]:
        state = self.vitprune_state
        return attention_with_row(self.attn, tokens, state.num_prefix, state.row_source,
                                  self._vitprune_bias(tokens, shared))

    def _vitprune_prefix_attention(self, tokens: torch.Tensor, shared: Optional[torch.Tensor]) -> torch.Tensor:
        P = self.vitprune_state.num_prefix
        return prefix_attention(self.attn, tokens, P, self._vitprune_bias(tokens, shared, P))

    def _vitprune_run(self, x: torch.Tensor, shared: Optional[torch.Tensor]) -> torch.Tensor:
        if self._vitprune_prefix_only():
            return self._vitprune_prefix_forward(x, shared)
        return self._vitprune_forward(x, shared)


class PruneBeitBlock(_BiasBlock, PreNorm, BeitBlock):
    """timm BEiT ``Block`` from the first stage on."""

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._vitprune_run(x, shared_rel_pos_bias)


class PruneRelPosBlock(_BiasBlock, PreNorm, RelPosBlock):
    """timm ``RelPosBlock`` (pre-norm) from the first stage on."""

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._vitprune_run(x, shared_rel_pos)


class PruneResPostRelPosBlock(_BiasBlock, ResPost, ResPostRelPosBlock):
    """timm ``ResPostRelPosBlock`` (norm after each branch) from the first stage on."""

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._vitprune_run(x, shared_rel_pos)


class PruneBeit(MeanPoolingHead, PrunedModel, Beit):
    """timm ``Beit`` while patched."""


class PruneVisionTransformerRelPos(MeanPoolingHead, PrunedModel, VisionTransformerRelPos):
    """timm ``VisionTransformerRelPos`` while patched."""


def class_only_reason(model: torch.nn.Module) -> Optional[str]:
    """Why ``class_only_last`` cannot apply to this BEiT or relpos model, or ``None``: it needs
    a head that reads the class token alone (``global_pool="token"``) and a last block of
    these families with their own attention, its ``qkv`` a ``Linear``."""
    return timm_class_only_reason(
        model, (BeitBlock, RelPosBlock, ResPostRelPosBlock), "BEiT's Attention or timm's RelPosAttention with a "
        "fused qkv Linear", lambda attn: type(attn) in (BeitAttention, RelPosAttention)
        and isinstance(attn.qkv, torch.nn.Linear))


_BLOCKS = {BeitBlock: PruneBeitBlock, RelPosBlock: PruneRelPosBlock, ResPostRelPosBlock: PruneResPostRelPosBlock}
for _model, _patched, _examples in ((Beit, PruneBeit, "beit*"), (VisionTransformerRelPos, PruneVisionTransformerRelPos,
                                                                 "vit_relpos_*, vit_srelpos_*")):
    register(Family(model=_model, patched=_patched, blocks=_BLOCKS, attention=(BeitAttention, RelPosAttention),
                    follows=True, examples=_examples, class_only=class_only_reason))
