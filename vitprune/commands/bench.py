"""``vitprune bench``: FLOPs, throughput and peak memory of pruned vs unpruned, in one run.

Every setting gets its own copy of the same model. After a warm-up, the settings take
turns (A B C ... then B C ... A, the order rotating each round) and the median time per
step is reported, so machine noise hits all settings alike. Speed is a ratio to the
unpruned model measured in the same run, next to the ideal ratio from the FLOP counts.
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import timm
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..core.config import PruneConfig, method_options
from ..core.grid import input_size
from ..core.patching import check_model, get_config, is_patched, patch
from ..data.hf_models import is_transformers_name, load_transformers_model
from ..measure.baseline import fit_merging
from ..measure.evaluate import CLASS_ONLY_SUFFIX, class_only_options
from ..measure.flops import count_flops, schedule_flops
from ..measure.memory import cpu_peak_bytes, cuda_peak_bytes
from ..measure.outputs import main_tensor
from ..measure.sync import device_sync
from .parsers import CLASS_ONLY, DEFAULT

#: ``Setting.indicator`` of the token-merging baseline.
MERGING = "merging"

#: ``--dtype``: the autocast dtype (float32: no autocast) ...
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-weights": torch.float32}
#: ... and the dtype the weights and images are cast to, where not float32.
WEIGHTS = {"bf16-weights": torch.bfloat16}


@dataclass(frozen=True)
class Setting:
    """One row of the table: unpruned (``indicator=None``) or one patch."""

    indicator: Optional[str] = None
    keep_rate: float = 1.0
    stages: Union[None, str, Tuple[int, ...]] = None  # a named schedule ("spread2", "paper") or blocks
    overlap_stride: Optional[int] = None
    class_only_last: Optional[bool] = None  # None: the method's own (see ``PruneConfig``)
    fitted: Optional[PruneConfig] = field(default=None, compare=False)  # the merging baseline's config

    @property
    def label(self) -> str:
        if self.indicator is None:
            return "unpruned"
        if self.indicator == MERGING:
            return f"merging @ default keep {self.keep_rate:g}"
        where = "" if self.stages is None else f" @{_stages_text(self.stages)}"
        overlap = "" if self.overlap_stride is None else f" ov{self.overlap_stride}"
        return f"{self.indicator} keep {self.keep_rate:g}{where}{overlap}{CLASS_ONLY_SUFFIX[self.class_only_last]}"

    def config(self) -> Optional[PruneConfig]:
        """``indicator="default"``: vitprune's defaults (``stages`` default ``"spread"``);
        an indicator: the paper's method with it (``stages`` default: the paper's); ``stages``
        ``"paper"``: the paper's three stages, scaled to the depth, for either;
        ``"merging"``: the token-merging baseline fitted to the defaults' FLOPs at ``keep_rate``."""
        if self.indicator is None:
            return None
        if self.indicator == MERGING:
            return self.fitted
        options = {**method_options(self.indicator, self.stages), **class_only_options(self.class_only_last)}
        return PruneConfig(keep_rate=self.keep_rate, overlap_stride=self.overlap_stride, **options)


@dataclass
class Row:
    """One measured setting; ``speedup`` and ``ideal_speedup`` are ratios to the unpruned row."""

    model: str
    setting: str
    indicator: Optional[str]
    keep_rate: float
    stages: Union[None, str, List[int]]
    overlap_stride: Optional[int]
    gflops: float
    images_per_s: float
    speedup: float
    ideal_speedup: float
    achieved_over_ideal: float
    peak_memory_mb: Optional[float]
    mode: str
    device: str
    dtype: str
    batch: int
    img_size: List[int]
    threads: int
    compiled: bool
    rounds: int
    class_only_last: Optional[bool] = None  # what the patched model runs (None: unpruned)


def _stages_text(stages: Union[str, Tuple[int, ...]]) -> str:
    """A schedule for a label: its name, or its blocks comma-separated."""
    return stages if isinstance(stages, str) else ",".join(map(str, stages))


def settings_grid(indicators: Sequence[str], keep_rates: Sequence[float],
                  stages: Sequence[Union[None, str, Tuple[int, ...]]],
                  overlap_strides: Sequence[Optional[int]] = (None,),
                  class_only_last: Optional[bool] = None) -> List[Setting]:
    """The unpruned setting, then every indicator x keep rate x stages x overlap stride
    (each with ``class_only_last``; ``None``: each method's own)."""
    grid = [Setting()]
    for combination in itertools.product(indicators, keep_rates, stages, overlap_strides):
        grid.append(Setting(*combination, class_only_last=class_only_last))
    return grid


def build_model(name: str, setting: Setting, device: str, seed: int = 0, **model_kwargs: Any) -> torch.nn.Module:
    """A timm model, or ``hf:NAME_OR_FOLDER`` for a ``transformers`` one (random weights
    unless ``pretrained=True`` is passed), patched per ``setting``."""
    if is_transformers_name(name):
        model = load_transformers_model(name, model_kwargs.get("pretrained", False), seed)[0].to(device)
    else:
        torch.manual_seed(seed)
        model = timm.create_model(name, **model_kwargs).to(device)
    config = setting.config()
    return model if config is None else patch(model, config)


