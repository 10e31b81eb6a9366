"""The ``vitprune`` command line: every subcommand's options, with their defaults and help.

Light on purpose: it imports neither torch nor timm, so ``vitprune --help`` answers at
once; a subcommand's module (and torch) is imported only when it runs.
"""

from __future__ import annotations

import argparse
from typing import Tuple, Union

from ..core.config import ALL_BLOCKS, DEFAULT_METHOD, INDICATORS, PAPER_STAGES, SPREAD_STEPS
from ..data import DATASETS
from ..pictures import SHOW

#: ``bench``/``eval`` setting name for vitprune's defaults (rather than the paper's method).
DEFAULT = DEFAULT_METHOD
#: What ``bench`` times.
MODES = ("infer", "train")
#: ``bench --dtype`` choices.
DTYPE_NAMES = ("fp32", "bf16", "bf16-weights")
#: ``demo``'s keep rates.
DEMO_KEEP_RATES = (0.9, 0.7, 0.5, 0.3)
#: Timed rounds (``bench``, ``demo``) or batches (``eval``) behind a reported median speedup:
#: on a noisy machine fewer give medians that move by more than the differences measured.
STEADY_ROUNDS = 11


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default in its help: once (an option whose
    help already says its default in words keeps those words), and only where there is one
    (no "default: None" after a required option or one whose absence means "not given")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or action.required or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action) or text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def stage_list(text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"stages are comma-separated block indices like 3,6,9, got {text!r}") from None


def named_stages(text: str) -> Union[str, Tuple[int, ...]]:
    """``spread``, ``spread2``, ``spread3``, ``all``, ``paper`` (the paper's three stages,
    scaled to the depth; kept as the name) or block indices ``3,6,9``."""
    names = (*SPREAD_STEPS, ALL_BLOCKS, PAPER_STAGES)
    if text in names:
        return text
    try:
        return stage_list(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"a schedule is one of {', '.join(names)} or comma-separated block "
                                         f"indices like 3,6,9, got {text!r}") from None


#: ``--class-only-last`` values -> ``class_only_last`` for every method (``None``: each its own).
CLASS_ONLY = {"auto": None, "on": True, "off": False}


def add_class_only(group: "argparse._ActionsContainer", spent: str) -> None:
    """``--class-only-last [auto|on|off]`` (the flag alone: ``on``), parsed to ``None``/``True``/``False``."""
    group.add_argument("--class-only-last", nargs="?", const="on", default="auto", choices=tuple(CLASS_ONLY),
                       help="the class token alone through the last block (token-pooled timm ViTs; transformers' "
                            "ViT and DeiT classifiers): 'auto' "
                            "(default) each method's own (the defaults: on where exact; the paper's method and "
                            f"token merging: off); 'on' or 'off' for every method but token merging; the {spent}")


def _subparser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str, help: str, description: str
               ) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help, description=description, formatter_class=HelpFormatter)
    parser.set_defaults(command=name)
    return parser


def add_demo(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    parser = _subparser(subparsers, "demo", "prune the shipped models on shipped real data", """\
Prune the small ViTs that ship with vitprune on their shipped real test images. For each
dataset: accuracy, GFLOPs and measured speedup of the unpruned model, of vitprune's
defaults (merging, size-aware attention) and of the paper's method (one fusion token) at
several keep rates, then a plot of accuracy against GFLOPs and against the measured
speedup. No download needed.""")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS), help="which shipped models")
    parser.add_argument("--indicators", nargs="+", default=["var", "medad"], choices=INDICATORS,
                        help="the paper's method with these indicators, beside the defaults")
    parser.add_argument("--keep-rates", nargs="+", type=float, default=list(DEMO_KEEP_RATES), help="keep rates to run")
    parser.add_argument("--rounds", type=int, default=STEADY_ROUNDS, help="timed rounds for the speedup (median)")
    parser.add_argument("--out", default="demo.png", help="where to write the plot (PNG)")
    return parser


