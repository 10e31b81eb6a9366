"""Pick the keep rate that meets a FLOP budget."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence

from torch import nn

from ..core.config import SPREAD, PruneConfig, Stages
from ..core.grid import input_size, num_patches
from ..core.numeric import real_or_type_error, unit_share
from ..core.patching import check_model, check_model_overlap, check_options, settle_class_only
from .flops import flop_counter, schedule_flops

_BISECTION_STEPS = 60
_MIN_RATE = 1e-9  # every stage keeps one token


class _OutOfReach(ValueError):
    """No keep rate meets the budget: what ``overlap_options`` stops at, where any other
    ``ValueError`` (a bad option) is the caller's to see."""


def _read_once(stages: Stages) -> Stages:
    """``stages`` kept for many configs: an iterator (which ``patch`` accepts) read into a tuple."""
    return tuple(stages) if isinstance(stages, Iterator) else stages


def _config(rate: float, stages: Stages, fuse: Optional[bool], stride: Optional[int],
            options: Dict[str, Any]) -> PruneConfig:
    return PruneConfig(keep_rate=rate, stages=stages, fuse=fuse, overlap_stride=stride, **options)


def check_target(target_gflops: Any) -> None:
    """A budget in GFLOPs: a real number, > 0 and finite (``fit_keep_rate``, ``fit_merging``)."""
    if not 0 < real_or_type_error("target_gflops", target_gflops, "a number of GFLOPs") < math.inf:
        raise ValueError(f"target_gflops must be > 0 and finite, got {target_gflops!r}")


def _check_fit(model: nn.Module, config: PruneConfig, img_size: Optional[Sequence[int]]) -> None:
    """What ``patch`` would refuse, refused here too (before any counting)."""
    family = check_model(model)
    settle_class_only(model, config, family)
    input_size(model, img_size)
    if config.overlap_stride is not None:
        check_model_overlap(model, family, config.overlap_stride)


