"""Experiment (a): pruning off the shelf, no fine-tuning, on real test data.

    python examples/experiment_offshelf.py --checkpoints runs/*_seed*.pt

For every checkpoint (one trained model per dataset and seed): indicators var, medad,
cls (EViT), random and lowvar (the falsifier: keep the patches the heads agree on) at
keep rates 0.9 to 0.3, with the fusion token; var, medad and cls also without it. The
Fashion-MNIST test split (10,000 images, or their cluttered versions; --limit N: the first N). Writes
docs/results/offshelf.json, docs/offshelf.md and docs/offshelf.png. Every setting is the paper's
method (its three stages scaled to the depth, the top-scored tokens kept, one fusion token or
none, plain attention: ``experiments_common.paper_method``), not the library's defaults.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

from torch import nn
from tqdm.auto import tqdm

import vitprune
from vitprune.data.accuracy import accuracy
from experiments_common import experiment_inputs, paper_method, save_results
from vitprune.measure.flops import analytic_flops
from reporting import markdown_table, percent, summarise

INDICATORS = ("var", "medad", "cls", "random", "lowvar")
NO_FUSION = ("var", "medad", "cls")
KEEP_RATES = (0.9, 0.7, 0.5, 0.3)


def settings():
    yield None, 1.0, True
    for rate in KEEP_RATES:
        for indicator in INDICATORS:
            yield indicator, rate, True
        for indicator in NO_FUSION:
            yield indicator, rate, False


def patched(base: nn.Module, indicator: str, rate: float, fuse: bool, seed: int) -> nn.Module:
    """A copy of ``base`` under the paper's method with ``indicator`` at ``rate``, with its
    fusion token or dropping the pruned tokens; the random indicator seeded with ``seed``."""
    return vitprune.patch(copy.deepcopy(base), keep_rate=rate,
                          **paper_method(indicator, seed, reduction="fuse" if fuse else "drop"))


def main() -> None:
    args, models, test = experiment_inputs(__doc__)
    plan = [(m, r, s) for m, r in models for s in settings()]
    rows = []
    for base, record, (indicator, rate, fuse) in tqdm(plan, desc="off the shelf", file=sys.stderr):
        model = base if indicator is None else patched(base, indicator, rate, fuse, record["seed"])
        images, labels = test[record["dataset"]]
        rows.append({"dataset": record["dataset"], "seed": record["seed"], "indicator": indicator or "unpruned",
                     "keep_rate": rate, "fuse": fuse, "gflops": analytic_flops(model) / 1e9,
                     "accuracy": accuracy(model, images, labels)})

    docs = Path(args.docs)
    command = save_results(args.docs, "offshelf", rows)
    summary = summarise(rows, ["dataset", "indicator", "keep_rate", "fuse", "gflops"])
    write_markdown(summary, docs / "offshelf.md", command)
    plot(summary, docs / "offshelf.png")


def write_markdown(summary, path: Path, command: str) -> None:
    parts = [f"# Off the shelf: pruning without fine-tuning\n\nCommand: `{command}`\n",
             "Top-1 accuracy (%) on the test split (its first `--limit` images where the command says "
             "so), mean ± standard deviation over the "
             "trained seeds (n per cell below); blocks (1, 3, 4) of 6 prune.\n"]
    for dataset in dict.fromkeys(s["dataset"] for s in summary):
        base = next(s for s in summary if s["dataset"] == dataset and s["indicator"] == "unpruned")
        parts.append(f"## {dataset}\n\nUnpruned: {percent(base['mean'], base['std'], base['n'])} "
                     f"at {1000 * base['gflops']:.1f} MFLOPs, n = {base['n']}.\n")
        for fuse in (True, False):
            cells = [s for s in summary if s["dataset"] == dataset and s["fuse"] == fuse and s["indicator"] != "unpruned"]
            indicators = list(dict.fromkeys(s["indicator"] for s in cells))
            rates = sorted({s["keep_rate"] for s in cells}, reverse=True)
            table = []
            for rate in rates:
                row = [f"{rate:g}", f"{1000 * next(s['gflops'] for s in cells if s['keep_rate'] == rate):.1f}"]
                for indicator in indicators:
                    s = next(c for c in cells if c["keep_rate"] == rate and c["indicator"] == indicator)
                    row.append(percent(s["mean"], s["std"], s["n"]))
                table.append(row)
            parts.append(f"{'With' if fuse else 'Without'} the fusion token:\n\n"
                         + markdown_table(["keep", "MFLOPs"] + indicators, table) + "\n")
    path.write_text("\n".join(parts))


def plot(summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(s["dataset"] for s in summary))
    figure, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.2), squeeze=False)
    for axis, dataset in zip(axes[0], sets):
        cells = [s for s in summary if s["dataset"] == dataset and s["fuse"]]
        base = next(s for s in cells if s["indicator"] == "unpruned")
        for indicator in INDICATORS:
            line = sorted((s for s in cells if s["indicator"] == indicator), key=lambda s: s["gflops"])
            axis.errorbar([1000 * s["gflops"] for s in line], [100 * s["mean"] for s in line],
                          yerr=[100 * s["std"] for s in line], marker="o", capsize=3, label=indicator)
        axis.axhline(100 * base["mean"], color="black", linestyle="--", linewidth=1, label="unpruned")
        axis.set_xlabel("MFLOPs per image")
        axis.set_ylabel("top-1 accuracy (%)")
        axis.set_title(f"{dataset}, off the shelf (with fusion token)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
