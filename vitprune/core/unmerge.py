"""Tokens of a reduced forward spread back over every original patch (the full grid)."""

from __future__ import annotations

from typing import Optional, Tuple, cast

import torch
from torch import nn

from .numeric import whole_or_type_error
from .patching import state_of, token_groups
from .registry import blocks_of


def unmerge(model: nn.Module, tokens: torch.Tensor, block: Optional[int] = None) -> torch.Tensor:
    """Every original patch gets the features of the token that holds it, so features of a
    reduced forward fill the patch grid again (for dense heads, maps and pictures).

    A patch merged into a token gets that token's features (all patches of a group the
    same), a patch fused into the fusion token gets the fusion token's, and a dropped patch
    (``reduction="drop"``) gets zeros. Prefix tokens pass through. Differentiable: a gradient
    reaching a patch reaches the token that holds it. The groups are those of the last eager
    forward on this thread (:func:`vitprune.token_groups`), so call it after the forward that
    made ``tokens``.

    Args:
        model: A patched model.
        tokens: ``(B, P + n, C)`` as ``forward_features`` (or ``transformers``'
            ``last_hidden_state``) returns them, or ``(B, n, C)`` patch tokens alone, as
            timm's ``forward_intermediates(..., output_fmt="NLC")`` returns them: the ``n``
            tokens left after ``block`` (with ``"NCHW"``, ``forward_intermediates`` calls
            this itself and returns maps).
        block: The block whose output ``tokens`` are (0-indexed; negative counts from the
            end). ``None``: the last block (``forward_features``).

    Returns:
        ``(B, P + N, C)`` or ``(B, N, C)``, as ``tokens`` came, ``N`` the patches that entered
        the first block, in row-major grid order (reshape ``[:, -N:]`` to ``(B, h, w, C)``
        for a map). Tokens from before the first reduction (or of a patch without stages) are
        returned as they are.

    Raises:
        TypeError: ``tokens`` is not a 3-D tensor, or ``block`` not an int.
        ValueError: The model is not patched, no forward has run on this thread, ``block``
            is out of range, or ``tokens`` is not the batch or token count that ``block``
            left in the last forward.
        RuntimeError: The last forward was compiled, exported or traced (no groups recorded).
    """
    state = state_of(model)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 3:
        raise TypeError(f"tokens must be a (B, tokens, channels) tensor, got "
                        f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    depth = len(blocks_of(model))
    if block is None:
        block = depth - 1
    block = whole_or_type_error("block", block, "an int or None")
    if not -depth <= block < depth:
        raise ValueError(f"block must be in [{-depth}, {depth - 1}] (this model has {depth} blocks), got {block}")
    block = int(block) % depth
    stages = cast(Tuple[int, ...], state.config.stages)  # resolved by patch: block indices
    if not stages:  # a patch that never reduces
        return tokens
    groups = token_groups(model)
    stage = sum(1 for s in stages if s <= block) - 1  # the last stage at or before the block
    B, L, C = tokens.shape
    N, P = groups[0].shape[1], state.num_prefix
    if stage < 0:
        if L not in (N, P + N):
            raise ValueError(f"block {block} runs before any reduction, so its output has {N} patch tokens "
                             f"({P + N} with the prefix), but tokens has {L}")
        return tokens
    group = groups[stage]
    images, left = state.records.counts[stage]
    if B != images or L not in (left, P + left):
        raise ValueError(f"the last forward left {images} images of {left} patch tokens ({P + left} with "
                         f"the prefix) after block {block}, but tokens is {tuple(tokens.shape)}: pass the "
                         "output of the forward that ran last on this thread, and the block it came from")
    prefix, patches = tokens[:, :L - left], tokens[:, L - left:]
    spread = patches.gather(1, group.clamp_min(0).unsqueeze(-1).expand(B, N, C))
    if state.config.reduction == "drop":
        spread = spread.masked_fill((group < 0).unsqueeze(-1), 0)
    return torch.cat([prefix, spread], dim=1)
