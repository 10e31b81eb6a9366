"""Experiment (e): accuracy at equal FLOPs against token merging, off the shelf.

    python examples/experiment_merging.py --checkpoints runs/*_seed*.pt --grid full --limit 2000 \\
        --budgets 0.8 0.7 0.6 --name merging_grid
    python examples/experiment_merging.py --checkpoints runs/*_seed*.pt --grid final --limit 5000 \\
        --name merging
    python examples/experiment_merging.py --checkpoints runs/*_seed*.pt --finetune --budgets 0.7 \\
        --name merging_finetuned
    python examples/experiment_merging.py --report docs/results/merging.json --name merging

Every method is fitted to each budget (a fraction of the unpruned model's analytic FLOPs)
with vitprune's own fits: ``fit_keep_rate`` for the pruning configurations (exact to one
token) and ``fit_merging`` for the token-merging baseline (``r + 1`` tokens in the first
``j`` blocks, ``r`` in the rest). All run through the same blocks and the same FLOP counter.

``--grid full`` crosses indicator (var, cls) x selection (top, redundant) x reduction
(merge, fuse, drop) x schedule (the paper's 3 stages, every block) x size-aware attention
(on, off), plus random selection and the baseline; ``--grid final`` runs the methods the
README compares; ``--finetune`` fine-tunes the default, the baseline and the paper's method
(and the unpruned model) for 100 steps each before evaluating. ``--report`` writes a
markdown table and a plot, named after ``--name``, into ``--docs`` from results JSON (every
run counted once, however many files hold it); where token merging ran, a second table gives
each method minus merging run for run (the same model, repeat and budget).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from tqdm.auto import tqdm

import vitprune
from vitprune.measure.baseline import fit_merging
from vitprune.data.datasets import load
from vitprune.data.shipped import load_checkpoint
from vitprune.data.accuracy import accuracy
from vitprune.measure.flops import schedule_flops
from experiments_common import every_stages, merge_results
from reporting import markdown_table, mean_std, paired, percent, summarise, unique_runs

BASELINE = "token merging (baseline)"
DEFAULT = "vitprune defaults (bipartite, merge, spread, size-aware)"  # docs/method.md §9
#: The methods the README compares: name -> patch options.
FINAL: Dict[str, Dict[str, Any]] = {
    DEFAULT: {},
    "bipartite, merge, 3 stages, size-aware": dict(selection="bipartite", stages=None),
    "var, top, merge, spread, size-aware": dict(indicator="var", selection="top"),
    "var, redundant, merge, spread, size-aware": dict(indicator="var", selection="redundant"),
    "var, top, merge, 3 stages, size-aware": dict(indicator="var", selection="top", stages=None),
    "paper (var, top, fuse, 3 stages)": dict(indicator="var", selection="top", reduction="fuse",
                                             size_aware=False, stages=None),
    "EViT (cls, top, fuse, 3 stages)": dict(indicator="cls", selection="top", reduction="fuse",
                                            size_aware=False, stages=None),
}
#: The defaults' method with the FLOP fit made per block: stages="all" at one common rate is the
#: schedule "spread" resolves to, but fitted on that rate directly, so the budget is met to one
#: token (spread's keep rate steps with the paper's rounded token counts). Not in ``--grid final``.
ALL_FIT = "defaults' method, fitted per block (stages='all')"
#: The defaults' method in every S-th block only (``every_stages``: counted back from the
#: last block, ``S - 1, 2 S - 1, ...`` where S divides the depth), fitted to the budget: the
#: same FLOPs in fewer, larger steps, which a batch-1 CPU forward pays less for
#: (examples/step_cost.py). Not in ``--grid final``.
EVERY = {2: "defaults' method, every 2nd block", 3: "defaults' method, every 3rd block"}
#: The same with the class token alone in the last block, which is then no stage (a stage there
#: gives the same logits at more FLOPs): the latency recipe of README. Not in ``--grid final``.
EVERY_CLASS_ONLY = {s: f"{name}, class token alone in the last block" for s, name in EVERY.items()}
#: The defaults fitted to the FLOPs that token merging's fit reaches at the same budget instead of
#: to the budget itself: the two fits step in different token counts, so at one budget either may
#: spend up to about a point more of the FLOPs than the other; held to merging's FLOPs the
#: defaults never spend more. Not in ``--grid final``.
AT_MERGING = "vitprune defaults, held to token merging's FLOPs"
#: AT_MERGING with crowding (``patch(crowding=w)``, merging.crowding_scores) in the matching:
#: the same tokens in every block, so the same FLOPs. Not in ``--grid final``.
CROWDING = {w: f"vitprune defaults with crowding {w}, held to token merging's FLOPs" for w in (0.25, 0.5)}
#: The class token alone in the last block (``class_only_last``): the same logits for most of that
#: block's FLOPs, spent on keeping more tokens elsewhere. With the defaults, fitted to the budget and
#: held to token merging's FLOPs; and token merging given the same saving, fitted to the budget, to
#: show what the saving alone buys. Not in ``--grid final``.
CLASS_ONLY = "vitprune defaults, class token alone in the last block"
CLASS_ONLY_AT_MERGING = "vitprune defaults, class token alone in the last block, held to token merging's FLOPs"
MERGING_CLASS_ONLY = "token merging, class token alone in the last block"
EXTRA: Dict[str, Dict[str, Any]] = {ALL_FIT: dict(stages="all"),
                                   CLASS_ONLY: dict(class_only_last=True),
                                   CLASS_ONLY_AT_MERGING: dict(at_merging=True, class_only_last=True),
                                   MERGING_CLASS_ONLY: dict(merging=True, class_only_last=True),
                                   **{name: dict(every=s) for s, name in EVERY.items()},
                                   **{name: dict(every=s, class_only_last=True) for s, name in EVERY_CLASS_ONLY.items()},
                                   AT_MERGING: dict(at_merging=True),
                                   **{name: dict(at_merging=True, crowding=w) for w, name in CROWDING.items()}}


#: What every method of this harness runs with unless it names the option: the whole last block
#: (``class_only_last=False``), as every method did when these experiments were first run, so
#: ``DEFAULT`` and the methods above are the same configurations as in docs/results/*.json and
#: only the ``CLASS_ONLY*`` methods have the class token alone in the last block (what
#: ``patch`` now does by default on the shipped models).
PINNED: Dict[str, Any] = dict(class_only_last=False)


def grid() -> Iterator[Tuple[str, Dict[str, Any]]]:
    for indicator, selection, reduction, stages, size_aware in itertools.product(
            ("var", "cls"), ("top", "redundant"), ("merge", "fuse", "drop"), (None, "all"), (True, False)):
        options = dict(indicator=indicator, selection=selection, reduction=reduction, stages=stages,
                       size_aware=size_aware)
        yield describe(options), options
    for selection, stages in itertools.product(("top", "redundant"), (None, "all")):
        options = dict(indicator="random", selection=selection, reduction="merge", stages=stages, size_aware=True)
        yield describe(options), options


def describe(options: Dict[str, Any]) -> str:
    stages = "every block" if options.get("stages") == "all" else "3 stages"
    size = "size-aware" if options.get("size_aware") else "plain"
    return f"{options['indicator']}, {options['selection']}, {options['reduction']}, {stages}, {size}"


def fitted(model: torch.nn.Module, options: Dict[str, Any], budget: float, seed: int) -> torch.nn.Module:
    """A patched copy of ``model`` whose analytic FLOPs fit ``budget`` (a fraction of unpruned)."""
    target = budget * schedule_flops(model, None) / 1e9
    if options is not None:  # every method runs the whole last block unless it says otherwise (see PINNED)
        options = {**PINNED, **options}
    if options is None:
        return vitprune.patch(copy.deepcopy(model), fit_merging(model, target))
    if options.get("merging"):
        return vitprune.patch(copy.deepcopy(model), fit_merging(model, target, class_only_last=True))
    if options.get("at_merging"):
        target = schedule_flops(model, fit_merging(model, target)) / 1e9
        options = {k: v for k, v in options.items() if k != "at_merging"}
    if "every" in options:
        step = options["every"]
        options = {**{k: v for k, v in options.items() if k != "every"},
                   "stages": every_stages(len(model.blocks), step, options["class_only_last"])}
    fit_options = {k: v for k, v in options.items() if k != "indicator"}
    rate = vitprune.fit_keep_rate(model, target, **fit_options)
    extra = {"seed": seed} if options.get("indicator") == "random" else {}
    return vitprune.patch(copy.deepcopy(model), keep_rate=rate, **options, **extra)


#: Fine-tuned (``--finetune``): the default, the baseline and the paper, as experiment (b) does it.
FINETUNED = (DEFAULT, BASELINE, "paper (var, top, fuse, 3 stages)")
STEPS, LR, WARMUP = 100, 2e-4, 10


def tune(model: torch.nn.Module, record: Dict[str, Any], train_set: Tuple[torch.Tensor, torch.Tensor],
         repeat: int = 0, desc: str = "fine-tune") -> None:
    """STEPS steps of train_small_vit.py's recipe on ``model`` (patched or not), with the batch
    order and shifts of seed ``1000 (repeat + 1)`` plus the model's seed (repeat 0 draws those
    of the runs before ``--repeats`` existed)."""
    from train_small_vit import train  # examples/ is on sys.path when this script runs

    images, labels = train_set
    train(model, images, labels, record["dataset"], steps=STEPS, batch=128, lr=LR, warmup=WARMUP,
          seed=1000 * (repeat + 1) + record["seed"], desc=desc)


def finetune(args: argparse.Namespace) -> None:
    """Each method fitted to each budget, fine-tuned for STEPS steps with it active (the
    training recipe of train_small_vit.py), then evaluated; the unpruned model likewise."""
    models = [load_checkpoint(Path(p)) for p in args.checkpoints]
    data = {d: (load(d, "train"), load(d, "test")) for d in {record["dataset"] for _, record in models}}
    options = {**FINAL, **EXTRA, BASELINE: None}
    names = [None] + [(b, name) for b in args.budgets for name in (args.methods or FINETUNED)]
    jobs = [(m, r, repeat, job) for m, r in models for repeat in range(args.repeats) for job in names]
    rows = []
    for model, record, repeat, job in tqdm(jobs, desc="fine-tune", file=sys.stderr):
        budget, name = (1.0, None) if job is None else job
        tuned = copy.deepcopy(model) if name is None else fitted(model, options[name], budget, record["seed"])
        train_set, (test_images, test_labels) = data[record["dataset"]]
        tune(tuned, record, train_set, repeat, desc=f"{name or 'unpruned'} {budget}")
        acc = accuracy(tuned, test_images[:args.limit], test_labels[:args.limit])
        rows.append({**row(record, name or "unpruned", budget, tuned, acc), "finetuned": STEPS, "repeat": repeat})
    write_rows(args, rows)


def write_rows(args: argparse.Namespace, rows: List[Dict[str, Any]]) -> None:
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    out = Path(args.docs) / "results" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print(f"wrote {out}")


def run(args: argparse.Namespace) -> None:
    models = [load_checkpoint(Path(p)) for p in args.checkpoints]
    test = {d: load(d, "test") for d in {record["dataset"] for _, record in models}}
    test = {d: (images[:args.limit], labels[:args.limit]) for d, (images, labels) in test.items()}
    methods = list(grid()) if args.grid == "full" else list(FINAL.items())
    methods.append((BASELINE, None))
    if args.methods:
        named = {**dict(methods), **EXTRA}
        methods = [(name, named[name]) for name in args.methods]
    plan = [(m, r, b, method) for m, r in models for b in args.budgets for method in methods]
    rows: List[Dict[str, Any]] = []
    for model, record in models:
        images, labels = test[record["dataset"]]
        rows.append(row(record, "unpruned", 1.0, model, accuracy(model, images, labels)))
    for model, record, budget, (name, options) in tqdm(plan, desc="methods", file=sys.stderr):
        patched = fitted(model, options, budget, record["seed"])
        images, labels = test[record["dataset"]]
        rows.append(row(record, name, budget, patched, accuracy(patched, images, labels)))
    write_rows(args, rows)


def row(record: Dict[str, Any], method: str, budget: float, model: torch.nn.Module, acc: float) -> Dict[str, Any]:
    gflops = vitprune.analytic_flops(model) / 1e9
    config = vitprune.get_config(model) if vitprune.is_patched(model) else None
    return {"dataset": record["dataset"], "seed": record["seed"], "steps": record.get("steps"), "method": method,
            "budget": budget,
            "gflops": gflops, "flops_share": gflops / (schedule_flops(model, None) / 1e9),
            "keep_rate": None if config is None else list(config.keep_rate), "accuracy": acc}


#: What makes one run: rows equal in these are the same run recorded twice (``unique_runs``).
RUN = ("dataset", "seed", "steps", "finetuned", "repeat", "method", "budget")


def difference(cell: Optional[Dict[str, Any]]) -> str:
    """``-0.22 ± 0.26 (3 of 9)``: a :func:`reporting.paired` group in points."""
    if cell is None:
        return "-"
    return f"{100 * cell['mean']:+.2f} ± {100 * cell['std']:.2f} ({cell['ahead']} of {cell['n']})"


def report(paths: List[str], docs: Path, out_name: str, note: str = "") -> None:
    rows, commands = merge_results(paths)  # a merged file lists the commands of its runs
    rows = unique_runs(rows, RUN)
    summary = summarise(rows, ["dataset", "method", "budget"])
    differences = {(d["dataset"], d["method"], d["budget"]): d
                   for d in paired(rows, BASELINE, [k for k in RUN if k != "method"], ["dataset", "method", "budget"])}
    shares = summarise(rows, ["dataset", "method", "budget"], value="flops_share")
    share = {(s["dataset"], s["method"], s["budget"]): s["mean"] for s in shares}
    tuned = any(row.get("finetuned") for row in rows)
    title = f"fine-tuned {STEPS} steps" if tuned else "off the shelf"
    parts = [f"# Accuracy at equal FLOPs against token merging, {title}\n",
             "Commands:\n\n" + "\n".join(f"    {c}" for c in commands) + "\n",
             "Top-1 accuracy (%), mean ± standard deviation over the trained seeds (n per cell), "
             "each method fitted to the budget (share of the unpruned model's analytic FLOPs; the "
             "share each reaches is at most the budget, in brackets where it is lower by more than "
             "1 point).\n"] + ([note + "\n"] if note else [])
    for dataset in dict.fromkeys(s["dataset"] for s in summary):
        cells = [s for s in summary if s["dataset"] == dataset]
        base = next(s for s in cells if s["method"] == "unpruned")
        budgets = sorted({s["budget"] for s in cells if s["method"] != "unpruned"}, reverse=True)
        names = list(dict.fromkeys(s["method"] for s in cells if s["method"] != "unpruned"))
        means = {(s["method"], s["budget"]): s for s in cells}
        names.sort(key=lambda m: -mean_std([means[(m, b)]["mean"] for b in budgets if (m, b) in means])[0])
        table = []
        for name in names:
            line = [name]
            for b in budgets:
                s = means.get((name, b))
                if s is None:
                    line.append("-")
                    continue
                reached = share[(dataset, name, b)]
                note = f" ({100 * reached:.0f} %)" if b - reached > 0.01 else ""
                line.append(percent(s["mean"], s["std"], s["n"]) + note)
            table.append(line)
        header = ["method"] + [f"{100 * b:.0f} % FLOPs" for b in budgets]
        parts.append(f"## {dataset}\n\nUnpruned: {percent(base['mean'], base['std'], base['n'])}, "
                     f"n = {base['n']}.\n\n" + markdown_table(header, table) + "\n")
        against = [[name] + [difference(differences.get((dataset, name, b))) for b in budgets]
                   for name in names if name != BASELINE]
        if any(cell != "-" for line in against for cell in line[1:]):
            parts.append("Minus token merging, run for run (the same model, repeat and budget): mean ± "
                         "standard deviation of the differences in points, and in how many runs the "
                         "method is ahead.\n\n" + markdown_table(header, against) + "\n")
    (docs / f"{out_name}.md").write_text("\n".join(parts))
    plot(summary, share, docs / f"{out_name}.png", title)
    print(f"wrote {docs / out_name}.md and .png")


def plot(summary: List[Dict[str, Any]], share: Dict[tuple, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(s["dataset"] for s in summary))
    figure, axes = plt.subplots(1, len(sets), figsize=(6.5 * len(sets), 4.5), squeeze=False)
    for axis, dataset in zip(axes[0], sets):
        cells = [s for s in summary if s["dataset"] == dataset]
        base = next(s for s in cells if s["method"] == "unpruned")
        for name in dict.fromkeys(s["method"] for s in cells if s["method"] != "unpruned"):
            line = sorted((s for s in cells if s["method"] == name), key=lambda s: s["budget"])
            axis.errorbar([100 * share[(dataset, name, s["budget"])] for s in line], [100 * s["mean"] for s in line],
                          yerr=[100 * s["std"] for s in line], marker="o", capsize=3, label=name,
                          linewidth=2.5 if name in (BASELINE, DEFAULT) else 1.2)
        axis.axhline(100 * base["mean"], color="black", linestyle="--", linewidth=1, label="unpruned")
        axis.set_xlabel("analytic FLOPs (% of unpruned)")
        axis.set_ylabel("top-1 accuracy (%)")
        axis.set_title(f"{dataset}, {title}")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", help="from examples/train_small_vit.py")
    parser.add_argument("--grid", choices=("full", "final"), default="final")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.8, 0.7, 0.6, 0.5, 0.4])
    parser.add_argument("--limit", type=int, default=5000, help="the first LIMIT test images")
    parser.add_argument("--name", default="merging", help="results file name (docs/results/NAME.json)")
    parser.add_argument("--docs", default="docs")
    parser.add_argument("--finetune", action="store_true",
                        help=f"fine-tune {STEPS} steps with each of {FINETUNED} active, then evaluate")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --finetune: fine-tune each model this many times, each with its own "
                             "batch order and shifts (seed 1000 r + the model's seed)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="only these methods (names as in the tables; also "
                             f"{', '.join(map(repr, EXTRA))})")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="write the table and plot from these")
    parser.add_argument("--note", default="", help="a paragraph for the report (with --report)")
    args = parser.parse_args()
    if args.report:
        report(args.report, Path(args.docs), args.name, args.note)
    elif args.checkpoints:
        (finetune if args.finetune else run)(args)
    else:
        parser.error("give --checkpoints (to run) or --report (to summarise)")


if __name__ == "__main__":
    main()
