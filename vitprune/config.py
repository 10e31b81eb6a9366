"""The one frozen, validated description of a pruning patch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Literal, Optional, Tuple, Union, get_args

Indicator = Literal["var", "medad", "cls", "random", "lowvar"]
INDICATORS: Tuple[str, ...] = get_args(Indicator)

#: The paper prunes after the 4th, 7th and 10th of 12 blocks: at 1/4, 2/4, 3/4 of the depth.
PAPER_STAGE_FRACTIONS: Tuple[float, ...] = (0.25, 0.5, 0.75)


def default_stages(depth: int) -> Tuple[int, ...]:
    """The paper's stages ``(3, 6, 9)`` for 12 blocks, scaled in proportion to ``depth``.

    Block ``floor(depth * f)`` for ``f`` in 1/4, 2/4, 3/4, duplicates removed:
    ``(3, 6, 9)`` for 12 blocks, ``(6, 12, 18)`` for 24, ``(1, 3, 4)`` for 6.
    """
    if depth < 1:
        raise ValueError(f"a model needs at least one block to prune, got depth={depth}")
    return tuple(sorted({int(depth * f) for f in PAPER_STAGE_FRACTIONS}))


def _check_keep_rate(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(float(value)):
        raise TypeError(f"keep_rate must be a float in (0, 1], got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"keep_rate must be in (0, 1], got {value!r}")
    return float(value)


def _check_stage(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"stages must hold block indices (int), got {value!r}")
    if value < 0:
        raise ValueError(f"stages are 0-indexed block indices, got negative index {value}")
    return int(value)


@dataclass(frozen=True)
class PruneConfig:
    """What to prune, where and how much. Validated on construction.

    Args:
        indicator: The per-patch importance score: ``"var"`` (variance of the class token's
            attention across heads), ``"medad"`` (median absolute deviation across heads),
            ``"cls"`` (mean attention across heads, EViT's score), ``"random"`` (ablation) or
            ``"lowvar"`` (minus the variance: keeps the patches the heads agree on, the
            referee's falsifier; if it does as well as ``"var"``, diversity is not what helps).
        keep_rate: Fraction of the current non-prefix tokens kept at each stage, in (0, 1]:
            one float for every stage, or one per stage.
        stages: 0-indexed blocks that prune, strictly increasing. ``None`` picks the
            paper's ``(3, 6, 9)``, scaled in proportion for other depths (see
            :func:`default_stages`).
        T: Temperature of the fusion weights, > 0 (``math.inf`` gives plain mean pooling).
            It divides the pruned tokens' scores normalised by their mean absolute value,
            so one value means the same for every indicator, model and resolution. See README, "Fusion temperature".
        fuse: Merge the pruned tokens into one fusion token (True) or drop them (False).
        seed: Seed of the ``"random"`` indicator's generator; ``None`` draws from torch's
            global generator. Only allowed with ``indicator="random"``.
        overlap_stride: Give the patch embedding this stride (at most the patch size), so
            neighbouring patches overlap and there are more tokens; ``None`` leaves it.
    """

    indicator: Indicator = "var"
    keep_rate: Union[float, Tuple[float, ...]] = 0.7
    stages: Optional[Tuple[int, ...]] = None
    T: float = 1.0
    fuse: bool = True
    seed: Optional[int] = None
    overlap_stride: Optional[int] = None

    def __post_init__(self) -> None:
        if self.indicator not in INDICATORS:
            raise ValueError(
                f"unknown indicator {self.indicator!r}; accepted: {', '.join(map(repr, INDICATORS))}"
            )
        if isinstance(self.keep_rate, (tuple, list)):
            if not self.keep_rate and self.stages != ():
                raise ValueError("keep_rate must be a float or a non-empty sequence of floats")
            keep: Union[float, Tuple[float, ...]] = tuple(_check_keep_rate(k) for k in self.keep_rate)
        else:
            keep = _check_keep_rate(self.keep_rate)
        object.__setattr__(self, "keep_rate", keep)

        if self.stages is not None:
            if isinstance(self.stages, (str, bytes)) or not hasattr(self.stages, "__iter__"):
                raise TypeError(f"stages must be a sequence of block indices, got {self.stages!r}")
            stages = tuple(_check_stage(s) for s in self.stages)
            if len(set(stages)) != len(stages):
                raise ValueError(f"stages must not repeat a block, got {stages}")
            if list(stages) != sorted(stages):
                raise ValueError(f"stages must be in increasing order, got {stages}")
            object.__setattr__(self, "stages", stages)
            if isinstance(keep, tuple) and len(keep) != len(stages):
                raise ValueError(
                    f"keep_rate has {len(keep)} values but stages has {len(stages)}; "
                    "give one keep_rate per stage, or a single float for all"
                )

        if isinstance(self.T, bool) or not isinstance(self.T, Real) or math.isnan(float(self.T)):
            raise TypeError(f"T must be a positive float, got {self.T!r}")
        if not float(self.T) > 0:
            raise ValueError(f"T must be > 0 (math.inf for mean pooling), got {self.T!r}")
        object.__setattr__(self, "T", float(self.T))

        if not isinstance(self.fuse, bool):
            raise TypeError(f"fuse must be True or False, got {self.fuse!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, Integral):
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            if self.indicator != "random":
                raise ValueError(f"seed only applies to indicator='random', not {self.indicator!r}")
        if self.overlap_stride is not None:
            if isinstance(self.overlap_stride, bool) or not isinstance(self.overlap_stride, Integral):
                raise TypeError(f"overlap_stride must be a positive int or None, got {self.overlap_stride!r}")
            if self.overlap_stride < 1:
                raise ValueError(f"overlap_stride must be a positive int, got {self.overlap_stride}")
            object.__setattr__(self, "overlap_stride", int(self.overlap_stride))

    def resolve(self, depth: int) -> "PruneConfig":
        """This config for a model of ``depth`` blocks: explicit stages, one keep rate per stage.

        Raises:
            ValueError: A stage is not a block of the model, or keep rates and the
                default stages differ in number.
        """
        stages = default_stages(depth) if self.stages is None else self.stages
        bad = [s for s in stages if s >= depth]
        if bad:
            raise ValueError(
                f"stages {bad} out of range: the model has {depth} blocks (valid indices 0..{depth - 1})"
            )
        keep = self.keep_rate
        if isinstance(keep, tuple):
            if len(keep) != len(stages):
                raise ValueError(
                    f"keep_rate has {len(keep)} values but the default stages for {depth} blocks "
                    f"are {stages}; pass stages explicitly"
                )
        else:
            keep = (keep,) * len(stages)
        return dataclasses.replace(self, stages=stages, keep_rate=keep)


def keep_count(keep_rate: float, n: int) -> int:
    """``ceil(keep_rate * n)`` tokens kept of ``n``, robust to float error (0.7 * 10 keeps 7)."""
    return max(1, math.ceil(round(keep_rate * n, 9)))
