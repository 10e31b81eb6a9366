"""The plain ViT family: timm's ``VisionTransformer`` (vit_*, deit_*, deit3_*, CLIP, SigLIP
and DINOv2 towers, flexivit, hybrids) and ``VisionTransformerDistilled``.

Only the stage blocks are swapped, and with ``size_aware`` every block after the first
stage: a block that only follows runs timm's own forward with the size bias as its
``attn_mask``. Parallel blocks: ``ParallelThingsBlock`` runs its parallel attentions,
reduces, then its parallel MLPs (the scored row holds the heads of all attentions);
``ParallelScalingBlock`` (attention and MLP side by side from one projection) runs whole
on all tokens and reduces its output.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from timm.layers import Attention
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import (Block, ParallelScalingBlock, ParallelThingsBlock, ResPostBlock,
                                            VisionTransformer)

from ..core.registry import Family, attention_heads, own_attention, register
from ..core.state import Scored
from .attention import attention_with_row, join_scored, parallel_scaling_with_row, prefix_attention
from .layouts import PreNorm, PruningBlock, ResPost, refuse_masks
from .pooling import PrunedModel, timm_class_only_reason


class _ViTBlock(PruningBlock):
    """A plain ViT block: timm's attention plus the size bias; followers run timm's forward."""

    vitprune_follower_runs_timm = True

    def _vitprune_attention(self, tokens: torch.Tensor, bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Scored]:
        state = self.vitprune_state
        return attention_with_row(self.attn, tokens, state.num_prefix, state.row_source, bias)

    def _vitprune_prefix_attention(self, tokens: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return prefix_attention(self.attn, tokens, self.vitprune_state.num_prefix, bias)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        refuse_masks(attn_mask, is_causal)
        bias = self._vitprune_begin(x)
        if self._vitprune_prefix_only():
            return self._vitprune_prefix_forward(x, bias)
        if self.vitprune_stage is None:
            return super().forward(x, attn_mask=bias)  # the timm block's own forward
        return self._vitprune_forward(x, bias)


class PruneBlock(_ViTBlock, PreNorm, Block):
    """timm ``Block`` (pre-norm) that reduces tokens between its attention and its MLP."""


class PruneResPostBlock(_ViTBlock, ResPost, ResPostBlock):
    """timm ``ResPostBlock`` (norm after each branch) that reduces between attention and MLP."""


class PruneParallelThingsBlock(_ViTBlock, ParallelThingsBlock):
    """timm ``ParallelThingsBlock``: parallel attentions, reduce, parallel MLPs."""

    attns: Any  # timm's ModuleLists of branches
    ffns: Any

    def _vitprune_forward(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        self._vitprune_watch()
        state, outs, parts = self.vitprune_state, [], []
        for branch in self.attns:
            out, scored = attention_with_row(branch.attn, branch.norm(x), state.num_prefix, state.row_source, bias)
            outs.append(branch.drop_path(branch.ls(out)))
            parts.append(scored)
        x = self._vitprune_reduce(x + torch.stack(outs).sum(dim=0), join_scored(parts))
        return x + torch.stack([ffn(x) for ffn in self.ffns]).sum(dim=0)


class PruneParallelScalingBlock(_ViTBlock, ParallelScalingBlock):
    """timm ``ParallelScalingBlock``: the block runs whole on all tokens, then reduces its output."""

    def _vitprune_forward(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        state = self.vitprune_state
        x, scored = parallel_scaling_with_row(self, x, state.num_prefix, state.row_source, bias)
        return self._vitprune_reduce(x, scored)


class PruneVisionTransformer(PrunedModel, VisionTransformer):
    """timm ``VisionTransformer`` while patched (see ``pooling``)."""


class PruneVisionTransformerDistilled(PrunedModel, VisionTransformerDistilled):
    """timm ``VisionTransformerDistilled`` while patched (token pooling only)."""


def class_only_reason(model: torch.nn.Module) -> Optional[str]:
    """Why ``class_only_last`` cannot apply to this ViT, or ``None``: it needs a head that
    reads the prefix tokens alone and a last block of timm's ``Block`` or ``ResPostBlock``
    with timm's ``Attention`` (a fused ``qkv``)."""
    return timm_class_only_reason(model, (Block, ResPostBlock), "timm's Attention with a fused qkv Linear",
                                  lambda attn: type(attn) is Attention and isinstance(attn.qkv, torch.nn.Linear))


def attention_modules(block: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """The attention modules a pruning block runs itself, by name, for the type check."""
    if isinstance(block, ParallelThingsBlock):
        return {f"attns.{i}.attn": own_attention(branch)["attn"] for i, branch in enumerate(block.attns)}
    if isinstance(block, ParallelScalingBlock):
        return {}
    return own_attention(block)


def scored_heads(block: torch.nn.Module) -> int:
    """Heads of the scored row (parallel attentions joined)."""
    if isinstance(block, ParallelScalingBlock):
        return block.num_heads
    if isinstance(block, ParallelThingsBlock):
        return sum(attention_heads(branch) for branch in block.attns)
    return attention_heads(block)


#: Original block class -> its pruning subclass.
PRUNE_BLOCKS = {
    Block: PruneBlock,
    ResPostBlock: PruneResPostBlock,
    ParallelThingsBlock: PruneParallelThingsBlock,
    ParallelScalingBlock: PruneParallelScalingBlock,
}

_EXAMPLES = "vit_*, deit_*, deit3_*, CLIP, SigLIP and DINOv2 towers, flexivit, hybrids"
for _model, _patched in ((VisionTransformer, PruneVisionTransformer),
                         (VisionTransformerDistilled, PruneVisionTransformerDistilled)):
    register(Family(model=_model, patched=_patched, blocks=PRUNE_BLOCKS, attention=(Attention,),
                    attention_modules=attention_modules, heads=scored_heads, overlap=True, examples=_EXAMPLES,
                    class_only=class_only_reason))
