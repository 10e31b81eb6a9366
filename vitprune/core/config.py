"""The one frozen, validated description of a pruning patch."""

from __future__ import annotations

import dataclasses
import math
from collections import abc
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Final, Literal, Mapping, Optional, Sequence, Tuple, Union, get_args

from .numeric import TEXT_OR_BYTES, real_or_type_error, unit_share, whole_or_type_error

Indicator = Literal["var", "medad", "cls", "random", "lowvar"]
INDICATORS: Tuple[str, ...] = get_args(Indicator)
Selection = Literal["top", "redundant", "bipartite"]
SELECTIONS: Tuple[str, ...] = get_args(Selection)
Reduction = Literal["merge", "fuse", "drop"]
REDUCTIONS: Tuple[str, ...] = get_args(Reduction)
#: What ``stages`` accepts: block indices (any sequence; stored as a tuple), ``"spread"``,
#: ``"spread2"``, ``"spread3"``, ``"all"``, or ``None`` (the paper's stages).
Stages = Union[Sequence[int], Literal["spread", "spread2", "spread3", "all"], None]

#: The defaults, chosen by the experiments in docs/merging.md (see docs/method.md §9).
DEFAULT_SELECTION: Final = "bipartite"
DEFAULT_REDUCTION: Final = "merge"
DEFAULT_SIZE_AWARE: Final = True
#: Weight of crowding in bipartite matching when ``crowding`` is left at ``None``
#: (``merging.crowding_scores``; docs/crowding.md).
DEFAULT_CROWDING: Final = 0.0

#: ``stages`` value for a reduction in every block, at ``keep_rate`` each.
ALL_BLOCKS: Final = "all"
#: ``stages`` value (the default) for a reduction in every block at about the cost of the
#: paper's three stages at ``keep_rate`` (see :meth:`PruneConfig.resolve`).
SPREAD: Final = "spread"
#: The ``stages`` values that spread the paper's token budget over blocks, and the step
#: between their blocks: every block, every second, every third, counted back from the last.
SPREAD_STEPS: Mapping[str, int] = MappingProxyType({SPREAD: 1, "spread2": 2, "spread3": 3})

#: The name the command line and ``build_settings`` give the paper's stages (``stages=None``,
#: which there means "each method's own"); ``PruneConfig`` itself takes ``None``.
PAPER_STAGES: Final = "paper"
#: The command line's name for vitprune's defaults, beside the indicators (each: the paper's
#: method with it); see :func:`method_options`.
DEFAULT_METHOD: Final = "default"

#: The paper prunes after the 4th, 7th and 10th of 12 blocks: at 1/4, 2/4, 3/4 of the depth.
PAPER_STAGE_FRACTIONS: Tuple[float, ...] = (0.25, 0.5, 0.75)

#: The paper's method besides its indicator, as ``patch`` options: its three stages, the
#: top-scored tokens kept, the rest fused into one token, plain attention, every token
#: through the last block.
PAPER_OPTIONS: Mapping[str, Any] = MappingProxyType(
    dict(stages=None, selection="top", reduction="fuse", size_aware=False, class_only_last=False))


def method_options(method: str, stages: Any = None) -> "dict[str, Any]":
    """``patch`` options for a method as the commands name it: ``"default"``, vitprune's
    defaults (no options); an indicator, the paper's method with it (:data:`PAPER_OPTIONS`).
    ``stages`` replaces the method's own schedule: ``None`` keeps it, ``"paper"`` is the
    paper's three stages (``stages=None``), anything else goes to ``patch`` as it is.

    Raises:
        ValueError: ``method`` is neither ``"default"`` nor an indicator.
    """
    if method != DEFAULT_METHOD and method not in INDICATORS:
        raise ValueError(f"unknown method {method!r}; accepted: {', '.join((DEFAULT_METHOD, *INDICATORS))}")
    options: "dict[str, Any]" = {} if method == DEFAULT_METHOD else {"indicator": method, **PAPER_OPTIONS}
    if stages is not None:
        options["stages"] = None if stages == PAPER_STAGES else stages
    return options


