"""The state a patched model carries: its config, and what the last forward kept."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .config import PruneConfig, keep_count
from .indicators import SCORES, uniform_random
from .overlap import OverlapRecord
from .tokens import gather_tokens, prune_tokens


class PruneState:
    """Shared by a patched model and its pruning blocks; one per patched model.

    Attributes:
        config: The resolved config (explicit stages, one keep rate per stage).
        num_prefix: Tokens at the front that are never pruned.
        generator: The ``"random"`` indicator's generator, or ``None``.
        overlap: What the overlapping patch embedding replaced, or ``None``.
        row_source: Where the scored attention row comes from (``attention.ROW_SOURCES``).
        positions: For the last forward, by stage number (0 for the first pruning block):
            ``(B, n)`` long tensor giving, for each non-prefix token after that stage, the
            index of the patch token it was when it entered the first block, or ``-1``
            for the fusion token.
        sizes: For the last forward, ``(B, n)`` float tensor: how many original patches
            each non-prefix token after the last stage that pruned stands for (1 for a
            kept patch, the number merged for the fusion token), or ``None`` when nothing
            was pruned. Average and attention pooling weight tokens by it.
    """

    def __init__(self, config: PruneConfig, num_prefix: int, generator: Optional[torch.Generator],
                 row_source: str = "cls") -> None:
        self.config = config
        self.num_prefix = num_prefix
        self.generator = generator
        self.row_source = row_source
        self.overlap: Optional[OverlapRecord] = None
        self.positions: Dict[int, torch.Tensor] = {}
        self.sizes: Optional[torch.Tensor] = None

    def scores(self, row: torch.Tensor) -> torch.Tensor:
        """``(B, N)`` float32 scores from the class attention row ``(B, H, N)``."""
        if self.config.indicator == "random":
            return uniform_random(row, self.generator)
        return SCORES[self.config.indicator](row)

    def prune(self, x: torch.Tensor, row: torch.Tensor, stage: int) -> torch.Tensor:
        """Apply pruning stage ``stage`` to tokens ``x`` given the class attention ``row``."""
        P = self.num_prefix
        B, n = x.shape[0], int(x.shape[1]) - P  # int(): a traced shape is a tensor
        if stage == 0:  # fresh objects, not reads of the last forward's: no torch.compile guards on them
            self.positions = {}
            self.sizes = None
        previous = self.positions.get(stage - 1)
        if previous is None or previous.shape != (B, n):
            previous = torch.arange(n, device=x.device).expand(B, n)

        scores = self.scores(row)  # also at keep 1.0, so benchmarks there measure the scoring cost
        k = keep_count(self.config.keep_rate[stage], n)
        if k == n:
            self.positions[stage] = previous
            return x
        sizes = self.sizes
        if sizes is None or sizes.shape != (B, n):
            sizes = x.new_ones((B, n), dtype=torch.float32)
        x, sel = prune_tokens(x, scores, P, k, self.config.fuse, self.config.T)
        kept = gather_tokens(previous.unsqueeze(-1), sel.keep).squeeze(-1)
        sizes_kept = sizes.gather(1, sel.keep)
        if x.shape[1] - P > k:
            kept = torch.cat([kept, kept.new_full((B, 1), -1)], dim=1)
            sizes_kept = torch.cat([sizes_kept, sizes.gather(1, sel.drop).sum(dim=1, keepdim=True)], dim=1)
        self.positions[stage] = kept
        self.sizes = sizes_kept
        return x

    def kept_positions(self) -> List[torch.Tensor]:
        """``positions`` as a list in stage order (see the class docs)."""
        return [self.positions[s] for s in sorted(self.positions)]
