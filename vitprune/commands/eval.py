"""``vitprune eval``: what each setting costs and buys on the user's own model and images
(options in ``parsers.add_eval``)."""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import timm
import torch

from .. import __version__
from ..data.folders import batches, class_names, open_images
from ..data.hf_models import is_transformers_name, preprocessing_note
from ..data.models import load_model
from ..measure.evaluate import Row, build_settings, evaluate
from .parsers import CLASS_ONLY, STEADY_ROUNDS


def problem_with(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the options alone, or ``None`` (checked before anything loads)."""
    if args.model is None and args.checkpoint is None:
        return "name a model (--model NAME) or give one of vitprune's own checkpoints (--checkpoint PATH)"
    if args.pretrained and args.model is None:
        return "--pretrained needs --model"
    if args.out and not args.out.endswith((".json", ".csv")):
        return f"--out must end in .json or .csv, got {args.out!r}"
    if args.plot and not args.plot.lower().endswith(".png"):
        return f"--plot must be a .png file, got {args.plot!r}"
    if args.workers < 0:
        return f"--workers must be >= 0, got {args.workers}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available"
    if not Path(args.data_dir).is_dir():
        return f"no such data folder: {args.data_dir}"
    return None


def head_outputs(model: torch.nn.Module) -> Optional[int]:
    """How many classes the model scores (``None`` when it does not say).

    Raises:
        TypeError: A ``transformers`` model that is not an image classifier (no logits).
    """
    if hasattr(model, "num_classes"):
        return int(getattr(model, "num_classes"))
    config = getattr(model, "config", None)
    if config is None:
        return None
    if "ForImageClassification" not in type(model).__name__:
        raise TypeError(f"vitprune eval measures accuracy, so it needs an image classifier (a "
                        f"...ForImageClassification model); {type(model).__name__} returns no logits")
    return int(config.num_labels)


def format_table(rows: Sequence[Row], heading: str) -> str:
    lines = [heading, f"{'setting':<32}{'top-1':>8}{'top-5':>8}{'GFLOPs':>9}{'FLOPs':>8}{'img/s':>9}{'speedup':>9}"]
    for r in rows:
        lines.append(f"{r.setting:<32}{r.top1:>7.2f}%{r.top5:>7.2f}%{r.gflops:>9.3f}{r.flops_share:>7.1%}"
                     f"{r.images_per_s:>9.1f}{r.speedup:>8.2f}x")
    return "\n".join(lines)


def versions(model: Optional[str]) -> Dict[str, str]:
    """The versions the results depend on (``transformers`` too for an ``hf:`` model)."""
    found = {"vitprune": __version__, "torch": torch.__version__, "timm": timm.__version__}
    if is_transformers_name(model):
        import transformers

        found["transformers"] = transformers.__version__
    return found


def record(rows: Sequence[Row], args: argparse.Namespace, source: str) -> Dict[str, Any]:
    """The results with what produced them: the command, the versions, the model and data."""
    return {
        "command": " ".join(shlex.quote(a) for a in ["vitprune", *getattr(args, "argv", sys.argv[1:])]),
        "versions": versions(args.model),
        "model": args.model or args.checkpoint, "weights": source, "data_dir": args.data_dir,
        "device": args.device, "amp": args.amp, "rows": [r.as_dict() for r in rows],
    }


def write(result: Dict[str, Any], path: str) -> None:
    """JSON (the whole record) or CSV (one line per row, with the command and versions)."""
    with open(path, "w", newline="") as out:
        if path.endswith(".csv"):
            extra = {"command": result["command"], **{f"{k}_version": v for k, v in result["versions"].items()}}
            writer = csv.DictWriter(out, fieldnames=[*result["rows"][0], *extra])
            writer.writeheader()
            writer.writerows({**row, **extra} for row in result["rows"])
        else:
            json.dump(result, out, indent=1)
            out.write("\n")


def main(args: argparse.Namespace) -> int:
    def fail(problem: str) -> int:
        print(f"vitprune eval: error: {problem}", file=sys.stderr)
        return 2

    problem = problem_with(args)
    if problem:
        return fail(problem)
    keep_rates = args.keep_rates if args.keep_rates is not None else ([] if args.budgets else [0.7])
    try:
        if args.plot:
            from ..pictures import pyplot

            pyplot(files_only=True)
        model, config, source = load_model(args.model, args.checkpoint, args.pretrained, args.img_size)
        dataset = open_images(args.data_dir, args.split, config)
        classes = class_names(dataset)
        outputs = head_outputs(model)
        if classes and outputs and len(classes) > outputs:
            return fail(f"the data has {len(classes)} classes ({args.data_dir}) but the model's head has only "
                        f"{outputs} outputs")
        settings = build_settings(model, methods=args.indicators, keep_rates=keep_rates, budgets=args.budgets,
                                  stages=args.stages, reductions=args.reductions or [None],
                                  baseline=args.baseline == "merge", img_size=config["input_size"][-2:],
                                  class_only_last=CLASS_ONLY[args.class_only_last])
    except (FileNotFoundError, ImportError, ValueError, TypeError) as error:
        return fail(str(error))
    if source == "random weights":
        print(f"note: {args.model} has random weights (no --pretrained or --checkpoint): accuracy is chance level")
    note = preprocessing_note(config)
    if note:
        print(f"note: {note}")
    if classes and outputs and len(classes) < outputs:
        print(f"note: the data has {len(classes)} classes, the head {outputs} outputs; labels are the sorted "
              f"folder indices 0-{len(classes) - 1}, which mean something only if they are the head's classes")
    count = len(dataset) if args.limit is None else min(args.limit, len(dataset))
    from tqdm.auto import tqdm

    with tqdm(total=count, unit="img", desc=f"{len(settings)} settings", disable=args.no_progress) as bar:
        rows = evaluate(model, batches(dataset, args.batch_size, args.workers, args.limit), settings,
                        device=args.device, amp=args.amp, img_size=config["input_size"][-2:], progress=bar.update)
    timed = rows[0].batches
    heading = (f"{args.model or args.checkpoint} ({source}) on {rows[0].images} images of {args.data_dir}, "
               f"{args.device}{' autocast' if args.amp else ''}, batch {args.batch_size}; speedup: the median of "
               f"{timed} per-batch time ratios, measured in this run")
    print(format_table(rows, heading))
    if timed < STEADY_ROUNDS and len(rows) > 1:
        print(f"note: only {timed} batch{'es' if timed > 1 else ''} timed; for a steady speedup give "
              f"{STEADY_ROUNDS} or more (more images, or a smaller --batch-size)")
    result = record(rows, args, source)
    if args.out:
        write(result, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        from ..pictures.frontier import AXES, draw_frontiers

        figure, axes = pyplot(files_only=True).subplots(1, len(AXES), figsize=(6.5 * len(AXES), 4.5))
        draw_frontiers(result["rows"], f"{result['model']} on {rows[0].images} images", axes)
        figure.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0