def default_stages(depth: int) -> Tuple[int, ...]:
    """The paper's stages ``(3, 6, 9)`` for 12 blocks, scaled in proportion to ``depth``.

    Block ``floor(depth * f)`` for ``f`` in 1/4, 2/4, 3/4, duplicates removed:
    ``(3, 6, 9)`` for 12 blocks, ``(6, 12, 18)`` for 24, ``(1, 3, 4)`` for 6.
    """
    depth = whole_or_type_error("depth", depth, "a whole number of blocks (int)")
    if depth < 1:
        raise ValueError(f"a model needs at least one block to prune, got depth={depth}")
    return tuple(sorted({int(depth * f) for f in PAPER_STAGE_FRACTIONS}))


def is_spread(stages: object) -> bool:
    """Whether ``stages`` is one of the spread schedules (``"spread"``, ``"spread2"``, ``"spread3"``)."""
    return isinstance(stages, str) and stages in SPREAD_STEPS


def spread_blocks(depth: int, step: int) -> Tuple[int, ...]:
    """Every ``step``-th block of ``depth``, counted back from the last: ``(1, 3, ..., 11)``
    for 12 blocks and step 2, ``(2, 5, 8, 11)`` for step 3 (the last block, which leaves the
    class token alone when ``class_only_last`` is on, drops out then)."""
    return tuple(range((depth - 1) % step, depth, step))


def _check_stage(value: object) -> int:
    index = whole_or_type_error("stages entries", value, "block indices (int)")
    if index < 0:
        raise ValueError(f"stages are 0-indexed block indices, got negative index {index}")
    return index


