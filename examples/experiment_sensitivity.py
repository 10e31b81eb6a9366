"""Experiment (c): sensitivity to the fusion temperature T and to where pruning happens.

    python examples/experiment_sensitivity.py --checkpoints runs/*_seed*.pt

Off the shelf, full test split, var and medad at keep rate 0.5:
- T in 0.1, 0.3, 1 (the default), 3, 10 and inf (plain mean of the pruned tokens);
- stage placements for the 6-block models: the default (1, 3, 4), earlier (0, 2, 4),
  later (2, 3, 5), and a single stage at block 1 or 3 (fewer FLOPs saved: see MFLOPs).
The paper's method throughout (``experiments_common.paper_method``: one fusion token, top-scored
tokens kept, plain attention). Writes docs/results/sensitivity.json and docs/sensitivity.md.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Tuple

from torch import nn
from tqdm.auto import tqdm

import vitprune
from vitprune.data.accuracy import accuracy
from experiments_common import experiment_inputs, paper_method, save_results
from vitprune.measure.flops import analytic_flops
from reporting import markdown_table, percent, summarise

TEMPERATURES = (0.1, 0.3, 1.0, 3.0, 10.0, math.inf)
PLACEMENTS = ((1, 3, 4), (0, 2, 4), (2, 3, 5), (1,), (3,))
KEEP = 0.5


def patched(base: nn.Module, indicator: str, stages: Tuple[int, ...], T: float) -> nn.Module:
    """A copy of ``base`` under the paper's method with ``indicator`` at ``KEEP``, at
    ``stages`` with temperature ``T``."""
    return vitprune.patch(copy.deepcopy(base), keep_rate=KEEP, **paper_method(indicator, stages=stages, T=T))


def main() -> None:
    args, models, test = experiment_inputs(__doc__)
    plan = [("T", t, (1, 3, 4)) for t in TEMPERATURES] + [("stages", 1.0, p) for p in PLACEMENTS]
    jobs = [(m, r, ind, job) for m, r in models for ind in ("var", "medad") for job in plan]
    rows = []
    for base, record, indicator, (study, T, stages) in tqdm(jobs, desc="sensitivity", file=sys.stderr):
        model = patched(base, indicator, stages, T)
        images, labels = test[record["dataset"]]
        rows.append({"study": study, "dataset": record["dataset"], "seed": record["seed"], "indicator": indicator,
                     "T": "inf" if math.isinf(T) else T, "stages": ",".join(map(str, stages)),
                     "gflops": analytic_flops(model) / 1e9, "accuracy": accuracy(model, images, labels)})

    docs = Path(args.docs)
    command = save_results(args.docs, "sensitivity", rows)
    parts = [f"# Sensitivity to T and to stage placement\n\nCommand: `{command}`\n",
             f"Off the shelf, keep rate {KEEP} at every stage, top-1 accuracy (%) on the full test split, "
             "mean ± standard deviation over the trained seeds.\n"]
    for study, column in (("T", "T"), ("stages", "stages")):
        summary = summarise([r for r in rows if r["study"] == study], ["dataset", "indicator", column, "gflops"])
        values = list(dict.fromkeys(s[column] for s in summary))
        for dataset in dict.fromkeys(s["dataset"] for s in summary):
            table = []
            for value in values:
                cells = [s for s in summary if s["dataset"] == dataset and s[column] == value]
                table.append([value, f"{1000 * cells[0]['gflops']:.1f}"]
                             + [percent(c["mean"], c["std"], c["n"]) for c in cells])
            header = [column, "MFLOPs"] + [c["indicator"] for c in summary
                                           if c["dataset"] == dataset and c[column] == values[0]]
            parts.append(f"## {dataset}: {column}\n\n" + markdown_table(header, table) + "\n")
    (docs / "sensitivity.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
