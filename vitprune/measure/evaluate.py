"""Accuracy, FLOPs and speed of many patch settings of one model, in one pass over the data.

Every batch goes through every setting (each a patched copy of the model) before the
next batch is read, so the data is decoded once however many settings there are, and
the settings take turns on the same batches (the order rotating each batch), so machine
noise hits them alike: ``speedup`` is measured in the same run, against the unpruned
model, as the median over the batches of each batch's time ratio (a slow spell or a pause
during a few batches does not move it). This is what ``vitprune eval`` runs; the data and
the model come from the caller.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core.config import DEFAULT_METHOD, INDICATORS, method_options
from ..core.numeric import unit_share, whole_or_type_error
from ..core.patching import check_model, get_config, is_patched, patch
from .baseline import fit_merging, merging_config
from .budget import fit_keep_rate
from .flops import count_flops, schedule_flops
from .outputs import logits_of
from .sync import device_sync

#: Method names: vitprune's defaults, the paper's method with each indicator, token merging.
DEFAULT, MERGING = DEFAULT_METHOD, "merging"
METHODS = (DEFAULT, *INDICATORS)


@dataclass(frozen=True)
class Setting:
    """One way to run the model: its label, how it was chosen, and its patch options.

    Attributes:
        label: Unique, for tables and plots (``"default keep 0.7"``, ``"var 50% FLOPs"``).
        method: ``"unpruned"``, ``"default"``, an indicator (the paper's method with it) or
            ``"merging"`` (the token-merging baseline).
        keep_rate: The keep rate asked for, or the one a budget fitted (``None``: unpruned
            or merging).
        budget: The share of the unpruned FLOPs asked for, or ``None``.
        options: ``patch`` options; ``None`` for the unpruned model.
    """

    label: str
    method: str
    keep_rate: Optional[float] = None
    budget: Optional[float] = None
    options: Optional[Dict[str, Any]] = field(default=None, compare=False)


@dataclass
class Row:
    """What one setting measured (``top1``/``top5`` in percent; ``images_per_s`` over all the
    batches, ``speedup`` over the unpruned model by :func:`median_speedups`, the median of
    ``batches`` per-batch ratios)."""

    setting: str
    method: str
    keep_rate: Optional[float]
    budget: Optional[float]
    top1: float
    top5: float
    gflops: float
    flops_share: float
    images_per_s: float
    speedup: float
    images: int
    batches: int

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def gflops_of(model: nn.Module, img_size: Optional[Sequence[int]] = None) -> float:
    """GFLOPs per image: the analytic count where it applies (every family ``patch``
    accepts, hybrids included), else fvcore's."""
    try:
        return schedule_flops(model, get_config(model) if is_patched(model) else None, img_size) / 1e9
    except TypeError:
        return count_flops(model, img_size) / 1e9


#: What a setting's name says of a ``class_only_last`` forced on every method (``None``: nothing).
CLASS_ONLY_SUFFIX = {None: "", True: " class-only last", False: " full last"}


def class_only_options(class_only_last: Optional[bool]) -> Dict[str, Any]:
    """The ``patch`` option that forces ``class_only_last`` (none for ``None``: each method's own)."""
    return {} if class_only_last is None else {"class_only_last": class_only_last}


def build_settings(model: nn.Module, *, methods: Sequence[str] = (DEFAULT,), keep_rates: Sequence[float] = (),
                   budgets: Sequence[float] = (), stages: Optional[Sequence[Any]] = None,
                   reductions: Sequence[Optional[str]] = (None,), baseline: bool = False,
                   img_size: Optional[Sequence[int]] = None, class_only_last: Optional[bool] = None) -> List[Setting]:
    """The unpruned model, then every method at every keep rate and every FLOP budget.

    Args:
        model: The model the settings are for (budgets are fitted to it).
        methods: ``"default"`` and/or indicators (the paper's method with each).
        keep_rates: Keep rates in (0, 1].
        budgets: Shares of the unpruned FLOPs in (0, 1]; each method's keep rate is fitted
            (``fit_keep_rate``; needs a model whose FLOPs are counted analytically: any
            family ``patch`` accepts).
        stages: Stage schedules to override each method's own (``None``: each method's), as
            ``PruneConfig`` takes them or ``"paper"`` for the paper's three stages
            (``stages=None``), which the defaults' method can run too.
        reductions: ``reduction`` values to override each method's own (``None``: its own).
        baseline: Add token merging at every budget (and, at every keep rate, at the FLOPs
            the defaults have there).
        img_size: The input size the FLOPs are counted for.
        class_only_last: ``None``: each method's own (the defaults: on where exact; the
            paper's method: off). ``True`` or ``False``: every method (not the baseline)
            with that ``class_only_last``; the budget fits spend its saving.

    Raises:
        TypeError, ValueError: A method, rate, budget or option ``patch`` would refuse; the
            message names it. Checked by patching a copy, before any data is read.
    """
    for name in methods:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; accepted: {', '.join(METHODS)}")
    keep_rates = [unit_share("a keep rate", r) for r in keep_rates]  # NumPy's too, as floats: JSON takes them
    budgets = [unit_share("a budget", b) for b in budgets]
    check_model(model)
    unpruned = gflops_of(model, img_size)
    scratch = copy.deepcopy(model)  # patched again for each check: patch replaces the previous patch
    settings = [Setting("unpruned", "unpruned")]
    for method in methods:
        for schedule in ([None] if stages is None else list(stages)):
            for reduction in reductions:
                options = dict(method_options(method, schedule), **class_only_options(class_only_last))
                if reduction is not None:
                    options["reduction"] = reduction
                suffix = "".join([f" stages {_stage_text(schedule)}" if schedule is not None else "",
                                  f" {reduction}" if reduction is not None else "",
                                  CLASS_ONLY_SUFFIX[class_only_last]])
                for rate in keep_rates:
                    settings.append(Setting(f"{method}{suffix} keep {rate:g}", method, rate, None,
                                            {**options, "keep_rate": rate}))
                for share in budgets:
                    rate = fit_keep_rate(model, share * unpruned, img_size=img_size, **options)
                    settings.append(Setting(f"{method}{suffix} {share:.0%} FLOPs", method, rate, share,
                                            {**options, "keep_rate": rate}))
    if baseline:
        targets: List[Tuple[str, Optional[float], float]] = [(f"{share:.0%} FLOPs", share, share * unpruned)
                                                             for share in budgets]
        forced = class_only_options(class_only_last)
        targets += [(f"at default keep {rate:g}", None, gflops_of(patch(scratch, keep_rate=rate, **forced), img_size))
                    for rate in keep_rates]
        for text, asked, gflops in targets:  # asked: the budget's share, None at a keep rate's FLOPs
            config = fit_merging(model, gflops, img_size) if gflops < unpruned else merging_config(model, 0, img_size)
            settings.append(Setting(f"{MERGING} {text}", MERGING, None, asked, {"config": config}))
    for setting in settings[1:]:  # what patch would refuse, refused now
        apply_setting(scratch, setting)
    return settings


def _stage_text(schedule: Any) -> str:
    return schedule if isinstance(schedule, str) else ",".join(str(s) for s in schedule)


def apply_setting(model: nn.Module, setting: Setting) -> nn.Module:
    """``model`` patched as ``setting`` says (left as it is for the unpruned setting)."""
    if setting.options is None:
        return model
    options = dict(setting.options)
    config = options.pop("config", None)
    return patch(model, config, **options)


def _top_k(logits: torch.Tensor, labels: torch.Tensor, k: int) -> int:
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    return int((top == labels.unsqueeze(-1)).any(dim=-1).sum())


def median_speedups(batch_seconds: Sequence[Sequence[float]]) -> List[float]:
    """Each setting's speedup over the first (the unpruned model): the median over the batches
    of the first's time on a batch divided by the setting's time on that batch.

    Args:
        batch_seconds: ``batch_seconds[i][b]``, setting ``i``'s time on batch ``b``.
    """
    return [statistics.median(first / own for first, own in zip(batch_seconds[0], times))
            for times in batch_seconds]


@torch.inference_mode()
def evaluate(model: nn.Module, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], settings: Sequence[Setting], *,
             device: "str | torch.device" = "cpu", amp: bool = False, img_size: Optional[Sequence[int]] = None,
             limit: Optional[int] = None, progress: Optional[Callable[[int], None]] = None) -> List[Row]:
    """Run every batch through every setting once, and measure each.

    Args:
        model: The unpruned model (left as it is: each setting runs a patched copy).
        batches: ``(images, labels)`` pairs, e.g. a timm or torch ``DataLoader``.
        settings: From :func:`build_settings`; the first must be the unpruned model.
        device: Where the models run.
        amp: Run under ``torch.autocast`` (bfloat16 on CPU, float16 on CUDA).
        img_size: The input size, for the FLOP count (the model's own when ``None``).
        limit: Stop after this many images (a whole number >= 1; ``None``: all of them).
        progress: Called with the number of images of each batch once all settings ran it.

    Returns:
        One :class:`Row` per setting, in order.

    Raises:
        ValueError: The first setting is not the unpruned model, ``limit`` is below 1
            (checked before any model is copied), or no batch held an image.
        TypeError: ``limit`` is no whole number, or ``amp`` not ``True`` or ``False``
            (checked before any model is copied).
    """
    if not settings or settings[0].options is not None:
        raise ValueError("the first setting must be the unpruned model (build_settings puts it first)")
    wanted = "a whole number of images (int) or None for all"
    if limit is not None and whole_or_type_error("limit", limit, wanted) < 1:
        raise ValueError(f"limit must be >= 1 image, or None for all, got {limit!r}")
    if not isinstance(amp, bool):  # a string would enable autocast, or fail in torch after the copies
        raise TypeError(f"amp must be True or False, got {amp!r}")
    device = torch.device(device)
    models = [apply_setting(copy.deepcopy(model), s).to(device).eval() for s in settings]
    gflops = [gflops_of(m, img_size) for m in models]
    top1 = [0] * len(models)
    top5 = [0] * len(models)
    seconds: List[List[float]] = [[] for _ in models]  # each setting's time on each batch
    seen = 0
    sync = device_sync(device)
    autocast = torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16,
                              enabled=amp)
    for index, (images, labels) in enumerate(batches):
        if limit is not None and seen >= limit:
            break
        if limit is not None:
            images, labels = images[:limit - seen], labels[:limit - seen]
        images, labels = images.to(device), labels.to(device)
        order = list(range(len(models)))
        shift = index % len(models)
        for i in order[shift:] + order[:shift]:  # the settings take turns going first
            sync()
            start = time.perf_counter()
            with autocast:
                logits = logits_of(models[i](images))
            sync()
            seconds[i].append(time.perf_counter() - start)
            top1[i] += _top_k(logits, labels, 1)
            top5[i] += _top_k(logits, labels, 5)
        seen += len(labels)
        if progress is not None:
            progress(len(labels))
    if seen == 0:
        raise ValueError("no images were evaluated: the data is empty")
    rows = []
    for setting, g, c1, c5, s, speedup in zip(settings, gflops, top1, top5, seconds, median_speedups(seconds)):
        rows.append(Row(setting=setting.label, method=setting.method, keep_rate=setting.keep_rate,
                        budget=setting.budget, top1=100 * c1 / seen, top5=100 * c5 / seen, gflops=g,
                        flops_share=g / gflops[0], images_per_s=seen / sum(s), speedup=speedup, images=seen,
                        batches=len(s)))
    return rows
