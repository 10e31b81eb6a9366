"""One picture file as a model input: the model's data config through timm's transforms
(timm and ``transformers`` models), greyscale for vitprune's own small models; each with a
copy in [0, 1] for drawing."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Tuple

import torch

from .datasets import MEAN, STD
from .folders import eval_transform

if TYPE_CHECKING:  # Pillow is imported when a picture is read
    from PIL import Image


def load_picture(path: str) -> "Image.Image":
    """A picture file opened and read by Pillow; ``FileNotFoundError`` or ``ValueError`` when it cannot be."""
    from PIL import Image, UnidentifiedImageError

    if not Path(path).is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        picture = Image.open(path)
        picture.load()
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"cannot read {path} as an image ({error})") from None
    return picture


def prepare_timm(config: Dict[str, Any], picture: "Image.Image") -> Tuple[torch.Tensor, torch.Tensor]:
    """The model's own preprocessing, from its timm data config (``models.load_model`` gives
    it): ``(input, display in [0, 1])``."""
    x = eval_transform(config)(picture.convert("RGB")).unsqueeze(0)
    mean = torch.tensor(config["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(config["std"]).view(1, -1, 1, 1)
    return x, (x * std + mean).clamp(0, 1)


def prepare_greyscale(config: Dict[str, Any], picture: "Image.Image") -> Tuple[torch.Tensor, torch.Tensor]:
    """Preprocessing of vitprune's own small models: greyscale, resized, normalised like Fashion-MNIST."""
    size = tuple(int(s) for s in config["input_size"][-2:])
    grey = picture.convert("L").resize((size[1], size[0]))
    display = torch.frombuffer(bytearray(grey.tobytes()), dtype=torch.uint8).view(1, 1, *size).float() / 255
    return (display - MEAN) / STD, display
