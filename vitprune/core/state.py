"""The state a patched model carries: its config, and what the calling thread's last
forward kept."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .config import PruneConfig, kept_tokens
from .indicators import SCORES, uniform_random
from .overlap import OverlapRecord
from .merging import (bipartite_keep, bipartite_merge, bipartite_slots, key_metric, match_bipartite, match_redundant,
                      match_top, merge_tokens, size_bias, token_slots)
from .tokens import is_compiling, is_exporting, keep_or_fuse, prune_tokens


def in_backward() -> bool:
    """Whether the calling thread is running the backward pass (a block recomputed by gradient
    checkpointing). Never while compiling or exporting: those graphs recompute in-graph."""
    if is_compiling() or is_exporting():
        return False
    current = getattr(torch._C, "_current_autograd_node", None)
    return current is not None and current() is not None


class Scored(NamedTuple):
    """What a pruning block hands to the reduction step.

    Attributes:
        row: ``(B, H, N)`` float32: the per-head attention the indicators score, or ``None``
            when the reduction needs no score.
        keys: ``(B, H, P + N, d)``: the keys as the attention used them (for similarity).
    """

    row: Optional[torch.Tensor]
    keys: torch.Tensor


#: Works out a stage's positions from those of the stage before it (``None`` at the first).
MakePositions = Callable[[Optional[torch.Tensor]], torch.Tensor]
#: Works out a stage's slots (``merging.token_slots``): where each token it received went.
MakeSlots = Callable[[], torch.Tensor]
#: Gives a stage's kept indices (into the tokens it received).
MakeKeep = Callable[[], torch.Tensor]


class ForwardRecords:
    """What one forward kept (see :class:`PruneState`); one per thread, replaced at stage 0.

    A stage's positions are worked out when first read (``positions``): most forwards never
    read them, and in eager mode each operation a reduction step saves is worth more than
    its size (see ``merging.bipartite_merge``). Compiled and traced forwards work them out
    at once.
    """

    def __init__(self) -> None:
        self._positions: Dict[int, torch.Tensor] = {}
        self._pending: Dict[int, Tuple[Optional[int], MakePositions]] = {}
        self.counts: Dict[int, Tuple[int, int]] = {}  # each stage's positions' shape, known before they are
        self.stage_sizes: Dict[int, torch.Tensor] = {}
        self.stage_bias: Dict[int, torch.Tensor] = {}  # size_aware: each stage's size_bias
        self.sizes: Optional[torch.Tensor] = None
        self.patches: Optional[int] = None  # patch tokens entering the first stage
        self._slots: Dict[int, Tuple[Optional[int], MakeSlots]] = {}  # eager forwards only
        self._groups: Dict[int, torch.Tensor] = {}

    @property
    def positions(self) -> Dict[int, torch.Tensor]:
        """Stage number -> ``(B, n)`` positions (see :class:`PruneState`)."""
        for stage in sorted(self._pending):
            previous, make = self._pending.pop(stage)
            self._positions[stage] = make(None if previous is None else self._positions[previous])
        return self._positions

    @property
    def groups(self) -> Dict[int, torch.Tensor]:
        """Stage number -> ``(B, N)``: for each of the ``N`` patches, the index of the
        non-prefix token that holds it after that stage, or ``-1`` once it was dropped.

        Raises:
            RuntimeError: The last forward was compiled, exported or traced, which record
                no slots.
        """
        if set(self._slots) != set(self.counts):
            raise RuntimeError("token groups are recorded by eager forwards only; the last forward was compiled, "
                               "exported or traced: run one eagerly (without torch.compile) to read them")
        for stage in sorted(set(self._slots) - set(self._groups)):
            previous, make = self._slots[stage]
            slots = make()
            if previous is None:  # it received the patches in order
                self._groups[stage] = slots
            else:
                before = self._groups[previous]
                self._groups[stage] = torch.where(before >= 0, slots.gather(1, before.clamp_min(0)), before)
        return self._groups

    def record_slots(self, stage: int, previous: Optional[int], make: MakeSlots, always: bool = False) -> None:
        """Stage ``stage`` sent the tokens it received as ``make()`` says; they were stage
        ``previous``'s (``None``: the patches in order). Kept for eager forwards, and with
        ``always`` for compiled and traced ones too (a graph computes them whether or not
        anyone reads them, so only a forward that reads them in-graph asks)."""
        if always or not (is_compiling() or is_exporting() or torch.jit.is_tracing()):
            self._slots[stage] = (previous, make)
            self._groups.pop(stage, None)  # recomputed (gradient checkpointing): read afresh

    def record_positions(self, stage: int, previous: Optional[int], shape: Tuple[int, int],
                         make: MakePositions) -> None:
        """Stage ``stage``'s positions are ``make`` of stage ``previous``'s (``None``: it
        received the patches in order); ``shape`` is theirs."""
        self.counts[stage] = shape
        if is_compiling() or is_exporting() or torch.jit.is_tracing():
            self._positions[stage] = make(None if previous is None else self.positions[previous])
        else:
            self._pending[stage] = (previous, make)


#: Whether ``torch.compile`` can trace a patched forward: dynamo before torch 2.6 fails on
#: the per-thread records (an internal error on torch 2.4), so there the forward runs eagerly.
DYNAMO_TRACES_RECORDS = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


def enter(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)``, as every patched model method that reads or writes the
    per-thread records from outside the blocks is entered (the model's ``forward``,
    ``forward_features``, ``forward_intermediates``, its pooling), under whatever traces it:

    - ``torch.fx`` symbolic tracing (``torch.fx.symbolic_trace``, timm's fx feature
      extractor) is refused with a ``TypeError`` saying what works instead: the token
      counts and the records need real shapes, which fx's proxies do not have;
    - ``torch.compile`` on a torch that cannot trace the records
      (:data:`DYNAMO_TRACES_RECORDS`) runs the method eagerly inside the compiled caller:
      the eager outputs (the README says so)."""
    if any(isinstance(value, torch.fx.Proxy) for value in (*args, *kwargs.values())):
        raise TypeError(
            "vitprune: torch.fx cannot trace a patched model (its token counts and per-call records need "
            "real tensor shapes); for intermediate features use model.forward_intermediates (what timm's "
            "features_only=True models call), trace with torch.compile or torch.export, or "
            "vitprune.unpatch the model first"
        )
    if is_compiling() and not DYNAMO_TRACES_RECORDS:
        return torch._dynamo.disable(method)(*args, **kwargs)
    return method(*args, **kwargs)