def make_step(model: torch.nn.Module, x: torch.Tensor, mode: str, dtype: torch.dtype,
              compiled: bool = False) -> Callable[[], None]:
    """One inference forward, or one training step (forward, backward, optimizer step; the
    loss is cross-entropy against fixed random labels over the model's outputs)."""
    device_type = x.device.type
    autocast = functools.partial(torch.autocast, device_type, dtype=dtype, enabled=dtype != torch.float32)
    runner = torch.compile(model) if compiled else model
    if mode == "infer":
        model.eval()

        def step() -> None:
            with torch.inference_mode(), autocast():
                runner(x)
        return step

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    labels: List[torch.Tensor] = []  # drawn at the first step, once the number of outputs is known

    def train_step() -> None:
        with autocast():
            out = main_tensor(runner(x))
            out = out.mean(dim=1) if out.dim() == 3 else out  # a backbone's tokens: their mean
            if not labels:
                drawn = torch.randint(0, out.shape[-1], (x.shape[0],), generator=torch.Generator().manual_seed(0))
                labels.append(drawn.to(x.device))
            loss = F.cross_entropy(out, labels[0])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return train_step


def time_interleaved(steps: Dict[str, Callable[[], None]], rounds: int, warmup: int,
                     sync: Callable[[], None], progress: bool = True) -> Dict[str, float]:
    """Median seconds per step of each setting, the settings taking turns in rotating order."""
    keys = list(steps)
    times: Dict[str, List[float]] = {key: [] for key in keys}
    with tqdm(total=(warmup + rounds) * len(keys), desc="bench", disable=not progress, file=sys.stderr) as bar:
        for round_ in range(warmup + rounds):
            shift = round_ % len(keys)
            for key in keys[shift:] + keys[:shift]:
                sync()
                start = time.perf_counter()
                steps[key]()
                sync()
                if round_ >= warmup:
                    times[key].append(time.perf_counter() - start)
                bar.update()
    return {key: statistics.median(values) for key, values in times.items()}


def merging_settings(model: torch.nn.Module, keep_rates: Sequence[float], size: Sequence[int],
                     class_only_last: Optional[bool] = None) -> List[Setting]:
    """Token merging (``measure.baseline``) at the analytic FLOPs of vitprune's defaults (with
    ``class_only_last``, ``None``: their own) at each keep rate below 1, so the two are timed
    at equal cost.

    Raises:
        TypeError: The model's FLOPs have no analytic count (the fit needs one).
    """
    settings = []
    for rate in keep_rates:
        if rate < 1:
            try:
                target = schedule_flops(model, Setting(DEFAULT, rate, class_only_last=class_only_last).config(),
                                        size) / 1e9
            except TypeError as error:
                raise TypeError(f"--baseline merge fits token merging to the analytic FLOPs, which refuse this "
                                f"model: {error}") from None
            settings.append(Setting(MERGING, rate, fitted=fit_merging(model, target, size)))
    return settings


def _cpu_step_builder(name: str, setting: Setting, model_kwargs: Dict[str, Any], batch: int, mode: str,
                      dtype_name: str, threads: Optional[int]) -> Callable[[], None]:
    """Runs in the memory child: the same model, input and step as the timed ones."""
    if threads:
        torch.set_num_threads(threads)
    model = build_model(name, setting, "cpu", **model_kwargs).to(WEIGHTS.get(dtype_name, torch.float32))
    x = torch.randn(batch, 3, *input_size(model, model_kwargs.get("img_size")), dtype=WEIGHTS.get(dtype_name))
    return make_step(model, x, mode, DTYPES[dtype_name])


