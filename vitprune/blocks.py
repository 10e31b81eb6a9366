"""Pruning versions of timm's transformer blocks, swapped in by class for an exact match.

Each subclass only overrides ``forward`` and calls the block's own submodules, so
``state_dict`` keys, parameters and hooks are the block's own, and restoring the
original class undoes the patch.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block

from .attention import attention_with_class_row
from .state import PruneState

#: Attributes a patch adds to a block; ``unpatch`` deletes exactly these.
BLOCK_ATTRS = ("vitprune_state", "vitprune_stage")


class PruneBlock(Block):
    """timm ``Block`` that prunes tokens between its attention and its MLP."""

    vitprune_state: PruneState
    vitprune_stage: int

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError(
                "vitprune: a pruning block cannot apply attn_mask or is_causal, because the "
                "mask no longer matches the tokens after pruning; unpatch the model to use masks"
            )
        state = self.vitprune_state
        out, row = attention_with_class_row(self.attn, self.norm1(x), state.num_prefix)
        x = x + self.drop_path1(self.ls1(out))
        x = state.prune(x, row, self.vitprune_stage)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


#: Original block class -> its pruning subclass.
PRUNE_BLOCKS: Dict[type, type] = {Block: PruneBlock}

#: The attention class each pruning block knows how to run, by original block class.
SUPPORTED_ATTENTION: Dict[type, Type[torch.nn.Module]] = {Block: Attention}
