"""Shared model factories. All models use random weights: nothing is downloaded."""

from __future__ import annotations

from typing import Callable, Dict

import pytest
import timm
import torch

#: The families the equivalence tests cover, each small enough for a CPU test.
MODEL_FACTORIES: Dict[str, Callable[[], torch.nn.Module]] = {
    "deit_tiny": lambda: timm.create_model("deit_tiny_patch16_224"),
    "deit3_small (LayerScale)": lambda: timm.create_model("deit3_small_patch16_224", img_size=128),
    "qk_norm": lambda: timm.create_model("deit_tiny_patch16_224", qk_norm=True, img_size=128),
    "deit_tiny_distilled (2 prefix)": lambda: timm.create_model("deit_tiny_distilled_patch16_224"),
    "dinov2 reg4 (5 prefix)": lambda: timm.create_model("vit_small_patch14_reg4_dinov2", img_size=112),
}


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODEL_FACTORIES[name]().eval()


def image_batch(model: torch.nn.Module, batch: int = 2, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *model.patch_embed.img_size, generator=generator)


#: The paper's method (its three stages, top-scored tokens kept, one fusion token, plain
#: attention), for the tests that check it rather than the library's defaults.
PAPER = dict(stages=None, selection="top", reduction="fuse", size_aware=False)


def paper(**options):
    """``PAPER`` with ``options`` overriding it (for example other stages)."""
    return {**PAPER, **options}


@pytest.fixture
def tiny() -> torch.nn.Module:
    return make_model("deit_tiny")
