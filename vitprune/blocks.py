"""Pruning versions of timm's transformer blocks, swapped in by class for an exact match.

Each subclass only overrides ``forward`` and calls the block's own submodules, so
``state_dict`` keys, parameters and hooks are the block's own, and restoring the
original class undoes the patch. Where attention and MLP run in sequence the tokens
are pruned between them (as in the paper); where they run side by side
(``ParallelScalingBlock``) the whole block runs on all tokens and pruning follows it.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block, ParallelScalingBlock, ParallelThingsBlock, ResPostBlock

from .attention import Scored, attention_with_row, join_scored, parallel_scaling_with_row
from .state import PruneState

#: Attributes a patch adds to a block; ``unpatch`` deletes exactly these.
BLOCK_ATTRS = ("vitprune_state", "vitprune_stage", "vitprune_follow")


def refuse_masks(attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    if attn_mask is not None or is_causal:
        raise ValueError(
            "vitprune: a pruning block (or, in rope models, any block after one) cannot apply "
            "attn_mask or is_causal, because the mask no longer matches the tokens after pruning; "
            "unpatch the model to use masks"
        )


class _Pruning:
    """What every swapped plain-ViT block carries (set by ``patch``): a stage number, or
    ``None`` for a block that only follows a stage (it runs timm's own forward with the
    size-aware attention bias)."""

    vitprune_state: PruneState
    vitprune_stage: Optional[int]
    vitprune_follow: Optional[int]  # the stage whose output this block receives, or None

    def _attend(self, attn: Attention, x: torch.Tensor, bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Scored]:
        state = self.vitprune_state
        return attention_with_row(attn, x, state.num_prefix, state.row_source, bias)

    def _prune(self, x: torch.Tensor, scored: Scored) -> torch.Tensor:
        return self.vitprune_state.prune(x, scored, self.vitprune_stage)

    def _begin(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool) -> Optional[torch.Tensor]:
        refuse_masks(attn_mask, is_causal)
        return self.vitprune_state.begin(x, self.vitprune_stage, self.vitprune_follow)


class Following:
    """Rope and bias-family blocks, swapped from the first stage on (set by ``patch``)."""

    vitprune_state: PruneState
    vitprune_stage: Optional[int]  # this block's stage number, or None: it only follows
    vitprune_follow: Optional[int]  # the stage whose output this block receives, or None

    def _followed_positions(self) -> Optional[torch.Tensor]:
        """``(B, n)`` original patch index of each incoming non-prefix token (``-1``: fusion),
        or ``None`` before the first stage."""
        if self.vitprune_follow is None:
            return None
        return self.vitprune_state.positions[self.vitprune_follow]


class PruneBlock(_Pruning, Block):
    """timm ``Block`` (pre-norm) that prunes tokens between its attention and its MLP."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        bias = self._begin(x, attn_mask, is_causal)
        if self.vitprune_stage is None:
            return Block.forward(self, x, attn_mask=bias)
        out, scored = self._attend(self.attn, self.norm1(x), bias)
        x = self._prune(x + self.drop_path1(self.ls1(out)), scored)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class PruneResPostBlock(_Pruning, ResPostBlock):
    """timm ``ResPostBlock`` (norm after each branch) that prunes between attention and MLP."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        bias = self._begin(x, attn_mask, is_causal)
        if self.vitprune_stage is None:
            return ResPostBlock.forward(self, x, attn_mask=bias)
        out, scored = self._attend(self.attn, x, bias)
        x = self._prune(x + self.drop_path1(self.norm1(out)), scored)
        return x + self.drop_path2(self.norm2(self.mlp(x)))


class PruneParallelThingsBlock(_Pruning, ParallelThingsBlock):
    """timm ``ParallelThingsBlock`` (parallel attentions, then parallel MLPs) that prunes
    between the two; the scored row holds the heads of all parallel attentions."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        bias = self._begin(x, attn_mask, is_causal)
        if self.vitprune_stage is None:
            return ParallelThingsBlock.forward(self, x, attn_mask=bias)
        outs, parts = [], []
        for branch in self.attns:
            out, scored = self._attend(branch.attn, branch.norm(x), bias)
            outs.append(branch.drop_path(branch.ls(out)))
            parts.append(scored)
        x = self._prune(x + torch.stack(outs).sum(dim=0), join_scored(parts))
        return x + torch.stack([ffn(x) for ffn in self.ffns]).sum(dim=0)


class PruneParallelScalingBlock(_Pruning, ParallelScalingBlock):
    """timm ``ParallelScalingBlock`` (attention and MLP side by side from one input
    projection): the block runs on all tokens, then prunes its output."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        bias = self._begin(x, attn_mask, is_causal)
        if self.vitprune_stage is None:
            return ParallelScalingBlock.forward(self, x, attn_mask=bias)
        state = self.vitprune_state
        x, scored = parallel_scaling_with_row(self, x, state.num_prefix, state.row_source, bias)
        return self._prune(x, scored)


#: Original block class -> its pruning subclass.
PRUNE_BLOCKS: Dict[type, type] = {
    Block: PruneBlock,
    ResPostBlock: PruneResPostBlock,
    ParallelThingsBlock: PruneParallelThingsBlock,
    ParallelScalingBlock: PruneParallelScalingBlock,
}


def attention_modules(block: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """The attention modules a pruning block runs itself, by name, for the type check."""
    if isinstance(block, ParallelThingsBlock):
        return {f"attns.{i}.attn": branch.attn for i, branch in enumerate(block.attns)}
    if isinstance(block, ParallelScalingBlock):
        return {}
    return {"attn": block.attn}


#: The attention class the pruning blocks know how to run.
SUPPORTED_ATTENTION: Type[torch.nn.Module] = Attention
