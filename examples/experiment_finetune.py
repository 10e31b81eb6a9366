"""Experiment (b): fine-tune with pruning active (the paper's protocol), then evaluate.

    python examples/experiment_finetune.py --checkpoints runs/*_seed*.pt

From each trained checkpoint: a short fine-tune (100 steps, peak learning rate 2e-4,
the training recipe of train_small_vit.py otherwise) with pruning active, for var,
medad, cls, random and lowvar at keep rates 0.7 and 0.5, and for the unpruned model
fine-tuned the same way (the fair baseline). Experiment (d) rides along: var and medad
with overlapping patches at the stride and keep rate ``vitprune.fit_overlap`` picks (for
the paper's method) at the unpruned model's FLOPs (matched FLOPs), fine-tuned the same way, and also scored
before fine-tuning. Test split (or its first ``--limit`` images). Writes docs/results/finetune.json and
docs/finetune.md. Every pruned setting is the paper's method (``experiments_common.paper_method``).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Optional

from torch import nn
from tqdm.auto import tqdm

import vitprune
from train_small_vit import train  # examples/ is on sys.path when this script runs
from vitprune.data import datasets
from vitprune.data.accuracy import accuracy
from experiments_common import experiment_inputs, merge_results, paper_method, save_results
from vitprune.measure.flops import analytic_flops
from reporting import markdown_table, percent, summarise

INDICATORS = ("var", "medad", "cls", "random", "lowvar")
KEEP_RATES = (0.7, 0.5)
OVERLAP_INDICATORS = ("var", "medad")
STEPS, LR, WARMUP = 100, 2e-4, 10


def settings(base):
    """(indicator, keep rate, overlap stride) for one trained model, unpruned first."""
    yield None, 1.0, None
    for rate in KEEP_RATES:
        for indicator in INDICATORS:
            yield indicator, rate, None
    for indicator in OVERLAP_INDICATORS:  # fitted for the paper's method, which runs with it
        option = vitprune.fit_overlap(base, **paper_method(indicator))
        yield indicator, option.keep_rate, option.stride


def main() -> None:
    if "--merge" in sys.argv:  # tables from earlier runs' JSON (e.g. one process per dataset)
        parser = argparse.ArgumentParser(description=__doc__)
        parser.add_argument("--merge", nargs="+", required=True, help="finetune.json files to combine")
        parser.add_argument("--docs", default="docs")
        args = parser.parse_args()
        rows, commands = merge_results(args.merge)
        command = save_results(args.docs, "finetune", rows, commands)
        return write_docs(Path(args.docs), rows, commands + [command])
    args, models, test = experiment_inputs(__doc__)
    rows = run(models, test)
    command = save_results(args.docs, "finetune", rows)
    write_docs(Path(args.docs), rows, [command])


def patched(base: nn.Module, indicator: str, rate: float, stride: Optional[int], seed: int) -> nn.Module:
    """A copy of ``base`` under the paper's method with ``indicator`` at ``rate`` (with overlapping
    patches at ``stride`` when given); the random indicator seeded with ``seed``."""
    return vitprune.patch(copy.deepcopy(base), keep_rate=rate, overlap_stride=stride,
                          **paper_method(indicator, seed))


def run(models, test):
    train_sets = {d: datasets.load(d, "train") for d in test}
    jobs = [(m, r, s) for m, r in models for s in settings(m)]
    rows = []
    for base, record, (indicator, rate, stride) in tqdm(jobs, desc="fine-tune", file=sys.stderr):
        model = copy.deepcopy(base) if indicator is None else patched(base, indicator, rate, stride, record["seed"])
        test_set = test[record["dataset"]]
        before = accuracy(model, *test_set) if stride is not None else None
        images, labels = train_sets[record["dataset"]]
        train(model, images, labels, record["dataset"], steps=STEPS, batch=128, lr=LR, warmup=WARMUP,
              seed=1000 + record["seed"], desc=f"{indicator or 'unpruned'} {rate} {stride or ''}")
        rows.append({"dataset": record["dataset"], "seed": record["seed"], "indicator": indicator or "unpruned",
                     "keep_rate": rate, "overlap_stride": stride, "gflops": analytic_flops(model) / 1e9,
                     "accuracy": accuracy(model, *test_set), "accuracy_before_finetune": before})
    return rows


def write_docs(docs: Path, rows, commands) -> None:
    plain = [r for r in rows if r["overlap_stride"] is None]
    summary = summarise(plain, ["dataset", "indicator", "keep_rate", "gflops"])
    parts = ["# Fine-tuned with pruning active\n\nCommand(s):\n\n" + "".join(f"    {c}\n" for c in commands),
             f"{STEPS} steps from each trained checkpoint (peak lr {LR}); top-1 accuracy (%) on the test "
             "split (its first `--limit` images where the command says so), mean ± standard deviation over "
             "the trained seeds.\n"]
    for dataset in dict.fromkeys(s["dataset"] for s in summary):
        cells = [s for s in summary if s["dataset"] == dataset]
        table = [[c["indicator"], f"{c['keep_rate']:g}", f"{1000 * c['gflops']:.1f}", percent(c["mean"], c["std"], c["n"])]
                 for c in cells]
        parts.append(f"## {dataset}\n\n" + markdown_table(["indicator", "keep", "MFLOPs", "accuracy"], table) + "\n")
    parts.append(overlap_section(rows))
    (docs / "finetune.md").write_text("\n".join(parts))


def overlap_section(rows) -> str:
    """Experiment (d): overlap + pruning against the unpruned model at matched FLOPs."""
    chosen = [r for r in rows if r["overlap_stride"] is not None or r["indicator"] == "unpruned"]
    after = summarise(chosen, ["dataset", "indicator", "overlap_stride", "keep_rate", "gflops"])
    before = {tuple(s[k] for k in ("dataset", "indicator", "keep_rate")): s for s in summarise(
        [r for r in chosen if r["accuracy_before_finetune"] is not None],
        ["dataset", "indicator", "keep_rate"], value="accuracy_before_finetune")}
    table = []
    for s in after:
        b = before.get((s["dataset"], s["indicator"], s["keep_rate"]))
        table.append([s["dataset"], s["indicator"], s["overlap_stride"] or "-", f"{s['keep_rate']:g}",
                      f"{1000 * s['gflops']:.1f}", percent(b["mean"], b["std"], b["n"]) if b else "-",
                      percent(s["mean"], s["std"], s["n"])])
    return ("## Overlapping patches + pruning at matched FLOPs (experiment d)\n\n"
            "Stride and keep rate from `vitprune.fit_overlap(model, **paper_options)` (for the paper's method; "
            "the smallest stride whose keep rate for the unpruned model's FLOPs stays >= 0.5). 'Before' is the overlapped, pruned model "
            f"before fine-tuning; 'after' follows the same {STEPS}-step fine-tune as every row above.\n\n"
            + markdown_table(["dataset", "indicator", "stride", "keep", "MFLOPs", "before", "after"], table) + "\n")


if __name__ == "__main__":
    main()
