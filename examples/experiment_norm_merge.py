"""Experiment (g): does a merge that keeps the tokens' norm beat the plain average?

    python examples/experiment_norm_merge.py --checkpoints vitprune/assets/fashion_mnist_vit.pt \\
        vitprune/assets/cluttered_vit.pt --limit 10000 --name norm_merge
    python examples/experiment_merging.py --report docs/results/norm_merge.json --name norm_merge \\
        --note "..."  # the paragraph under the commands in docs/norm_merge.md

The average of tokens that point in different directions is shorter than any of them, and
later blocks see a shorter token than they were trained on. Token Fusion (Kim et al., "Token
Fusion: Bridging the Gap between Token Pruning and Token Merging", WACV 2024) proposes MLERP:
the average's direction at the largest norm among the tokens merged. Here every destination
that receives tokens in a round of bipartite matching is rescaled that way, after the
defaults' size-weighted average (token merging's too); candidates that stay and destinations
that receive nothing are untouched. Everything else (selection, sizes, size-aware attention,
FLOPs) is as before, so each method is compared with itself at the same fitted FLOPs.
(The paper also prunes instead of merging in the first blocks; that part is not tested here.)

Scaffolding for this repository's experiments: the rescaling wraps the library's one-round
merge (``vitprune.core.state.bipartite_merge``) for the duration of a ``with`` block.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import torch
from tqdm.auto import tqdm

import vitprune
from vitprune.core import merging, state
from vitprune.data.accuracy import accuracy
from vitprune.data.datasets import load
from vitprune.data.shipped import load_checkpoint
from vitprune.measure.flops import schedule_flops
from experiment_merging import BASELINE, DEFAULT, row, write_rows

NORM = " with the norm kept (MLERP)"


def keep_norms(merged: merging.Merged, tokens: torch.Tensor, num_prefix: int) -> merging.Merged:
    """``merged`` (:func:`merging.bipartite_merge` of ``tokens``) with every destination that
    received tokens rescaled to the largest norm among the tokens it now holds (itself and the
    candidates merged into it); the rest as they were."""
    P, m = num_prefix, merged.stays.shape[1]
    norms = tokens[:, P:].norm(dim=-1)
    arriving = norms[:, 1::2].gather(1, merged.removed)
    largest = norms[:, 0::2].scatter_reduce(1, merged.dest, arriving, reduce="amax", include_self=True)
    received = torch.zeros_like(largest, dtype=torch.bool).scatter_(1, merged.dest, True)
    destinations = merged.tokens[:, P + m:]
    scale = torch.where(received, largest / destinations.norm(dim=-1).clamp_min(1e-12), torch.ones_like(largest))
    out = merged.tokens.clone()
    out[:, P + m:] = destinations * scale.unsqueeze(-1).to(destinations.dtype)
    return merged._replace(tokens=out)


@contextlib.contextmanager
def norm_keeping_merges() -> Iterator[None]:
    """Inside the block, every one-round bipartite merge of a patched model keeps norms
    (:func:`keep_norms`); the library's merge is back on leaving it, whatever happened."""
    plain = state.bipartite_merge

    def merge(tokens: torch.Tensor, keys: torch.Tensor, sizes: torch.Tensor, k: int, num_prefix: int,
              crowding: float = 0.0) -> merging.Merged:
        return keep_norms(plain(tokens, keys, sizes, k, num_prefix, crowding), tokens, num_prefix)

    state.bipartite_merge = merge
    try:
        yield
    finally:
        state.bipartite_merge = plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", required=True, help="from examples/train_small_vit.py")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.8, 0.7, 0.6, 0.5, 0.4])
    parser.add_argument("--limit", type=int, default=5000, help="the first LIMIT test images")
    parser.add_argument("--name", default="norm_merge", help="results file name (docs/results/NAME.json)")
    parser.add_argument("--docs", default="docs")
    args = parser.parse_args()

    rows: List[Dict[str, Any]] = []
    for path in args.checkpoints:
        model, record = load_checkpoint(Path(path))
        images, labels = load(record["dataset"], "test")
        images, labels = images[:args.limit], labels[:args.limit]
        rows.append(row(record, "unpruned", 1.0, model, accuracy(model, images, labels)))
        full = schedule_flops(model, None) / 1e9
        for budget in tqdm(args.budgets, desc=Path(path).stem, file=sys.stderr):
            configs = {DEFAULT: vitprune.PruneConfig(keep_rate=vitprune.fit_keep_rate(model, budget * full)),
                       BASELINE: vitprune.fit_merging(model, budget * full)}
            for name, config in configs.items():
                patched = vitprune.patch(copy.deepcopy(model), config)
                rows.append(row(record, name, budget, patched, accuracy(patched, images, labels)))
                with norm_keeping_merges():
                    rows.append(row(record, name + NORM, budget, patched, accuracy(patched, images, labels)))
    write_rows(args, rows)


if __name__ == "__main__":
    main()