def run(args: argparse.Namespace) -> List[Row]:
    """Build, time and measure every setting; rows in the order of :func:`settings_grid`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    model_kwargs = {"pretrained": args.pretrained}
    if args.img_size:
        model_kwargs["img_size"] = args.img_size
    stages = [None] if args.stages is None else list(args.stages)
    forced = CLASS_ONLY[args.class_only_last]
    grid = settings_grid(args.indicators, args.keep_rates, stages, [None, *args.overlap_strides], forced)

    base = build_model(args.model, Setting(), args.device, **model_kwargs)
    check_model(base)  # before anything reads a ViT's attributes: a clear refusal for a ResNet
    weights = WEIGHTS.get(args.dtype)
    if weights is not None:  # cast before patching: every setting is a copy of these weights
        base = base.to(weights)
    size = input_size(base, args.img_size)
    if getattr(args, "baseline", None) == "merge":
        grid += merging_settings(base, args.keep_rates, size, forced)
    x = torch.randn(args.batch, 3, *size, device=device, dtype=weights)
    models = {s.label: (base if s.indicator is None else patch(copy.deepcopy(base), s.config())) for s in grid}
    compiled = {label: args.compile == "all" for label in models}
    steps = {label: make_step(model, x, args.mode, dtype, compiled[label]) for label, model in models.items()}
    measured = len(grid)
    if args.compile == "both":  # each setting eager and compiled, all timed against eager unpruned
        for setting in list(grid):
            label = f"{setting.label}, compiled"
            grid.append(setting)
            models[label], compiled[label] = models[setting.label], True
            steps[label] = make_step(copy.deepcopy(models[setting.label]), x, args.mode, dtype, True)
    sync = device_sync(device)
    seconds = time_interleaved(steps, args.rounds, args.warmup, sync, progress=not args.no_progress)
    # counted after the timing: fvcore's trace leaves the process slower for the pruned models
    # (about 2 % of a batch-1 CPU forward, measured), which would charge them for the count
    counted = {id(model): count_flops(model, size) for model in models.values()}  # a compiled row shares its model
    flops = {label: counted[id(model)] for label, model in models.items()}

    labels = list(models)  # one per timed step, parallel to grid
    peaks: Dict[str, Optional[float]] = {label: None for label in models}
    if not args.no_memory:
        for setting in grid[:measured]:  # eager models only
            if device.type == "cuda":
                peak = cuda_peak_bytes(steps[setting.label], device)
            else:
                peak = cpu_peak_bytes(functools.partial(
                    _cpu_step_builder, args.model, setting, model_kwargs, args.batch, args.mode,
                    args.dtype, args.threads))
            peaks[setting.label] = peak / 2**20

    base_s, base_f = seconds["unpruned"], flops["unpruned"]
    rows = []
    for label, setting in zip(labels, grid):
        speedup, ideal = base_s / seconds[label], base_f / flops[label]
        rows.append(Row(
            model=args.model, setting=label, indicator=setting.indicator, keep_rate=setting.keep_rate,
            stages=setting.stages if setting.stages is None or isinstance(setting.stages, str) else list(setting.stages),
            overlap_stride=setting.overlap_stride,
            gflops=flops[label] / 1e9, images_per_s=args.batch / seconds[label], speedup=speedup,
            ideal_speedup=ideal, achieved_over_ideal=speedup / ideal, peak_memory_mb=peaks[label],
            mode=args.mode, device=str(device), dtype=args.dtype, batch=args.batch, img_size=list(size),
            threads=torch.get_num_threads(), compiled=compiled[label], rounds=args.rounds,
            class_only_last=get_config(models[label]).class_only_last if is_patched(models[label]) else None,
        ))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width table of the rows, with a heading line describing the run."""
    first = rows[0]
    lines = [
        f"{first.model}, {first.mode}, {first.device} {first.dtype}, batch {first.batch}, "
        f"{first.img_size[0]}x{first.img_size[1]}, {first.threads} threads"
        f"{', compiled' if all(r.compiled for r in rows) else ''}, median of {first.rounds} interleaved rounds",
        f"{'setting':<28}{'GFLOPs':>8}{'img/s':>10}{'speedup':>9}{'ideal':>8}{'ach/ideal':>11}{'peak MiB':>10}",
    ]
    for r in rows:
        memory = "-" if r.peak_memory_mb is None else f"{r.peak_memory_mb:.0f}"
        lines.append(f"{r.setting:<28}{r.gflops:>8.3f}{r.images_per_s:>10.1f}{r.speedup:>8.3f}x"
                     f"{r.ideal_speedup:>7.2f}x{r.achieved_over_ideal:>10.1%}{memory:>10}")
    return "\n".join(lines)


def write_rows(rows: Sequence[Row], path: str) -> None:
    """JSON (a list of objects) or CSV, by the file's extension."""
    records = [asdict(r) for r in rows]
    with open(path, "w", newline="") as out:
        if path.endswith(".csv"):
            writer = csv.DictWriter(out, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in records)
        else:
            json.dump(records, out, indent=2)
            out.write("\n")


def validate(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the options, or ``None``; checked before anything is built."""
    if is_transformers_name(args.model):
        if args.img_size:
            return f"--img-size does not apply to {args.model}: a transformers model runs at its config's image size"
    elif args.model not in timm.list_models() and not timm.is_model(args.model):
        return f"unknown timm model {args.model!r}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available"
    if args.out and not args.out.endswith((".json", ".csv")):
        return f"--out must end in .json or .csv, got {args.out!r}"
    if args.warmup < 0:
        return f"--warmup must be >= 0, got {args.warmup}"
    if args.dtype in WEIGHTS and args.mode != "infer":
        return (f"--dtype {args.dtype} times inference only (--mode infer): training needs float32 "
                f"weights; for mixed precision use --dtype bf16 (autocast)")
    try:
        for combination in itertools.product(args.indicators, args.keep_rates, args.stages or [None],
                                             [None, *args.overlap_strides]):
            Setting(*combination, class_only_last=CLASS_ONLY[args.class_only_last]).config()
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def main(args: argparse.Namespace) -> int:
    problem = validate(args)
    if problem is not None:
        print(f"vitprune bench: error: {problem}", file=sys.stderr)
        return 2
    try:
        rows = run(args)
    except (ImportError, TypeError, ValueError) as error:  # e.g. a model vitprune cannot patch, a stage out of range
        print(f"vitprune bench: error: {error}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if args.out:
        write_rows(rows, args.out)
        print(f"wrote {args.out}")
    return 0