@dataclass(frozen=True)
class PruneConfig:
    """What to prune, where and how much. Validated on construction.

    Args:
        indicator: The per-patch importance score: ``"var"`` (variance of the class token's
            attention across heads), ``"medad"`` (median absolute deviation across heads),
            ``"cls"`` (mean attention across heads, EViT's score), ``"random"`` (ablation) or
            ``"lowvar"`` (minus the variance: keeps the patches the heads agree on, the
            referee's falsifier; if it does as well as ``"var"``, diversity is not what helps).
            ``None`` (the default): no indicator chooses tokens (bipartite matching); where a
            score is still needed (``selection="top"`` or ``"redundant"`` named without one,
            or the fusion weights) it is ``"var"``. Naming an indicator makes
            the default selection ``"top"``: the tokens it scores best stay. With
            ``selection="bipartite"``, which reads no scores, it is refused unless
            ``reduction="fuse"`` weighs by it.
        keep_rate: Fraction of the current non-prefix tokens kept at each stage, in (0, 1]:
            one float for every stage, or one per stage.
        stages: Where tokens go. ``"spread"`` (the default, the measured best): every
            block removes a few, at the largest common keep rate whose token count summed
            over blocks (about the FLOPs) stays within that of the paper's stages at
            ``keep_rate``, so ``keep_rate`` keeps the cost it has in the paper.
            ``"spread2"`` and ``"spread3"``: the same budget in every second or third block,
            counted back from the last (``(1, 3, 5, 7, 9)`` and ``(2, 5, 8)`` of 12 with the
            class token alone in the last), in fewer, larger steps: faster at batch 1 in eager
            mode. On our 12-block models ``"spread2"`` was level with ``"spread"`` in accuracy
            down to 60 % of the FLOPs and 0.1 to 0.8 points below at 50 %, ``"spread3"`` 0.4
            to 3.7 points below from 60 % down (docs/method.md §3, docs/speed.md). ``None``:
            the paper's ``(3, 6, 9)``, scaled in proportion for other depths (see
            :func:`default_stages`). ``"all"``: every block, at ``keep_rate`` each. Or
            0-indexed blocks, strictly increasing.
        T: Temperature of the fusion weights, > 0 (``math.inf`` gives plain mean pooling);
            ``reduction="fuse"`` only (another value with another reduction is refused).
            It divides the pruned tokens' scores normalised by their mean absolute value,
            so one value means the same for every indicator, model and resolution (docs/method.md §5).
        selection: Which tokens go (docs/method.md §4); ``None``: ``"bipartite"`` without an
            indicator, ``"top"`` with one. ``"top"`` keeps
            the best-scored tokens (the paper); ``"redundant"`` keeps the best-scored half as
            destinations and removes, among the rest, the tokens whose keys are most like a
            destination's; ``"bipartite"`` does the same with every other token as a
            destination, whatever its score (token merging's matching).
        reduction: Where removed tokens go: ``"merge"`` into the kept token most like each
            (size-weighted average), ``"fuse"`` into one fusion token (the paper's Eq. 8),
            or ``"drop"``.
        size_aware: Every block after the first reduction adds ``log(size)`` to the attention
            logits of a token that holds ``size`` original patches, so it counts as them.
        crowding: Bipartite matching only: a weight >= 0 on each candidate's crowding (how
            many near copies it has among the destinations) in the order candidates are
            merged away, so that of two equally close candidates the more crowded goes first
            (docs/method.md §4). ``0``: token merging's order. ``None`` (the default):
            ``DEFAULT_CROWDING`` with ``selection="bipartite"``; any other selection refuses
            a number.
        class_only_last: In ``forward`` (the logits), the last block computes only the
            prefix tokens' outputs (the class token, and a distillation token where there is
            one), for models whose head reads the class token alone (``global_pool="token"``):
            every patch token's output of that block is discarded by the head, so leaving it
            out changes no logit and saves most of that block's FLOPs (its keys and values are
            still computed). ``forward_features`` and ``forward_intermediates`` still compute
            every token; on ``transformers`` classifiers, so does a call that asks for hidden
            states or attentions. The last block then never reduces: the spread schedules and ``"all"`` leave
            it out of their stages. ``None`` (the default): on wherever it is exact (``patch``
            asks the model's family) and the stages leave the last block alone, off
            elsewhere. ``True``: on, and refused where it cannot apply or where an explicit
            stage is the last block. ``False``: off (the paper's method, token merging).
            Measured in docs/class_only.md; docs/method.md §10.
        fuse: The first release's switch, kept as an alias: ``True`` means
            ``reduction="fuse"``, ``False`` means ``reduction="drop"``. Stored as ``None``
            once folded into ``reduction``.
        seed: Seed of the ``"random"`` indicator's generator; ``None`` draws from torch's
            global generator. Only allowed with ``indicator="random"``.
        overlap_stride: Give the patch embedding this stride (at most the patch size), so
            neighbouring patches overlap and there are more tokens; ``None`` leaves it.
    """

    indicator: Optional[Indicator] = None
    keep_rate: Union[float, Sequence[float]] = 0.7  # a sequence is stored as a tuple
    stages: Stages = SPREAD
    T: float = 1.0
    fuse: Optional[bool] = None
    seed: Optional[int] = None
    overlap_stride: Optional[int] = None
    selection: Optional[Selection] = None
    reduction: Optional[Reduction] = None
    size_aware: bool = DEFAULT_SIZE_AWARE
    crowding: Optional[float] = None
    class_only_last: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.indicator is not None and self.indicator not in INDICATORS:
            raise ValueError(
                f"unknown indicator {self.indicator!r}; accepted: {', '.join(map(repr, INDICATORS))}"
            )
        if isinstance(self.keep_rate, (tuple, list)):
            if not self.keep_rate and self.stages != ():
                raise ValueError("keep_rate must be a float or a non-empty sequence of floats")
            keep: Union[float, Tuple[float, ...]] = tuple(unit_share("keep_rate", k) for k in self.keep_rate)
        else:
            keep = unit_share("keep_rate", self.keep_rate)
        object.__setattr__(self, "keep_rate", keep)

        named = isinstance(self.stages, str) and (self.stages == ALL_BLOCKS or is_spread(self.stages))
        if self.stages is not None and not named:  # (not ``!=``: an array compares element by element)
            if isinstance(self.stages, str):
                names = ", ".join(map(repr, (*SPREAD_STEPS, ALL_BLOCKS)))
                raise ValueError(f"unknown stages {self.stages!r}; accepted: {names}, None (the paper's "
                                 "stages) or a sequence of block indices")
            if isinstance(self.stages, abc.Mapping):  # its values would go unread
                raise TypeError(f"stages must be a sequence of block indices, got a {type(self.stages).__name__}; "
                                "for a keep rate per stage pass keep_rate=(...), one per stage in order")
            if isinstance(self.stages, abc.Set):
                raise TypeError(f"stages must be a sequence of block indices, in order, got a set {self.stages!r}")
            if isinstance(self.stages, TEXT_OR_BYTES) or not hasattr(self.stages, "__iter__"):
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

        T = real_or_type_error("T", self.T, "a number > 0")
        if not T > 0:
            raise ValueError(f"T must be > 0 (math.inf for mean pooling), got {self.T!r}")
        object.__setattr__(self, "T", T)

        self._fold_reduction()
        if self.selection is None:
            object.__setattr__(self, "selection", DEFAULT_SELECTION if self.indicator is None else "top")
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"unknown selection {self.selection!r}; accepted: {', '.join(map(repr, SELECTIONS))}"
            )
        if not isinstance(self.size_aware, bool):
            raise TypeError(f"size_aware must be True or False, got {self.size_aware!r}")
        self._check_crowding()
        self._check_read()
        if self.class_only_last is not None and not isinstance(self.class_only_last, bool):
            raise TypeError(f"class_only_last must be True, False or None (on where exact), "
                            f"got {self.class_only_last!r}")
        if self.seed is not None:
            seed = whole_or_type_error("seed", self.seed, "an int or None")
            if self.indicator != "random":
                raise ValueError(f"seed only applies to indicator='random', not {self.indicator!r}")
            object.__setattr__(self, "seed", seed)  # a NumPy integer too: torch's generator takes int
        if self.overlap_stride is not None:
            stride = whole_or_type_error("overlap_stride", self.overlap_stride, "a positive int or None")
            if stride < 1:
                raise ValueError(f"overlap_stride must be a positive int, got {stride}")
            object.__setattr__(self, "overlap_stride", stride)

    def _check_crowding(self) -> None:
        value = self.crowding
        if value is None:
            return
        weight = real_or_type_error("crowding", value, "a number >= 0 or None")
        if not 0 <= weight < math.inf:
            raise ValueError(f"crowding must be >= 0 and finite (0: token merging's order), got {value!r}")
        if self.selection != "bipartite":
            raise ValueError(f"crowding only applies to selection='bipartite', not {self.selection!r}; "
                             "leave it None")
        object.__setattr__(self, "crowding", weight)

    def _check_read(self) -> None:
        """Refuse a temperature or an indicator that the chosen reduction never reads (as a
        ``seed`` without the random indicator is refused), rather than ignore it."""
        fuse = self.reduction == "fuse"
        if self.T != 1.0 and not fuse:
            raise ValueError(f"T is the fusion token's temperature: it only applies to reduction='fuse' (the "
                             f"paper's method; pass reduction='fuse' for it), not {self.reduction!r}; otherwise "
                             "leave T at 1.0")
        if self.indicator is not None and self.selection == "bipartite" and not fuse:
            raise ValueError(
                f"indicator={self.indicator!r} plays no part with selection='bipartite' and "
                f"reduction={self.reduction!r}: bipartite matching reads no scores (only reduction='fuse' "
                "weighs by them); pass selection='top' or 'redundant' to choose tokens by the score, or "
                "leave indicator None")

    @property
    def crowding_weight(self) -> float:
        """The crowding weight the matching uses: ``crowding``, or its default for the selection."""
        if self.crowding is not None:
            return self.crowding
        return DEFAULT_CROWDING if self.selection == "bipartite" else 0.0

    @property
    def needs_scores(self) -> bool:
        """Whether a reducing block scores its tokens (the class row of attention): every
        selection but bipartite matching reads the scores, and a fusion token weights by them."""
        return self.selection != "bipartite" or self.reduction == "fuse"

    def _spread(self, depth: int, num_patches: int) -> "PruneConfig":
        """The spread schedule resolved, ``class_only_last`` applied. ``"spread"``: every
        block reduces, by the largest common keep rate whose tokens (summed over blocks, so
        about the FLOPs) do not exceed those of the paper's stages at ``keep_rate``.
        ``"spread2"``, ``"spread3"``: every second or third block counted back from the last,
        by the largest common rate whose tokens, as they run, do not exceed those of
        ``"spread"`` as it runs (so the three cost about the same)."""
        fuse = self.reduction == "fuse"

        def run(blocks: Tuple[int, ...], rate: float, class_only: bool = True) -> "PruneConfig":
            config = dataclasses.replace(self, stages=blocks, keep_rate=(rate,) * len(blocks))
            return config._class_only(depth) if class_only else config

        def counts(config: "PruneConfig") -> Tuple[int, ...]:
            stages, rates = config.schedule()
            return token_counts(rates, stages, depth, num_patches, fuse)

        # the paper's stages as written (a stage at the last block counted), as ``spread`` below: with
        # ``class_only_last`` both lose their last block's stage, and the other blocks keep what they kept
        paper = counts(dataclasses.replace(self, stages=None)._explicit(depth, named=self.stages))
        every = tuple(range(depth))
        spread = run(every, _largest_rate(lambda r: counts(run(every, r, False)), paper, num_patches))
        step = SPREAD_STEPS[str(self.stages)]
        if step == 1:
            return spread
        blocks = spread_blocks(depth, step)
        return run(blocks, _largest_rate(lambda r: counts(run(blocks, r)), counts(spread), num_patches))

    def _fold_reduction(self) -> None:
        if self.fuse is not None and not isinstance(self.fuse, bool):
            raise TypeError(f"fuse must be True or False, got {self.fuse!r}")
        if self.reduction is not None and self.reduction not in REDUCTIONS:
            raise ValueError(
                f"unknown reduction {self.reduction!r}; accepted: {', '.join(map(repr, REDUCTIONS))}"
            )
        reduction = self.reduction
        if self.fuse is not None:
            implied: Reduction = "fuse" if self.fuse else "drop"
            if reduction is not None and reduction != implied:
                raise ValueError(f"fuse={self.fuse} means reduction={implied!r}, but reduction={reduction!r}; "
                                 "pass only reduction")
            reduction = implied
        object.__setattr__(self, "reduction", DEFAULT_REDUCTION if reduction is None else reduction)
        object.__setattr__(self, "fuse", None)

    def resolve(self, depth: int, num_patches: Optional[int] = None) -> "PruneConfig":
        """This config for a model of ``depth`` blocks: explicit stages, one keep rate per stage.

        Args:
            depth: The model's number of blocks.
            num_patches: Its patch tokens; needed by the spread schedules only.

        Raises:
            ValueError: A stage is not a block of the model, keep rates and the default
                stages differ in number, or, with ``class_only_last``, an explicit stage
                is the last block.
        """
        if is_spread(self.stages):
            if num_patches is None:
                raise ValueError(f"stages={self.stages!r} is worked out for a model's patch count: pass num_patches")
            return self._spread(depth, num_patches)
        return self._explicit(depth)._class_only(depth, refuse=self.stages not in (None, ALL_BLOCKS))

    def schedule(self) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
        """The blocks that reduce and each one's keep rate, as tuples: the schedule of a
        config read back with :func:`~vitprune.get_config` (or made by :meth:`resolve`),
        typed as what it holds.

        Raises:
            ValueError: The stages are not explicit blocks (a spread schedule, ``"all"`` or
                ``None``, which :meth:`resolve` works out for a model).
        """
        stages, rates = self.stages, self.keep_rate
        if not isinstance(stages, tuple):
            raise ValueError(f"stages={stages!r} name no blocks until resolved for a model: read the config back "
                             "with vitprune.get_config(model), or call resolve(depth, num_patches)")
        return stages, _per_stage(rates, len(stages))

    def settle_class_only(self, applies: bool, depth: int) -> "PruneConfig":
        """This config with ``class_only_last=None`` made definite for a model of ``depth``
        blocks: on when the model allows it (``applies``, its family's answer) and no
        explicit stage is the last block, off otherwise. A definite value is kept."""
        if self.class_only_last is not None:
            return self
        explicit_last = isinstance(self.stages, tuple) and depth - 1 in self.stages
        return dataclasses.replace(self, class_only_last=applies and not explicit_last)

    def _class_only(self, depth: int, refuse: bool = False) -> "PruneConfig":
        """With ``class_only_last``, these resolved stages without the last block (which then
        computes only the prefix tokens, so a reduction there would change nothing); with
        ``refuse``, an explicit stage there is an error instead."""
        stages, rates = self.schedule()
        if not self.class_only_last or depth - 1 not in stages:
            return self
        if refuse:
            raise ValueError(
                f"stages include the last block ({depth - 1}), which computes only the class token with "
                "class_only_last=True, so a reduction there would change nothing; leave it out of stages")
        index = stages.index(depth - 1)
        return dataclasses.replace(self, stages=stages[:index] + stages[index + 1:],
                                   keep_rate=rates[:index] + rates[index + 1:])

    def _explicit(self, depth: int, named: Stages = None) -> "PruneConfig":
        """Explicit stages and one keep rate per stage, for stages other than the spread schedules
        (``named``: the spread schedule whose cost these stages set, for the error message)."""
        if self.stages is None:
            stages = default_stages(depth)
        elif self.stages == ALL_BLOCKS:
            stages = tuple(range(depth))
        else:
            stages = self.schedule()[0]
        bad = [s for s in stages if s >= depth]
        if bad:
            raise ValueError(
                f"stages {bad} out of range: the model has {depth} blocks (valid indices 0..{depth - 1})"
            )
        keep = self.keep_rate
        if isinstance(keep, tuple) and len(keep) != len(stages):
            if is_spread(named):
                meaning = (f"with stages={named!r} they are the rates of the paper's stages for {depth} blocks, "
                           f"{stages}, whose cost the schedule matches")
            elif self.stages is None:
                meaning = f"the paper's stages for {depth} blocks (stages=None) are {stages}"
            else:
                meaning = f"stages={self.stages!r} is all {depth} blocks of this model"
            raise ValueError(f"keep_rate has {len(keep)} values, but {meaning}; give {len(stages)} values or a "
                             "single float, or pass stages explicitly")
        return dataclasses.replace(self, stages=stages, keep_rate=_per_stage(keep, len(stages)))


