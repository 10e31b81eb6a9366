"""The small ViTs vitprune trains on its real data and ships, and their test subsets."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import timm
import torch

from .datasets import DATASETS

ASSETS = Path(__file__).parent / "assets"

#: A DeiT-like ViT small enough to train on 2 CPU cores: 49 patch tokens, 6 heads, 6 blocks.
COMMON_ARGS: Dict[str, Any] = dict(in_chans=1, embed_dim=96, depth=6, num_heads=6, mlp_ratio=4.0, num_classes=10)
MODEL_ARGS: Dict[str, Dict[str, Any]] = {
    "fashion_mnist": dict(img_size=28, patch_size=4, **COMMON_ARGS),  # 7 x 7 patches
    "cluttered": dict(img_size=56, patch_size=8, **COMMON_ARGS),  # 7 x 7 patches of the 56 x 56 canvas
}


def build(dataset: str) -> torch.nn.Module:
    """An untrained timm ``VisionTransformer`` (class token, token pooling) for ``dataset``."""
    if dataset not in MODEL_ARGS:
        raise ValueError(f"unknown dataset {dataset!r}; accepted: {', '.join(DATASETS)}")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **MODEL_ARGS[dataset])


def checkpoint_path(dataset: str) -> Path:
    return ASSETS / f"{dataset}_vit.pt"


def load_checkpoint(path: Path) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """A checkpoint written by ``examples/train_small_vit.py``: the model (eval mode) and its record."""
    record = torch.load(path, map_location="cpu", weights_only=True)
    model = build(record["dataset"])
    model.load_state_dict({k: v.float() for k, v in record["state_dict"].items()})
    return model.eval(), {k: v for k, v in record.items() if k != "state_dict"}


def load_shipped(dataset: str) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The trained model that ships with vitprune for ``dataset``, and its record."""
    path = checkpoint_path(dataset)
    if not path.exists():
        raise FileNotFoundError(f"no shipped checkpoint for {dataset!r} at {path}")
    return load_checkpoint(path)


def load_test_subset(dataset: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The shipped test subset: ``(images uint8 (N, H, W), labels int64 (N,))``."""
    record = torch.load(ASSETS / f"{dataset}_test_subset.pt", map_location="cpu", weights_only=True)
    return record["images"], record["labels"]
