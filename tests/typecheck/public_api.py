"""The public API as a user's type checker sees it (checked by tests/test_typing.py, never run).

Every documented call must type-check under ``mypy --strict``; every line marked
``# type: ignore[...]`` is a misuse that must stay an error (``--warn-unused-ignores``
reports the mark if the annotations ever let it through).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import nn

import vitprune


def documented_calls(model: nn.Module, images: torch.Tensor) -> None:
    patched: nn.Module = vitprune.patch(model, keep_rate=0.7)
    vitprune.patch(model, indicator="var", keep_rate=0.7, stages=None, selection="top", reduction="fuse",
                   size_aware=False, class_only_last=False)
    vitprune.patch(model, indicator="medad", keep_rate=(0.7, 0.6, 0.5), stages=(3, 6, 9), reduction="fuse", T=math.inf)
    vitprune.patch(model, indicator="var", keep_rate=[0.7, 0.6, 0.5], stages=[3, 6, 9], fuse=True, T=2.0)
    vitprune.patch(model, keep_rate=0.5, stages="all", crowding=0.5)
    vitprune.patch(model, keep_rate=0.5, stages="spread", class_only_last=True)
    vitprune.patch(model, keep_rate=0.7, stages="spread2")
    vitprune.patch(model, indicator="random", seed=3, fuse=True)
    vitprune.patch(model, indicator="random", generator=torch.Generator().manual_seed(0))
    vitprune.patch(model, indicator="cls", selection="redundant", reduction="drop")

    config = vitprune.PruneConfig(keep_rate=0.5, stages="spread")
    vitprune.PruneConfig(keep_rate=(0.7, 0.6), stages=(3, 6))
    vitprune.PruneConfig(keep_rate=[0.7, 0.6], stages=[3, 6], indicator="lowvar")
    vitprune.patch(model, config, keep_rate=0.5)
    read: vitprune.PruneConfig = vitprune.get_config(patched)
    blocks, rates = read.schedule()
    first_block: int = blocks[0]
    first_rate: float = rates[0]
    indicator: Optional[str] = read.indicator
    stages = vitprune.default_stages(12)
    first_stage: int = stages[0]
    kept: int = vitprune.keep_count(0.7, 196)

    positions: List[torch.Tensor] = vitprune.kept_positions(model)
    groups: List[torch.Tensor] = vitprune.token_groups(model)
    is_patched: bool = vitprune.is_patched(model)
    restored: nn.Module = vitprune.unpatch(model)

    rate: float = vitprune.fit_keep_rate(model, 3.0)
    rate = vitprune.fit_keep_rate(model, 3.0, stages="spread", img_size=(224, 224))
    rate = vitprune.fit_keep_rate(model, 3.0, stages=(3, 6, 9), fuse=True)
    rate = vitprune.fit_keep_rate(model, 3.0, stages="spread3")
    rate = vitprune.fit_keep_rate(model, 3.0, stages=None, selection="top", reduction="fuse", size_aware=False)
    option: vitprune.OverlapOption = vitprune.fit_overlap(model)
    vitprune.patch(model, indicator="medad", keep_rate=option.keep_rate, overlap_stride=option.stride)
    options: List[vitprune.OverlapOption] = vitprune.overlap_options(model, 4.0)
    flops: int = vitprune.analytic_flops(model) + vitprune.count_flops(model, img_size=(224, 224))
    flops = vitprune.count_flops(model, products_only=True)
    merging: vitprune.PruneConfig = vitprune.fit_merging(model, 3.0)
    merging = vitprune.merging_config(model, 8)
    merging = vitprune.merging_config(model, [8, 8, 4])

    masks: torch.Tensor = vitprune.kept_masks(model, (224, 224))
    dense: torch.Tensor = vitprune.unmerge(model, images) + vitprune.unmerge(model, images, block=-1)
    figure = vitprune.visualize(model, images, show="groups")
    figure.savefig("kept.png")
    settings = vitprune.build_settings(model, methods=("default", "var"), keep_rates=(0.7,), budgets=(3.0,))
    batches: List[Tuple[torch.Tensor, torch.Tensor]] = [(images, torch.zeros(len(images), dtype=torch.long))]
    rows = vitprune.evaluate(model, batches, settings)
    names: Tuple[str, ...] = vitprune.INDICATORS + vitprune.SELECTIONS + vitprune.REDUCTIONS
    classes: Tuple[type, ...] = vitprune.SUPPORTED_MODELS + vitprune.supported_models()
    print(patched, indicator, first_stage, kept, positions, groups, is_patched, restored, rate, options, flops,
          merging, masks, dense, rows, names, classes)


def misuses(model: nn.Module, images: torch.Tensor) -> None:
    vitprune.patch(model, indicator="variance")  # type: ignore[arg-type]
    vitprune.patch(model, selection="best")  # type: ignore[arg-type]
    vitprune.patch(model, reduction="mean")  # type: ignore[arg-type]
    vitprune.patch(model, stages="every")  # type: ignore[arg-type]
    vitprune.patch(model, stages="spread4")  # type: ignore[arg-type]
    vitprune.patch(model, keep_rate="0.7")  # type: ignore[arg-type]
    vitprune.patch(model, keep_ratio=0.7)  # type: ignore[arg-type]
    vitprune.PruneConfig(stages="every")  # type: ignore[arg-type]
    vitprune.PruneConfig(indicator="variance")  # type: ignore[arg-type]
    vitprune.fit_keep_rate(model, "3")  # type: ignore[arg-type]
    vitprune.fit_keep_rate(model, 3.0, stages="every")  # type: ignore[arg-type]
    vitprune.visualize(model, images, show="both")  # type: ignore[arg-type]
    vitprune.unmerge(model, images, block="last")  # type: ignore[arg-type]
    rate: str = vitprune.fit_keep_rate(model, 3.0)  # type: ignore[assignment]
    print(rate)