def add_bench(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    parser = _subparser(subparsers, "bench", "FLOPs, throughput and memory: pruned vs unpruned", """\
FLOPs, throughput and peak memory of pruned against unpruned, in one run. Every setting
gets its own copy of the same model; after a warm-up the settings take turns (the order
rotating each round) and the median time per step is reported, so machine noise hits all
settings alike. Speed is a ratio to the unpruned model measured in the same run, next to
the ideal ratio from the FLOP counts.""")
    parser.add_argument("--model", default="deit_small_patch16_224",
                        help="a timm model name, or hf:ID_OR_FOLDER for a transformers one")
    parser.add_argument("--pretrained", action="store_true", help="load its pretrained weights (must be cached)")
    parser.add_argument("--indicators", nargs="+", default=[DEFAULT, "var"], choices=(DEFAULT, *INDICATORS),
                        help="'default': vitprune's defaults (what patch(model, keep_rate=...) does); an "
                             "indicator: the paper's method with it")
    parser.add_argument("--keep-rates", nargs="+", type=float, default=[1.0, 0.7], help="keep rates to run")
    parser.add_argument("--stages", nargs="+", type=named_stages, default=None,
                        help="one or more schedules: spread, spread2, spread3, all, paper (the paper's "
                             "three stages, scaled to the depth) or stage lists like 3,6,9 2,5,8 (default: "
                             "each setting's own: spread for 'default', paper for an indicator)")
    parser.add_argument("--overlap-strides", nargs="+", type=positive_int, default=[],
                        help="also run every setting with these patch-embedding strides")
    parser.add_argument("--baseline", choices=("merge",), default=None,
                        help="also token merging (ToMe's method) at the FLOPs of the defaults at each keep rate")
    add_class_only(parser, "FLOP and speedup columns count its saving")
    parser.add_argument("--batch", type=positive_int, default=32, help="images per step")
    parser.add_argument("--img-size", type=positive_int, default=None, help="square input size (default: the model's)")
    parser.add_argument("--mode", choices=MODES, default="infer",
                        help="infer: forward only; train: forward + backward + optimizer step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32",
                        help="bf16 runs under autocast (which casts the weights again at every step); "
                             "bf16-weights casts the weights and images to bfloat16 (inference only: "
                             "the fast path of CPUs with bfloat16 matrix units)")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--compile", nargs="?", const="all", choices=("all", "both"), default=None,
                        help="torch.compile every model ('all', the default when given), or time every "
                             "setting eager and compiled ('both'), all against the eager unpruned model")
    parser.add_argument("--rounds", type=positive_int, default=STEADY_ROUNDS,
                        help="timed rounds; the median is reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", default=None, help="also write the rows to this .json or .csv file")
    return parser


