"""Real data that installs from a package registry, for training and checking small ViTs.

- **Fashion-MNIST** (Xiao, Rasul and Vollgraf, 2017; Zalando Research, MIT licence):
  70,000 28x28 greyscale images of 10 kinds of clothing, read from the original IDX
  files that Debian's ``dataset-fashion-mnist`` package installs in
  ``/usr/share/datasets/fashion-mnist`` (``apt-get install dataset-fashion-mnist``).
- **Cluttered Fashion-MNIST** (ours): each Fashion-MNIST image placed at a random spot on
  a 56x56 canvas with dim fragments of other images around it, so that most patches are
  background or distraction and pruning has something to find. Made deterministically
  from a seed; the canvas, placement and clutter are fixed per (split, index).
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

FASHION_MNIST_DIR = Path(os.environ.get("VITPRUNE_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
from . import DATASETS  # noqa: F401  (named once, in the light package module)
CANVAS = 56
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel statistics

_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (gzipped or not) as a uint8 tensor of the shape its header gives."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as stream:
        data = stream.read()
    if data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


def load_fashion_mnist(split: str = "train", root: Optional[Path] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST ``(images uint8 (N, 28, 28), labels int64 (N,))`` for ``"train"`` or ``"test"``."""
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root) if root is not None else FASHION_MNIST_DIR
    paths = [root / name for name in _FILES[split]]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST not found ({', '.join(missing)}): run 'apt-get install dataset-fashion-mnist', "
            "or point VITPRUNE_FASHION_MNIST at a folder holding the four IDX .gz files"
        )
    return read_idx(paths[0]), read_idx(paths[1]).long()


def clutter_canvas(images: torch.Tensor, seed: int, fragments: int = 6, fragment_size: int = 10,
                   brightness: float = 0.5) -> torch.Tensor:
    """Each 28x28 image at a random spot of a 56x56 canvas, among dim fragments of the others.

    Args:
        images: ``(N, 28, 28)`` uint8.
        seed: Fixes placement and clutter, so the same seed gives the same data.
        fragments: Fragments of other images (of the same set) scattered per canvas.
        fragment_size: Side of each square fragment.
        brightness: Fragment intensity relative to the object.

    Returns:
        ``(N, 56, 56)`` uint8 canvases; the object is drawn over the clutter.
    """
    n = images.shape[0]
    g = torch.Generator().manual_seed(seed)
    canvas = torch.zeros(n, CANVAS, CANVAS, dtype=torch.float32)
    room = CANVAS - fragment_size + 1
    sources = torch.randint(0, n, (n, fragments), generator=g)
    crops = torch.randint(0, 28 - fragment_size + 1, (n, fragments, 2), generator=g)
    spots = torch.randint(0, room, (n, fragments, 2), generator=g)
    for f in range(fragments):
        for i in range(n):
            (cy, cx), (sy, sx) = crops[i, f].tolist(), spots[i, f].tolist()
            piece = images[sources[i, f], cy:cy + fragment_size, cx:cx + fragment_size].float() * brightness
            region = canvas[i, sy:sy + fragment_size, sx:sx + fragment_size]
            torch.maximum(region, piece, out=region)
    where = torch.randint(0, CANVAS - 28 + 1, (n, 2), generator=g)
    for i in range(n):
        y, x = where[i].tolist()
        region = canvas[i, y:y + 28, x:x + 28]
        torch.maximum(region, images[i].float(), out=region)
    return canvas.round().to(torch.uint8)


def load(dataset: str, split: str, root: Optional[Path] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(images uint8 (N, H, W), labels)`` of ``"fashion_mnist"`` or ``"cluttered"``."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; accepted: {', '.join(DATASETS)}")
    images, labels = load_fashion_mnist(split, root)
    if dataset == "cluttered":
        images = clutter_canvas(images, seed={"train": 1, "test": 2}[split])
    return images, labels


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(N, H, W)`` to the normalised float ``(N, 1, H, W)`` the models take."""
    return (images.unsqueeze(1).float() / 255.0 - MEAN) / STD
