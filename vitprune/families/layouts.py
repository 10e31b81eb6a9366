"""What every pruning block shares, and the block forwards, once per residual layout.

A pruning block is a subclass of a timm block swapped in by class (``patch``): it only
overrides ``forward`` and calls the block's own submodules, so ``state_dict`` keys,
parameters and hooks are the block's own, and restoring the original class undoes the
patch. Where attention and MLP run in sequence the tokens are reduced between them (as in
the paper); the reduction step (``PruneState.prune``: fusion, merging or dropping) is
called from :meth:`PruningBlock._vitprune_reduce` and nowhere else.

A family's block class mixes in one layout (:class:`PreNorm`, :class:`ResPost`) and
supplies ``_vitprune_attention(tokens, context)``: its attention through
:func:`~vitprune.families.attention.attention_with_row` with the family's terms (size
bias; rope; relative bias).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple, cast

import torch

from ..core.hooks import Bypassed, warn_of_new_hooks
from ..core.state import PruneState, Scored
from ..core.tokens import is_compiling


def refuse_masks(attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    if attn_mask is not None or is_causal:
        raise ValueError(
            "vitprune: a pruning block (or, in rope models, any block after one) cannot apply "
            "attn_mask or is_causal, because the mask no longer matches the tokens after pruning; "
            "unpatch the model to use masks"
        )


class PruningBlock:
    """What every swapped block carries (set by ``patch``)."""

    vitprune_state: PruneState
    vitprune_stage: Optional[int]  # this block's stage number, or None: it only follows a stage
    vitprune_follow: Optional[int]  # the stage whose output this block receives, or None
    vitprune_class_only: bool = False  # the last block with class_only_last: prefix tokens out in forward
    vitprune_bypassed: Bypassed = ()  # the modules (attention and holders) whose forward it does not call
    #: Whether a block that only follows runs the timm block's own forward (so its attention
    #: module is called, hooks and all) rather than vitprune's attention.
    vitprune_follower_runs_timm: bool = False
    # the block's own submodules the layouts call, as each timm block class types them
    attn: Any
    norm1: Any
    norm2: Any
    mlp: Any
    drop_path1: Any
    drop_path2: Any

    if TYPE_CHECKING:  # the timm block's forward (``super().forward``), and a layout's (below)
        def forward(self, *args: Any, **kwargs: Any) -> Any: ...

        def _vitprune_forward(self, x: torch.Tensor, context: Any) -> torch.Tensor: ...

        def _vitprune_prefix_forward(self, x: torch.Tensor, context: Any) -> torch.Tensor: ...

    def _vitprune_begin(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The size-aware attention bias for ``x`` (see ``PruneState.begin``)."""
        return self.vitprune_state.begin(x, self.vitprune_stage, self.vitprune_follow)

    def _vitprune_watch(self) -> None:
        """Name, once, hooks registered since ``patch`` on the modules whose forward this call
        does not call (``vitprune_bypassed``); eager calls only (a compiled graph is fixed)."""
        if self.vitprune_bypassed and not is_compiling():
            warn_of_new_hooks(cast(torch.nn.Module, self), self.vitprune_bypassed)

    def _vitprune_reduce(self, x: torch.Tensor, scored: Scored) -> torch.Tensor:
        """The reduction step at a stage; nothing for a block that only follows."""
        if self.vitprune_stage is None:
            return x
        return self.vitprune_state.prune(x, scored, self.vitprune_stage)

    def _vitprune_prefix_only(self) -> bool:
        """Whether this call computes the prefix tokens alone: the last block with
        ``class_only_last``, in a forward whose head reads them alone (``PruneState.head_only``)."""
        return self.vitprune_class_only and self.vitprune_state.head_only

    def _vitprune_positions(self) -> Optional[torch.Tensor]:
        """``(B, n)`` original patch index of each incoming non-prefix token (``-1``: fusion),
        or ``None`` before the first stage."""
        if self.vitprune_follow is None:
            return None
        return self.vitprune_state.positions[self.vitprune_follow]

    def _vitprune_attention(self, tokens: torch.Tensor, context: Any) -> Tuple[torch.Tensor, Scored]:
        raise NotImplementedError

    def _vitprune_prefix_attention(self, tokens: torch.Tensor, context: Any) -> torch.Tensor:
        """The attention output of the prefix tokens only (``class_only_last``); families
        whose ``Family.class_only`` allows it supply this."""
        raise NotImplementedError


def _scaled(block: object, branch: int, out: torch.Tensor) -> torch.Tensor:
    """A branch's output times its layer scale: timm's ``ls1``/``ls2`` modules, or Eva's and
    BEiT's ``gamma_1``/``gamma_2`` parameters (``None``: no scale)."""
    scale = getattr(block, f"ls{branch}", None)
    if scale is not None:
        return scale(out)
    gamma = getattr(block, f"gamma_{branch}", None)
    return out if gamma is None else gamma * out


class PreNorm(PruningBlock):
    """Norm before each branch: ``x + attn(norm1(x))``, reduce, ``x + mlp(norm2(x))``
    (timm's ``Block``, ``EvaBlock``, BEiT's and relpos's ``Block``)."""

    def _vitprune_forward(self, x: torch.Tensor, context: Any) -> torch.Tensor:
        self._vitprune_watch()
        out, scored = self._vitprune_attention(self.norm1(x), context)
        x = self._vitprune_reduce(x + self.drop_path1(_scaled(self, 1, out)), scored)
        return x + self.drop_path2(_scaled(self, 2, self.mlp(self.norm2(x))))

    def _vitprune_prefix_forward(self, x: torch.Tensor, context: Any) -> torch.Tensor:
        """The block's output for the prefix tokens only (``class_only_last``)."""
        self._vitprune_watch()
        P = self.vitprune_state.num_prefix
        x = x[:, :P] + self.drop_path1(_scaled(self, 1, self._vitprune_prefix_attention(self.norm1(x), context)))
        return x + self.drop_path2(_scaled(self, 2, self.mlp(self.norm2(x))))


class ResPost(PruningBlock):
    """Norm after each branch: ``x + norm1(attn(x))``, reduce, ``x + norm2(mlp(x))``
    (timm's ``ResPostBlock``, ``EvaBlockPostNorm``, ``ResPostRelPosBlock``)."""

    def _vitprune_forward(self, x: torch.Tensor, context: Any) -> torch.Tensor:
        self._vitprune_watch()
        out, scored = self._vitprune_attention(x, context)
        x = self._vitprune_reduce(x + self.drop_path1(self.norm1(out)), scored)
        return x + self.drop_path2(self.norm2(self.mlp(x)))

    def _vitprune_prefix_forward(self, x: torch.Tensor, context: Any) -> torch.Tensor:
        """The block's output for the prefix tokens only (``class_only_last``)."""
        self._vitprune_watch()
        P = self.vitprune_state.num_prefix
        x = x[:, :P] + self.drop_path1(self.norm1(self._vitprune_prefix_attention(x, context)))
        return x + self.drop_path2(self.norm2(self.mlp(x)))