class PruneState:
    """Shared by a patched model and its pruning blocks; one per patched model.

    The per-forward attributes (``positions``, ``sizes``, ``stage_sizes``) are per thread:
    several threads may run the same patched model at once, and each reads what its own
    last forward kept. A block recomputed in the backward pass (gradient checkpointing)
    reads the last forward's records whichever thread it runs on: autograd runs the
    backward of CUDA tensors on a thread of its own, which ran no forward.

    Attributes:
        config: The resolved config (explicit stages, one keep rate per stage).
        num_prefix: Tokens at the front that are never pruned.
        generator: The ``"random"`` indicator's generator, or ``None``.
        overlap: What the overlapping patch embedding replaced, or ``None``.
        row_source: Where the scored attention row comes from (``attention.ROW_SOURCES``).
        positions: For the last forward, by stage number (0 for the first pruning block):
            ``(B, n)`` long tensor giving, for each non-prefix token after that stage, the
            index of the patch token it was when it entered the first block, or ``-1``
            for the fusion token.
        sizes: For the last forward, ``(B, n)`` float tensor: how many original patches
            each non-prefix token after the last stage that pruned stands for (1 for a
            kept patch, more for a token that others were merged into and for the fusion
            token), or ``None`` when nothing was pruned. Average and attention pooling
            weight tokens by it.
        stage_sizes: For the last forward, by stage number: the sizes of the tokens that
            stage left (what ``size_aware`` attention reads in the blocks after it).
    """

    def __init__(self, config: PruneConfig, num_prefix: int, generator: Optional[torch.Generator],
                 row_source: str = "cls") -> None:
        self.config = config
        self.num_prefix = num_prefix
        self.generator = generator
        self.row_source = row_source if config.needs_scores else "none"
        self.overlap: Optional[OverlapRecord] = None
        self._local = threading.local()
        self._latest: Optional[ForwardRecords] = None  # the last forward's records, on any thread
        self._latest_head_only = False  # and its head_only

    def __getstate__(self) -> Dict[str, Any]:  # pickle, deepcopy: thread records stay behind
        state = dict(self.__dict__)
        del state["_local"]
        state["_latest"], state["_latest_head_only"] = None, False
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    @property
    def records(self) -> ForwardRecords:
        """The calling thread's records of its last forward (empty before its first); in the
        backward pass, those of the last forward on any thread (see the class docs)."""
        if in_backward() and self._latest is not None:  # in_backward first: no compile guard on _latest
            return self._latest
        records = getattr(self._local, "records", None)
        if records is None:
            records = self._local.records = ForwardRecords()
        return records

    @property
    def positions(self) -> Dict[int, torch.Tensor]:
        return self.records.positions

    @property
    def stage_sizes(self) -> Dict[int, torch.Tensor]:
        return self.records.stage_sizes

    @property
    def sizes(self) -> Optional[torch.Tensor]:
        return self.records.sizes

    @property
    def head_only(self) -> bool:
        """Whether the calling thread's current (or last) call runs the last block for the
        prefix tokens alone (``class_only_last``): set by the model's ``forward``, cleared by a
        direct ``forward_features`` or ``forward_intermediates``. It stays set after the
        forward returns, so gradient checkpointing recomputes the same block."""
        if in_backward():
            return self._latest_head_only
        return getattr(self._local, "head_only", False)

    @head_only.setter
    def head_only(self, value: bool) -> None:
        self._local.head_only = value
        if not is_compiling():
            self._latest_head_only = value

    @property
    def in_forward(self) -> bool:
        """Whether the calling thread is inside the model's ``forward`` (whose own call of
        ``forward_features`` must not clear :attr:`head_only`)."""
        return getattr(self._local, "in_forward", False)

    @in_forward.setter
    def in_forward(self, value: bool) -> None:
        self._local.in_forward = value

    @property
    def wants_groups(self) -> bool:
        """Whether the calling thread's current forward reads its token groups before it
        returns (``forward_intermediates`` making NCHW maps), so that compiled and traced
        forwards record them too."""
        return getattr(self._local, "wants_groups", False)

    @wants_groups.setter
    def wants_groups(self, value: bool) -> None:
        self._local.wants_groups = value

    def run_forward(self, head_only: bool, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``forward(*args, **kwargs)``, the model's own ``forward``, with :attr:`head_only` set
        for this call and :attr:`in_forward` while it runs (what a patched model's ``forward``
        wraps around its class's)."""
        return enter(self._run_forward, head_only, forward, *args, **kwargs)

    def _run_forward(self, head_only: bool, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.head_only = head_only
        self.in_forward = True
        try:
            return forward(*args, **kwargs)
        finally:
            self.in_forward = False

    def scores(self, row: torch.Tensor) -> torch.Tensor:
        """``(B, N)`` float32 scores from the class attention row ``(B, H, N)`` (``"var"``
        when the config names no indicator)."""
        if self.config.indicator == "random":
            return uniform_random(row, self.generator)
        return SCORES[self.config.indicator or "var"](row)

    def begin(self, x: torch.Tensor, stage: Optional[int], follow: Optional[int]) -> Optional[torch.Tensor]:
        """Called first by every swapped block; returns the additive attention bias for ``x``.

        Args:
            x: The block's input tokens (or their norm: only the shape and dtype are read).
            stage: The block's stage number, or ``None`` for a block that only follows.
                Stage 0 starts a forward (fresh per-forward records).
            follow: The stage whose output the block receives, or ``None``. Reading that
                stage's record, not the latest, keeps recomputation (gradient checkpointing)
                exact.

        Returns:
            With ``size_aware``, once a stage has reduced: ``log(size)`` per token
            (:func:`~vitprune.core.merging.size_bias`); else ``None``.
        """
        if stage == 0 and not in_backward():  # fresh, not reads of the last forward's: no torch.compile guards
            self._local.records = ForwardRecords()
            if not is_compiling():
                self._latest = self._local.records
        # worked out by the stage that reduced (in ``prune``, among its other small operations)
        bias = None if follow is None else self.records.stage_bias.get(follow)
        if bias is None:
            return None
        shape = x.shape
        return bias if bias.shape[0] == shape[0] and bias.shape[-1] == shape[1] else None

    @staticmethod
    def _sizes_after(records: ForwardRecords, stage: int, shape: Tuple[int, int]) -> Optional[torch.Tensor]:
        """The token sizes stage ``stage`` left, if they are ``shape`` (this input's)."""
        sizes = records.stage_sizes.get(stage)
        return None if sizes is None or sizes.shape != shape else sizes

    @staticmethod
    def _refuse_tracers(x: torch.Tensor) -> None:
        """Refuse the tracers that cannot hold a reduction of tokens ``x`` (at the first stage:
        every forward reaches it before any other).

        Raises:
            TypeError: The TorchScript-based ONNX exporter is tracing (it cannot export a reduction).
            ValueError: ``torch.export`` traces a dynamic image size (token counts are fixed per size).
        """
        if torch.onnx.is_in_onnx_export() and not is_exporting():  # the TorchScript-based exporter
            raise TypeError(
                "vitprune: the TorchScript-based ONNX exporter (torch.onnx.export(..., dynamo=False)) cannot "
                "export a patched model (it has no stable sort, and given topk instead its graph of the merges "
                "computed other outputs); use torch.onnx.export(..., dynamo=True), or torch.export"
            )
        if is_exporting() and isinstance(x.shape[1], torch.SymInt):  # type: ignore[unreachable]  # typed int
            raise ValueError(
                "vitprune: torch.export was asked for a dynamic image size, but a patched model's token "
                "counts are fixed for each image size, so its graph cannot hold every size; mark only the "
                "batch dimension dynamic (dynamic_shapes={'x': {0: Dim('batch')}}) and export once per image "
                "size (torch.compile handles several sizes itself)"
            )

    def prune(self, x: torch.Tensor, scored: Scored, stage: int) -> torch.Tensor:
        """Apply reduction stage ``stage`` to tokens ``x`` given the block's :class:`Scored`.

        Raises:
            TypeError, ValueError: At the first stage, under a tracer that cannot hold a
                reduction (:meth:`_refuse_tracers`).
        """
        P, records = self.num_prefix, self.records
        if stage == 0:
            self._refuse_tracers(x)
        B, n = x.shape[0], int(x.shape[1]) - P  # int(): a traced shape is a tensor
        if stage == 0:
            records.patches = n
        # the last stage's positions index these tokens only if they are this input's
        previous = stage - 1 if records.counts.get(stage - 1) == (B, n) else None

        config = self.config
        # scored at keep 1.0 too, so benchmarks there measure the scoring cost
        row = scored.row  # given exactly when ``config.needs_scores`` (``row_source``)
        scores = self.scores(row) if row is not None else None
        k = kept_tokens(config.schedule()[1][stage], n)  # the resolved config's rate for this stage
        sizes = self._sizes_after(records, stage - 1, (B, n))
        if k == n:
            records.record_positions(stage, previous, (B, n), functools.partial(_unchanged, B, n, x.device))
            records.record_slots(stage, previous, functools.partial(_unchanged, B, n, x.device, None),
                                 self.wants_groups)
            if sizes is not None:
                records.stage_sizes[stage] = sizes
                if stage - 1 in records.stage_bias:
                    records.stage_bias[stage] = records.stage_bias[stage - 1]
            return x
        if sizes is None:
            sizes = x.new_ones((B, n), dtype=torch.float32)
        x, keep, drop, sizes_kept, slots = self._reduce(x, scored, scores, sizes, k)
        fused = int(x.shape[1]) - P > k  # a fusion token at the end
        if fused:
            assert drop is not None  # a fusion token's reduction gives its removed tokens
            sizes_kept = torch.cat([sizes_kept, sizes.gather(1, drop).sum(dim=1, keepdim=True)], dim=1)
        records.record_positions(stage, previous, (B, k + int(fused)), functools.partial(_kept, keep, fused))
        records.record_slots(stage, previous, slots, self.wants_groups)
        records.stage_sizes[stage] = records.sizes = sizes_kept
        if config.size_aware:
            records.stage_bias[stage] = size_bias(sizes_kept, P, x.dtype)
        return x

    def _reduce(self, x: torch.Tensor, scored: Scored, scores: Optional[torch.Tensor], sizes: torch.Tensor,
                k: int) -> Tuple[torch.Tensor, MakeKeep, Optional[torch.Tensor], torch.Tensor, MakeSlots]:
        """The selection and reduction of the config: the new tokens, a function giving the kept
        indices (worked out when read where nothing else needs them), the removed ones (``None``
        where no fusion token needs them), the kept tokens' sizes, and a function giving the
        slots (``merging.token_slots``)."""
        config, P = self.config, self.num_prefix
        n = sizes.shape[1]
        if config.selection == "bipartite" and config.reduction == "merge" and 2 * k >= n:
            merged = bipartite_merge(x, scored.keys, sizes, k, P, config.crowding_weight)  # the defaults' one round
            return (merged.tokens, functools.partial(bipartite_keep, merged.stays, n), None, merged.sizes,
                    functools.partial(bipartite_slots, merged.stays, merged.removed, merged.dest, n))
        removed_into = k if config.reduction == "fuse" else -1  # the fusion token follows the kept ones
        if config.selection == "top" and config.reduction != "merge":
            assert scores is not None  # a selection by score (``config.needs_scores``)
            x, sel = prune_tokens(x, scores, P, k, config.reduction == "fuse", config.T)
            return (x, functools.partial(_given, sel.keep), sel.drop, sizes.gather(1, sel.keep),
                    functools.partial(token_slots, sel.keep, sel.drop, removed_into))
        metric = key_metric(scored.keys, P)
        if config.selection == "bipartite":
            matched = match_bipartite(metric, k, sizes, config.crowding_weight)
        else:
            assert scores is not None  # a selection by score (``config.needs_scores``)
            matched = match_top(scores, metric, k) if config.selection == "top" else match_redundant(scores, metric, k)
        if config.reduction == "merge":
            merged_tokens, sizes_kept = merge_tokens(x, sizes, matched, P)
            return (merged_tokens, functools.partial(_given, matched.keep), matched.drop, sizes_kept,
                    functools.partial(token_slots, matched.keep, matched.drop, matched.dest))
        x = keep_or_fuse(x, matched.keep, matched.drop, P, config.reduction == "fuse", scores, config.T)
        return (x, functools.partial(_given, matched.keep), matched.drop, sizes.gather(1, matched.keep),
                functools.partial(token_slots, matched.keep, matched.drop, removed_into))

    def token_groups(self) -> List[torch.Tensor]:
        """``records.groups`` as a list in stage order (see ``ForwardRecords.groups``)."""
        groups = self.records.groups
        return [groups[s] for s in sorted(groups)]

    def kept_positions(self) -> List[torch.Tensor]:
        """``positions`` as a list in stage order (see the class docs)."""
        positions = self.positions
        return [positions[s] for s in sorted(positions)]


def _unchanged(B: int, n: int, device: torch.device, previous: Optional[torch.Tensor]) -> torch.Tensor:
    """A stage that kept every token: the positions it received."""
    return torch.arange(n, device=device).expand(B, n) if previous is None else previous


def _given(indices: torch.Tensor) -> torch.Tensor:
    """``indices``: a :data:`MakeKeep` for indices already worked out."""
    return indices


def _kept(make_keep: MakeKeep, fused: bool, previous: Optional[torch.Tensor]) -> torch.Tensor:
    """A stage that kept ``make_keep()`` (indices into its input), and a fusion token (``-1``)
    after them when ``fused``. (A function in every case: telling a tensor from a
    ``functools.partial`` is what torch 2.6's dynamo cannot trace.)"""
    keep = make_keep()
    kept = keep if previous is None else previous.gather(1, keep)
    return torch.cat([kept, kept.new_full((kept.shape[0], 1), -1)], dim=1) if fused else kept
