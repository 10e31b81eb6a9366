"""Experiment (g): two changes to how tokens merge, from Token Fusion, at equal FLOPs.

    python examples/experiment_merge_variants.py --checkpoints vitprune/assets/fashion_mnist_vit.pt \\
        vitprune/assets/cluttered_vit.pt --limit 10000 --name merge_variants
    python examples/experiment_merging.py --report docs/results/merge_variants.json --name merge_variants \\
        --note "..."  # the paragraph under the commands in docs/merge_variants.md

Token Fusion (Kim et al., "Token Fusion: Bridging the Gap between Token Pruning and Token
Merging", WACV 2024) makes two claims about merging off the shelf:

- *Keep the norm* (MLERP). The average of tokens that point apart is shorter than any of
  them, and later blocks see a shorter token than they were trained on; MLERP takes the
  average's direction at the largest norm among the tokens merged. Here every destination
  that receives tokens is rescaled that way after the size-weighted average.
- *Prune early, merge late*. The first blocks respond far from linearly to an average of
  their inputs, so there a matched token should be dropped rather than averaged in. Here,
  in the first one or two rounds of each forward, every destination keeps its own value;
  its size still counts the patches matched to it, so size-aware attention weighs it as
  before.

Candidates that stay, destinations that receive nothing, the selection, the sizes and the
FLOPs are as before, so each method is compared with itself at the same fitted FLOPs: the
defaults and token merging, each as it runs and with each change.

Scaffolding for this repository's experiments: a change wraps the library's one-round merge
(``vitprune.core.state.bipartite_merge``) for the duration of a ``with`` block.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from tqdm.auto import tqdm

import vitprune
from vitprune.core import merging, state
from vitprune.data.accuracy import accuracy
from vitprune.data.datasets import load
from vitprune.data.shipped import load_checkpoint
from vitprune.measure.flops import schedule_flops
from experiment_merging import BASELINE, DEFAULT, row, write_rows

#: A change to a merge: ``(merged, tokens, num_prefix) -> merged``, ``merged`` being
#: :func:`merging.bipartite_merge` of ``tokens``.
Change = Callable[[merging.Merged, torch.Tensor, int], merging.Merged]


def keep_norms(merged: merging.Merged, tokens: torch.Tensor, num_prefix: int) -> merging.Merged:
    """Every destination that received tokens rescaled to the largest norm among the tokens it
    now holds (itself and the candidates merged into it); the rest as they were."""
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


def keep_destinations(merged: merging.Merged, tokens: torch.Tensor, num_prefix: int) -> merging.Merged:
    """Every destination as it was before the merge (the candidates matched to it dropped);
    the sizes as merged."""
    P, m = num_prefix, merged.stays.shape[1]
    out = merged.tokens.clone()
    out[:, P + m:] = tokens[:, P::2]
    return merged._replace(tokens=out)


@contextlib.contextmanager
def changed_merges(model: torch.nn.Module, change: Change, rounds: Optional[int] = None) -> Iterator[None]:
    """Inside the block, ``change`` applies to the first ``rounds`` one-round bipartite merges
    of each forward of ``model`` (every one when ``None``). The library's merge is back, and
    the hook that counts the rounds is gone, on leaving it, whatever happened."""
    plain = state.bipartite_merge
    seen = 0  # rounds merged so far in this forward

    def merge(tokens: torch.Tensor, keys: torch.Tensor, sizes: torch.Tensor, k: int, num_prefix: int,
              crowding: float = 0.0) -> merging.Merged:
        nonlocal seen
        merged = plain(tokens, keys, sizes, k, num_prefix, crowding)
        seen += 1
        return merged if rounds is not None and seen > rounds else change(merged, tokens, num_prefix)

    def restart(module: torch.nn.Module, args: Any) -> None:
        nonlocal seen
        seen = 0

    hook = model.register_forward_pre_hook(restart)
    state.bipartite_merge = merge
    try:
        yield
    finally:
        state.bipartite_merge = plain
        hook.remove()


#: The changes measured: name suffix -> (change, rounds).
VARIANTS: Dict[str, "tuple[Change, Optional[int]]"] = {
    " with the norm kept (MLERP)": (keep_norms, None),
    " pruning in the first round": (keep_destinations, 1),
    " pruning in the first two rounds": (keep_destinations, 2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", required=True, help="from examples/train_small_vit.py")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.8, 0.7, 0.6, 0.5, 0.4])
    parser.add_argument("--limit", type=int, default=5000, help="the first LIMIT test images")
    parser.add_argument("--name", default="merge_variants", help="results file name (docs/results/NAME.json)")
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
                for suffix, (change, rounds) in VARIANTS.items():
                    with changed_merges(patched, change, rounds):
                        rows.append(row(record, name + suffix, budget, patched, accuracy(patched, images, labels)))
    write_rows(args, rows)


if __name__ == "__main__":
    main()
