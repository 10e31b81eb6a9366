"""Experiment (b): fine-tune with pruning active (the paper's protocol), then evaluate.

    python examples/experiment_finetune.py --checkpoints runs/*_seed*.pt

From each trained checkpoint: a short fine-tune (300 steps, peak learning rate 2e-4,
the training recipe of train_small_vit.py otherwise) with pruning active, for var,
medad, cls, random and lowvar at keep rates 0.7 and 0.5, and for the unpruned model
fine-tuned the same way (the fair baseline). Full test split. Writes
docs/results/finetune.json and docs/finetune.md.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

from tqdm.auto import tqdm

import vitprune
from train_small_vit import train  # examples/ is on sys.path when this script runs
from vitprune import datasets
from vitprune.evaluation import accuracy, experiment_inputs, save_results
from vitprune.flops import analytic_flops
from vitprune.report import markdown_table, percent, summarise

INDICATORS = ("var", "medad", "cls", "random", "lowvar")
KEEP_RATES = (0.7, 0.5)
STEPS, LR, WARMUP = 300, 2e-4, 30


def main() -> None:
    args, models, test = experiment_inputs(__doc__)
    train_sets = {d: datasets.load(d, "train") for d in test}
    settings = [(None, 1.0)] + [(i, k) for k in KEEP_RATES for i in INDICATORS]
    jobs = [(m, r, s) for m, r in models for s in settings]
    rows = []
    for base, record, (indicator, rate) in tqdm(jobs, desc="fine-tune", file=sys.stderr):
        model = copy.deepcopy(base)
        if indicator is not None:
            vitprune.patch(model, indicator=indicator, keep_rate=rate,
                           **({"seed": record["seed"]} if indicator == "random" else {}))
        images, labels = train_sets[record["dataset"]]
        train(model, images, labels, record["dataset"], steps=STEPS, batch=128, lr=LR, warmup=WARMUP,
              seed=1000 + record["seed"], desc=f"{indicator or 'unpruned'} {rate}")
        rows.append({"dataset": record["dataset"], "seed": record["seed"], "indicator": indicator or "unpruned",
                     "keep_rate": rate, "gflops": analytic_flops(model) / 1e9,
                     "accuracy": accuracy(model, *test[record["dataset"]])})
    command = save_results(args.docs, "finetune", rows)
    summary = summarise(rows, ["dataset", "indicator", "keep_rate", "gflops"])
    parts = [f"# Fine-tuned with pruning active\n\nCommand: `{command}`\n",
             f"{STEPS} steps from each trained checkpoint (peak lr {LR}); top-1 accuracy (%) on the full "
             "test split, mean ± standard deviation over the trained seeds.\n"]
    for dataset in dict.fromkeys(s["dataset"] for s in summary):
        cells = [s for s in summary if s["dataset"] == dataset]
        table = [[c["indicator"], f"{c['keep_rate']:g}", f"{1000 * c['gflops']:.1f}", percent(c["mean"], c["std"], c["n"])]
                 for c in cells]
        parts.append(f"## {dataset}\n\n" + markdown_table(["indicator", "keep", "MFLOPs", "accuracy"], table) + "\n")
    (Path(args.docs) / "finetune.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
