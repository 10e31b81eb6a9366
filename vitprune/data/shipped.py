"""The small ViTs vitprune trains on its real data and ships, and their test subsets."""

from __future__ import annotations

import contextlib
import gzip
import io
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import timm
import torch

from ..core.numeric import whole_or_type_error
from . import DATASETS
from .datasets import MEAN, STD

ASSETS = Path(__file__).parent.parent / "assets"  # vitprune/assets

#: A DeiT-like ViT small enough to train on 2 CPU cores: 49 patch tokens, 6 heads, 6 blocks.
COMMON_ARGS: Dict[str, Any] = dict(in_chans=1, embed_dim=96, depth=6, num_heads=6, mlp_ratio=4.0, num_classes=10)
MODEL_ARGS: Dict[str, Dict[str, Any]] = {
    "fashion_mnist": dict(img_size=28, patch_size=4, **COMMON_ARGS),  # 7 x 7 patches
    "cluttered": dict(img_size=56, patch_size=8, **COMMON_ARGS),  # 7 x 7 patches of the 56 x 56 canvas
}


def build(dataset: str, depth: Optional[int] = None, patch_size: Optional[int] = None) -> torch.nn.Module:
    """An untrained timm ``VisionTransformer`` (class token, token pooling) for ``dataset``,
    with ``depth`` blocks instead of the shipped models' six, and patches of ``patch_size``
    pixels instead of their 7 x 7 grid (2 on Fashion-MNIST or 4 on the cluttered canvas
    give deit_small's 14 x 14), when given."""
    if dataset not in MODEL_ARGS:
        raise ValueError(f"unknown dataset {dataset!r}; accepted: {', '.join(DATASETS)}")
    for name, value in (("depth", depth), ("patch_size", patch_size)):
        if value is not None:
            whole_or_type_error(name, value, "a whole number (int)")
    if depth is not None and depth < 1:
        raise ValueError(f"depth must be a positive number of blocks, got {depth}")
    side = MODEL_ARGS[dataset]["img_size"]
    if patch_size is not None and (patch_size < 1 or side % patch_size):
        sizes = ", ".join(str(s) for s in range(1, side + 1) if side % s == 0)
        raise ValueError(f"patch_size must divide the {side}-pixel {dataset} images; accepted: {sizes}; "
                         f"got {patch_size}")
    options = {} if depth is None else {"depth": int(depth)}
    if patch_size is not None:
        options["patch_size"] = int(patch_size)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**MODEL_ARGS[dataset], **options})


def checkpoint_path(dataset: str) -> Path:
    return ASSETS / f"{dataset}_vit.pt"


def load_checkpoint(path: Path) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """A checkpoint written by ``examples/train_small_vit.py``: the model (eval mode) and its record."""
    # the first training runs stored torch.__version__ (a TorchVersion), not a str; torch < 2.5
    # has no safe_globals, and then only checkpoints that store a str load (the shipped ones do)
    allow = getattr(torch.serialization, "safe_globals", None)
    with allow([torch.torch_version.TorchVersion]) if allow else contextlib.nullcontext():
        record = torch.load(path, map_location="cpu", weights_only=True)
    args = record.get("model_args", {})
    model = build(record["dataset"], args.get("depth"), args.get("patch_size"))
    model.load_state_dict({k: v.float() for k, v in record["state_dict"].items()})
    return model.eval(), {k: v for k, v in record.items() if k != "state_dict"}


def load_shipped(dataset: str) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The trained model that ships with vitprune for ``dataset``, and its record."""
    path = checkpoint_path(dataset)
    if not path.exists():
        raise FileNotFoundError(f"no shipped checkpoint for {dataset!r} at {path}")
    return load_checkpoint(path)


def subset_path(dataset: str) -> Path:
    return ASSETS / f"{dataset}_test_subset.pt.gz"


def save_test_subset(dataset: str, images: torch.Tensor, labels: torch.Tensor) -> Path:
    """Write a test subset (gzipped: the canvases are mostly background)."""
    path = subset_path(dataset)
    buffer = io.BytesIO()
    torch.save({"images": images.contiguous().clone(), "labels": labels.contiguous().clone()}, buffer)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as out:
        out.write(buffer.getvalue())  # mtime=0: the same data gives the same bytes
    return path


def load_test_subset(dataset: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The shipped test subset: ``(images uint8 (N, H, W), labels int64 (N,))``.

    The first 2,000 images of the dataset's test split (Fashion-MNIST's test split, or
    its cluttered version), as written by ``examples/make_assets.py``.
    """
    with gzip.open(subset_path(dataset), "rb") as stream:
        record = torch.load(io.BytesIO(stream.read()), map_location="cpu", weights_only=True)
    return record["images"], record["labels"]


def data_config(model: torch.nn.Module) -> Dict[str, Any]:
    """timm's data config for one of vitprune's own models: greyscale at the model's size,
    normalised like ``datasets.to_input``, no resizing or cropping of images of that size."""
    height, width = (int(s) for s in getattr(model.patch_embed, "img_size"))
    return {"input_size": (1, height, width), "interpolation": "bilinear", "mean": (MEAN,), "std": (STD,),
            "crop_pct": 1.0, "crop_mode": "center"}