def fit_keep_rate(
        model: nn.Module,
        target_gflops: float,
        *,
        stages: Stages = SPREAD,
        fuse: Optional[bool] = None,
        img_size: Optional[Sequence[int]] = None,
        overlap_stride: Optional[int] = None,
        **options: Any,
) -> float:
    """The largest keep rate (the same at every stage) whose analytic FLOPs fit the budget.

    FLOPs grow in steps as the rate lets one more token through, so the result is exact
    to one token: the next token kept at any stage would exceed ``target_gflops``. Among
    the rates that keep the same tokens, the one with the fewest decimals is returned.
    Works for every schedule (``stages``, ``"all"``) and every ``reduction`` and ``selection``.

    Args:
        model: A timm ViT, patched or not (its current patch is ignored).
        target_gflops: The budget per image, in GFLOPs (fvcore's convention).
        stages: As in :class:`PruneConfig`: ``"spread"`` (the default), ``"spread2"``,
            ``"spread3"``, ``"all"``, ``None`` (the paper's stages, scaled to the depth) or
            block indices.
        fuse: The legacy switch (see :class:`PruneConfig`); prefer ``reduction``.
        img_size: Input ``(H, W)``; the model's own size when ``None``. A spread schedule is
            worked out for the model's own size and applied as a rate at other sizes (as
            ``patch`` does), so there the result is exact to one token of the own-size
            schedule, and the patched model run at ``img_size`` meets the budget.
        overlap_stride: Count with this patch-embedding stride (see ``patch``); ``None``
            uses the model's current one.
        **options: Other :class:`PruneConfig` fields (``reduction``, ``selection``, ...),
            as they will be passed to ``patch``.

    Returns:
        A keep rate in (0, 1]; ``1.0`` when the unpruned model already fits.

    Raises:
        TypeError: ``target_gflops`` is not a number, the model is not one ``patch`` accepts,
            or an option is of the wrong kind (as ``patch`` would say).
        ValueError: The budget is not a finite positive number, an option is out of range
            for this model (as ``patch`` would say), or the budget is below what keeping
            one token per stage costs.
    """
    check_target(target_gflops)
    stages = _read_once(stages)
    check_options({**options, "stages": stages, "fuse": fuse, "overlap_stride": overlap_stride})
    _check_fit(model, _config(1.0, stages, fuse, overlap_stride, options), img_size)
    target = target_gflops * 1e9

    counter = flop_counter(model, img_size)

    def flops(rate: float) -> int:
        return counter(_config(rate, stages, fuse, overlap_stride, options))

    if flops(1.0) <= target:
        return 1.0
    if flops(_MIN_RATE) > target:
        raise _OutOfReach(
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


class OverlapOption(NamedTuple):
    """One way to spend a FLOP budget on overlapping patches: a stride and its keep rate."""

    stride: int
    keep_rate: float
    gflops: float
    tokens: int


def overlap_options(
        model: nn.Module,
        target_gflops: Optional[float] = None,
        *,
        stages: Stages = SPREAD,
        fuse: Optional[bool] = None,
        img_size: Optional[Sequence[int]] = None,
        **options: Any,
) -> List[OverlapOption]:
    """For every stride from the patch size down, the keep rate that meets the budget.

    Args:
        target_gflops: The budget per image; the unpruned model's FLOPs when ``None``.
        stages, fuse, img_size, options: As in :func:`fit_keep_rate`.

    Returns:
        One option per stride that some keep rate can fit, largest stride first;
        ``tokens`` is the number of patch tokens the stride makes.

    Raises:
        TypeError, ValueError: What :func:`fit_keep_rate` would raise for the budget or an
            option (an empty list means only that no stride fits the budget), or
            ``overlap_stride`` among the options.
    """
    if "overlap_stride" in options:
        raise TypeError("overlap_options tries every stride itself: leave overlap_stride out")
    check_model_overlap(model, check_model(model), 1)  # a model that cannot overlap at all
    if target_gflops is None:
        target_gflops = schedule_flops(model, None, img_size) / 1e9
    stages = _read_once(stages)
    found = []
    for stride in range(min(getattr(model.patch_embed, "patch_size")), 0, -1):
        try:
            rate = fit_keep_rate(model, target_gflops, stages=stages, fuse=fuse, img_size=img_size,
                                 overlap_stride=stride, **options)
        except _OutOfReach:
            break  # smaller strides only cost more (a bad budget or option raises at the first stride)
        config = _config(rate, stages, fuse, stride, options)
        found.append(OverlapOption(stride, rate, schedule_flops(model, config, img_size) / 1e9,
                                   num_patches(model, img_size, stride)))
    return found


def fit_overlap(
        model: nn.Module,
        target_gflops: Optional[float] = None,
        *,
        min_keep_rate: float = 0.5,
        stages: Stages = SPREAD,
        fuse: Optional[bool] = None,
        img_size: Optional[Sequence[int]] = None,
        **options: Any,
) -> OverlapOption:
    """The most overlap (smallest stride) whose keep rate for the budget stays >= ``min_keep_rate``.

    The paper's recipe spends the FLOPs pruning saves on overlap: by default the budget
    is the unpruned model's FLOPs. Overlap adds information, pruning throws some away;
    ``min_keep_rate`` bounds the second. Pass the result to ``patch`` as
    ``overlap_stride=option.stride, keep_rate=option.keep_rate``, with the same
    ``stages``, ``fuse`` and ``options`` (:class:`PruneConfig` fields) given here.

    Raises:
        TypeError, ValueError: What :func:`overlap_options` raises.
        TypeError: ``min_keep_rate`` is no number.
        ValueError: ``min_keep_rate`` is outside (0, 1], no keep rate meets the budget even
            without overlap, or no stride reaches ``min_keep_rate``.
    """
    unit_share("min_keep_rate", min_keep_rate)
    choices = overlap_options(model, target_gflops, stages=stages, fuse=fuse, img_size=img_size, **options)
    if not choices:
        raise ValueError("no keep rate meets the budget even without overlap (at the patch size's stride); "
                         "fit_keep_rate says what the least pruning costs")
    fitting = [option for option in choices if option.keep_rate >= min_keep_rate]
    if not fitting:
        raise ValueError(
            f"no stride keeps at least {min_keep_rate} of the tokens within the budget; "
            f"the options are {[(o.stride, o.keep_rate) for o in choices]}"
        )
    return fitting[-1]