def add_show(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    parser = _subparser(subparsers, "show", "draw the patches a pruned model keeps in an image", """\
Draw which patches a pruned model keeps in one image: the image, then one panel per
stage with the pruned patches dimmed. Without --pretrained or --checkpoint the model has
random weights, and what it keeps says nothing about the image.""")
    parser.add_argument("image", help="an image file (PNG, JPEG, ...)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="deit_small_patch16_224",
                        help="a timm model name, or hf:ID_OR_FOLDER for a transformers one")
    source.add_argument("--checkpoint", default=None, help="a checkpoint of vitprune's own small ViTs")
    parser.add_argument("--pretrained", action="store_true", help="load its pretrained weights (must be cached)")
    parser.add_argument("--indicator", choices=(DEFAULT, *INDICATORS), default="var",
                        help="'default': vitprune's defaults (merging in every block); an indicator: the "
                             "paper's method with it (what scores the patches)")
    parser.add_argument("--keep-rate", type=float, default=0.7, help="fraction of patches each stage keeps")
    parser.add_argument("--stages", type=named_stages, default=None,
                        help="a schedule: spread, spread2, spread3, all, paper or block indices like 3,6,9 "
                             "(default: the method's own: spread for 'default', paper for an indicator)")
    parser.add_argument("--overlap-stride", type=int, default=None, help="patch-embedding stride (overlap)")
    parser.add_argument("--view", choices=SHOW, default="kept",
                        help="kept: pruned patches dimmed; groups: the patches each token holds, in their "
                             "mean colour (what merging made)")
    parser.add_argument("--out", default="kept.png", help="where to write the PNG")
    return parser


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_eval(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    parser = _subparser(subparsers, "eval", "accuracy, FLOPs and speed of patch settings on your images", """\
Accuracy (top-1, top-5), GFLOPs and measured speed of a timm model (or a transformers
image classifier, --model hf:ID_OR_FOLDER), unpruned and under every setting asked for, on
an image-folder tree (one folder per class) or anything timm.data.create_dataset reads.
Preprocessing is the model's own: timm's pretrained config, or the transformers image
processor's resize, crop and normalisation run by timm's transforms. Every image is read
once and goes through every setting; speed is measured in the same run, the settings
taking turns on each batch (speedup: the median over the batches of each batch's time
ratio to the unpruned model's; give 11 batches or more for a steady median).

Example (ImageNet validation, a user's own copy):
  vitprune eval --model deit_small_patch16_224 --pretrained --data-dir /data/imagenet/val \\
      --budgets 0.8 0.7 0.6 --indicators default var --baseline merge --out r.json --plot r.png""")
    source = parser.add_argument_group("model (one of)")
    source.add_argument("--model", default=None,
                        help="a timm model name, or hf:ID_OR_FOLDER for a transformers image classifier")
    source.add_argument("--checkpoint", default=None,
                        help="weights: a timm checkpoint for --model, or one of vitprune's own small models")
    source.add_argument("--pretrained", action="store_true", help="pretrained weights for --model")
    data = parser.add_argument_group("data")
    data.add_argument("--data-dir", required=True, help="an image-folder tree (one folder per class)")
    data.add_argument("--split", default="validation", help="sub-folder to use if it exists (timm's search)")
    data.add_argument("--img-size", type=positive_int, default=None, help="square input size (default: the model's)")
    data.add_argument("--batch-size", type=positive_int, default=64, help="images per batch")
    data.add_argument("--workers", type=int, default=0, help="data-loading worker processes")
    data.add_argument("--limit", type=positive_int, default=None,
                      help="evaluate N images, evenly spread over the data (default: all)")
    sweep = parser.add_argument_group("settings (every combination, plus the unpruned model)")
    sweep.add_argument("--indicators", nargs="+", default=[DEFAULT], choices=(DEFAULT, *INDICATORS),
                       help="'default': vitprune's defaults; an indicator: the paper's method with it")
    sweep.add_argument("--keep-rates", nargs="*", type=fraction, default=None,
                       help="keep rates (default: 0.7 when no --budgets)")
    sweep.add_argument("--budgets", nargs="*", type=fraction, default=[],
                       help="shares of the unpruned FLOPs; a keep rate is fitted to each")
    sweep.add_argument("--stages", nargs="+", type=named_stages, default=None,
                       help="schedules: spread, spread2, spread3, all, paper or block indices like 3,6,9 (default: each method's)")
    sweep.add_argument("--reductions", nargs="+", choices=("merge", "fuse", "drop"), default=None,
                       help="where removed tokens go (default: each method's)")
    sweep.add_argument("--baseline", choices=("merge",), default=None,
                       help="also token merging (ToMe's method) at the same FLOPs")
    add_class_only(sweep, "budget fits spend its saving")
    run = parser.add_argument_group("run")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run")
    run.add_argument("--amp", action="store_true", help="autocast: bfloat16 on CPU, float16 on CUDA")
    run.add_argument("--out", default=None, help="write the rows to this .json or .csv file")
    run.add_argument("--plot", default=None,
                     help="draw accuracy against GFLOPs and against the measured speedup to this .png")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


#: Every subcommand, in the order ``--help`` lists them.
COMMANDS = (add_demo, add_bench, add_show, add_eval)
