"""How close a reduced model's dense features, spread back over the patch grid with
``vitprune.unmerge``, come to the unpruned model's.

For each shipped model and each share of the unpruned FLOPs: the defaults, the paper's method
(var, three stages, one fusion token) and token merging (``fit_merging``), each fitted to
that share with every token through the last block (``class_only_last=False``:
``forward_features`` computes all of them, so the FLOPs are those of the features). Each
runs ``forward_features`` on the shipped test images; ``unmerge`` puts the tokens back on
the grid, and every patch's feature is compared with the unpruned model's at that patch:
the mean cosine similarity, and the relative error ``|u - f| / |f|`` over all patches.

    python examples/unmerge_fidelity.py --json docs/results/unmerge_fidelity.json

Real weights and images, no download; a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any, Dict, List

import torch

import vitprune
from vitprune.data.datasets import to_input
from vitprune.data.shipped import load_shipped, load_test_subset
from vitprune.measure.evaluate import DEFAULT, MERGING, Setting, apply_setting, build_settings

DATASETS = ("fashion_mnist", "cluttered")
BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5)
#: ``build_settings``' method names, as the table names them.
NAMES = {DEFAULT: "defaults", "var": "paper (var)", MERGING: "token merging"}


def settings(model: torch.nn.Module) -> List[Setting]:
    """The three methods fitted to every budget, every token through the last block
    (``build_settings`` with ``class_only_last=False``; the unpruned setting left out)."""
    return build_settings(model, methods=(DEFAULT, "var"), budgets=BUDGETS, baseline=True,
                          class_only_last=False)[1:]


def compare(reference: torch.Tensor, spread: torch.Tensor, prefix: int) -> Dict[str, float]:
    """Mean cosine similarity and relative error of the patch tokens (prefix tokens left out)."""
    ref, out = reference[:, prefix:].flatten(0, 1), spread[:, prefix:].flatten(0, 1)
    return {"cosine": torch.nn.functional.cosine_similarity(out, ref, dim=-1).mean().item(),
            "relative_error": ((out - ref).norm() / ref.norm()).item()}


def run(dataset: str, images: int) -> List[Dict[str, Any]]:
    model, _ = load_shipped(dataset)
    x = to_input(load_test_subset(dataset)[0][:images])
    with torch.inference_mode():
        reference = model.forward_features(x)
    rows = []
    for setting in settings(model):
        patched = apply_setting(copy.deepcopy(model), setting)
        with torch.inference_mode():
            spread = vitprune.unmerge(patched, patched.forward_features(x))
        rows.append({"dataset": dataset, "budget": setting.budget, "method": NAMES[setting.method],
                     "gflops": vitprune.analytic_flops(patched) / 1e9,
                     **compare(reference, spread, model.num_prefix_tokens)})
    order = list(NAMES.values())
    return sorted(rows, key=lambda row: (-row["budget"], order.index(row["method"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="shipped test images per dataset (at most 2,000)")
    parser.add_argument("--json", help="write the rows here as JSON, with this command")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [row for dataset in DATASETS for row in run(dataset, args.images)]
    print("| data set | FLOPs | method | GFLOPs | cosine | relative error |\n| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['dataset']} | {row['budget']:.0%} | {row['method']} | {row['gflops']:.4f} | "
              f"{row['cosine']:.4f} | {row['relative_error']:.3f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": vars(args), "torch": torch.__version__, "rows": rows}, handle, indent=1)
            handle.write("\n")


if __name__ == "__main__":
    main()
