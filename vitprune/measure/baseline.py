"""Token merging (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023) as a vitprune config.

Written from the paper, not from its code: in every block, between attention and MLP,
the patch tokens are split into two alternating sets, each token of the first is joined
to its most similar token of the second (cosine of the keys averaged over heads), and
the ``r`` most similar pairs are merged by a size-weighted average; every later block
adds ``log(size)`` to the attention logits (proportional attention). Prefix tokens are
never merged. In vitprune's terms that is ``selection="bipartite"``, ``reduction="merge"``,
``size_aware=True``, ``stages="all"``, ``crowding=0`` (the paper's order), with per-block
keep rates that remove ``r`` tokens each, so the baseline runs through the same blocks, FLOP
counter and benchmark as everything else.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from torch import nn

from ..core.config import PruneConfig
from ..core.grid import num_patches
from ..core.numeric import TEXT_OR_BYTES, is_whole
from ..core.patching import check_model, settle_class_only
from ..core.registry import blocks_of
from .budget import check_target
from .flops import flop_counter


def merging_config(model: nn.Module, r: Union[int, Sequence[int]],
                   img_size: Optional[Sequence[int]] = None, class_only_last: bool = False) -> PruneConfig:
    """Token merging with ``r`` tokens merged per block (at most half the patches of a block).

    Args:
        model: The ViT it is meant for (its patch count and depth set the keep rates).
        r: Tokens merged in every block, ``>= 0``, or one such count per block.
        img_size: Input size the keep rates are worked out for; the model's own by default.
        class_only_last: Not the paper's: its last block computes the class token alone
            (``PruneConfig.class_only_last``), so it merges nothing there; for comparisons
            that give token merging the same saving.

    Raises:
        TypeError: ``model`` is not one ``patch`` accepts, ``r`` is no whole number (or
            sequence of them), or ``class_only_last=True`` where the model's head reads
            more than the class token (as ``patch`` would say).
        ValueError: ``r`` is negative or has the wrong length.
    """
    family = check_model(model)
    config = _merging_config(model, r, img_size, class_only_last)
    settle_class_only(model, config, family)
    return config


def _merging_config(model: nn.Module, r: Union[int, Sequence[int]], img_size: Optional[Sequence[int]],
                    class_only_last: bool) -> PruneConfig:
    """:func:`merging_config` for a model already checked."""
    depth = len(blocks_of(model))
    wanted = f"r must be an int >= 0 or {depth} of them (one per block), got {r!r}"
    if is_whole(r):
        amounts = [r] * depth
    elif isinstance(r, Sequence) and not isinstance(r, TEXT_OR_BYTES):
        amounts = list(r)
    else:
        raise TypeError(wanted)
    if not all(is_whole(a) for a in amounts):
        raise TypeError(wanted)
    if len(amounts) != depth or any(a < 0 for a in amounts):
        raise ValueError(wanted)
    amounts = [int(a) for a in amounts]  # a NumPy integer too
    n = num_patches(model, img_size)
    rates = []
    for amount in amounts:
        removed = min(amount, n // 2)
        rates.append((n - removed) / n)
        n -= removed
    return PruneConfig(selection="bipartite", reduction="merge", size_aware=True, stages="all",
                       crowding=0.0, keep_rate=tuple(rates), class_only_last=class_only_last)


def fit_merging(model: nn.Module, target_gflops: float, img_size: Optional[Sequence[int]] = None,
                class_only_last: bool = False) -> PruneConfig:
    """Token merging with the most tokens kept whose analytic FLOPs fit ``target_gflops``.

    The schedule merges ``r + 1`` tokens in the first ``j`` blocks and ``r`` in the rest,
    for the smallest ``(r, j)`` that fits, so the budget is met to within one token.
    ``class_only_last`` as in :func:`merging_config`.

    Raises:
        TypeError: ``target_gflops`` is not a number, or what :func:`merging_config` raises
            for the model and ``class_only_last``.
        ValueError: ``target_gflops`` is not > 0 and finite, or even merging half the tokens
            in every block costs more.
    """
    check_target(target_gflops)
    merging_config(model, 0, img_size, class_only_last)  # the model and options, checked once
    depth, most = len(blocks_of(model)), num_patches(model, img_size) // 2
    flops = flop_counter(model, img_size)
    for r in range(most + 1):
        for j in range(depth):
            config = _merging_config(model, [r + 1] * j + [r] * (depth - j), img_size, class_only_last)
            if flops(config) <= target_gflops * 1e9:
                return config
    raise ValueError(f"token merging cannot reach {target_gflops:.4g} GFLOPs on this model (r up to {most})")
