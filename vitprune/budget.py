"""Pick the keep rate that meets a FLOP budget."""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from .config import PruneConfig
from .flops import schedule_flops

_BISECTION_STEPS = 60
_MIN_RATE = 1e-9  # every stage keeps one token


def fit_keep_rate(
        model: nn.Module,
        target_gflops: float,
        *,
        stages: Optional[Sequence[int]] = None,
        fuse: bool = True,
        img_size: Optional[Sequence[int]] = None,
) -> float:
    """The largest keep rate (the same at every stage) whose analytic FLOPs fit the budget.

    FLOPs grow in steps as the rate lets one more token through, so the result is exact
    to one token: the next token kept at any stage would exceed ``target_gflops``. Among
    the rates that keep the same tokens, the one with the fewest decimals is returned.

    Args:
        model: A timm ViT, patched or not (its current patch is ignored).
        target_gflops: The budget per image, in GFLOPs (fvcore's convention).
        stages: The pruning blocks; the default scales the paper's (3, 6, 9) to the depth.
        fuse: Whether a fusion token is kept (it costs one token per stage).
        img_size: Input ``(H, W)``; the model's own size when ``None``.

    Returns:
        A keep rate in (0, 1]; ``1.0`` when the unpruned model already fits.

    Raises:
        ValueError: The budget is below what keeping one token per stage costs.
    """
    if not target_gflops > 0:
        raise ValueError(f"target_gflops must be > 0, got {target_gflops!r}")
    target = target_gflops * 1e9

    def flops(rate: float) -> int:
        config = PruneConfig(keep_rate=rate, stages=None if stages is None else tuple(stages), fuse=fuse)
        return schedule_flops(model, config, img_size)

    if flops(1.0) <= target:
        return 1.0
    if flops(_MIN_RATE) > target:
        raise ValueError(
            f"no keep rate meets {target_gflops:.4g} GFLOPs with these stages: keeping one token "
            f"per stage already costs {flops(_MIN_RATE) / 1e9:.4g} GFLOPs; prune earlier or add stages"
        )
    low, high = _MIN_RATE, 1.0  # flops(low) <= target < flops(high)
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        if flops(middle) <= target:
            low = middle
        else:
            high = middle
    reached = flops(low)
    for decimals in range(1, 10):
        rounded = round(low, decimals)
        if 0 < rounded <= 1 and flops(rounded) == reached:
            return rounded
    return low