def _per_stage(keep_rate: Union[float, Sequence[float]], count: int) -> Tuple[float, ...]:
    """One keep rate for each of ``count`` stages: a stored tuple as it is, or one float repeated."""
    if isinstance(keep_rate, (int, float)):
        return (float(keep_rate),) * count
    return tuple(keep_rate)


def token_counts(rates: Tuple[float, ...], stages: Tuple[int, ...], depth: int, n: int,
                 fuse: bool) -> Tuple[int, ...]:
    """Non-prefix tokens after every block, for ``n`` patches, when the blocks ``stages``
    keep ``rates`` of theirs (plus a fusion token with ``fuse``)."""
    counts, rate_of = [], dict(zip(stages, rates))
    for index in range(depth):
        if index in rate_of:
            k = kept_tokens(rate_of[index], n)
            n = k + 1 if fuse and k < n else k
        counts.append(n)
    return tuple(counts)


def _token_total(counts: Tuple[int, ...], n: int) -> int:
    """Tokens summed over the attention and MLP of every block (``n`` enter the first)."""
    return sum((n,) + counts[:-1]) + sum(counts)


def _largest_rate(counts: Callable[[float], Tuple[int, ...]], budget: Tuple[int, ...], n: int) -> float:
    """The largest keep rate in (0, 1] whose token ``counts`` total (:func:`_token_total`)
    at most ``budget``'s, ``n`` patches entering; among the rates with the same counts,
    the one with the fewest decimals."""
    limit = _token_total(budget, n)

    def tokens(rate: float) -> int:
        return _token_total(counts(rate), n)

    low, high = 1e-9, 1.0
    if tokens(high) <= limit:
        return high
    for _ in range(60):  # tokens(low) <= limit < tokens(high)
        middle = (low + high) / 2
        low, high = (middle, high) if tokens(middle) <= limit else (low, middle)
    reached = counts(low)
    rounded = (math.floor(low * 10 ** d) / 10 ** d for d in range(2, 10))
    return next((r for r in rounded if r > 0 and counts(r) == reached), low)


def kept_tokens(keep_rate: float, n: int) -> int:
    """:func:`keep_count` unchecked, for the forward: it runs at every stage of every call,
    where ``n`` may be a size that ``torch.compile`` traces."""
    return max(1, math.ceil(round(keep_rate * n, 9)))


def keep_count(keep_rate: float, n: int) -> int:
    """How many of ``n`` tokens a stage keeps at ``keep_rate``: ``ceil(keep_rate * n)``, at
    least 1, robust to float error (``0.28 * 25`` is 7.000000000000001 in floats and keeps 7).

    Raises:
        TypeError: ``keep_rate`` is no number, or ``n`` no whole number.
        ValueError: ``keep_rate`` is outside (0, 1], or ``n`` is below 1.
    """
    rate = unit_share("keep_rate", keep_rate)
    tokens = whole_or_type_error("n", n, "a whole number of tokens (int)")
    if tokens < 1:
        raise ValueError(f"n must be >= 1 token, got {n!r}")
    return kept_tokens(rate, tokens)
