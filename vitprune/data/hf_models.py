"""A ``transformers`` vision model for the commands (``--model hf:NAME_OR_FOLDER``), with its
image processor's preprocessing expressed as a timm data config.

Imported only when a command is given an ``hf:`` model, so ``transformers`` stays optional.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..core.grid import vision_config

#: How a command names a ``transformers`` model: ``hf:`` then a hub id or a local folder.
PREFIX = "hf:"
#: Full image-text models whose vision tower the commands load in their place.
TOWERS = {"CLIPModel": "CLIPVisionModelWithProjection", "SiglipModel": "SiglipVisionModel"}
#: Pillow's resampling filters by number, as timm names them.
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def is_transformers_name(name: Optional[str]) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("an hf: model needs the transformers extra: pip install 'vitprune[transformers]'") from None
    return transformers


def _model_class(config: Any) -> Any:
    """The class the config's checkpoint was saved from (a full CLIP or SigLIP: its vision
    tower), else the image classifier or base model ``transformers`` maps the config to."""
    transformers = _transformers()
    for name in config.architectures or ():
        cls = getattr(transformers, TOWERS.get(name, name), None)
        if cls is not None:
            return cls
    for auto in (transformers.AutoModelForImageClassification, transformers.AutoModel):
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            continue
    raise ValueError(f"transformers has no model class for a {type(config).__name__}")


def _config_for(cls: type, config: Any) -> Any:
    """The config ``cls`` takes: a tower's vision config out of a full image-text config,
    with the full model's projection width (the tower's own config defaults to another)."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted) or not hasattr(config, "vision_config"):
        return config
    vision = copy.deepcopy(config.vision_config)
    if hasattr(config, "projection_dim") and hasattr(vision, "projection_dim"):
        vision.projection_dim = config.projection_dim
    return vision


def load_transformers_model(spec: str, pretrained: bool, seed: int = 0) -> Tuple[nn.Module, Dict[str, Any], str]:
    """The model of ``hf:NAME_OR_FOLDER`` in eval mode, its preprocessing as a timm data config,
    and a phrase saying where its weights came from.

    Without ``pretrained`` the weights are random (seeded), built from the config alone.

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: No such folder or hub id (or no network), or no model class for it.
    """
    transformers = _transformers()
    from .models import offline_unless_reachable

    name = spec[len(PREFIX):]
    if not name:
        raise ValueError(f"name a transformers model after {PREFIX!r}: a hub id or a local folder")
    if not Path(name).is_dir():
        offline_unless_reachable()
    try:
        config = transformers.AutoConfig.from_pretrained(name)
    except Exception as error:  # no such folder or id, or no network: one line, not a traceback
        raise ValueError(f"cannot load the transformers config of {name} (no such folder or hub id, or no "
                         f"network and not cached?): {str(error).splitlines()[0]}") from None
    cls = _model_class(config)
    if pretrained:
        try:
            model = cls.from_pretrained(name, config=_config_for(cls, config))
        except Exception as error:
            raise ValueError(f"cannot load pretrained weights for {name}: {str(error).splitlines()[0]}") from None
        source = "pretrained weights"
    else:
        torch.manual_seed(seed)
        model = cls(_config_for(cls, config))
        source = "random weights"
    return model.eval(), data_config(name, model), source


def _size(value: Any, key: str) -> Optional[int]:
    """One entry of an image processor's size dict (a dict or its ``SizeDict``)."""
    if value is None:
        return None
    found = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
    return None if found is None else int(found)


def data_config(name: str, model: nn.Module) -> Dict[str, Any]:
    """The model's image processor (``preprocessor_config.json``) as a timm data config.

    A processor that resizes to a fixed height and width (then maybe crops) is timm's
    ``"squash"`` mode; one that resizes the shortest edge and crops is timm's ``"center"``
    mode with ``crop_pct = crop / shortest edge``. Without a processor the model's own
    image size is used, normalised to [-1, 1] (mean and std 0.5, as ViT's processor does),
    and ``"processor": None`` says so.
    """
    transformers = _transformers()
    vision = vision_config(model)
    channels, side = int(getattr(vision, "num_channels", 3)), int(vision.image_size)
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(name)
    except Exception:
        return {"input_size": (channels, side, side), "interpolation": "bilinear", "mean": (0.5,) * channels,
                "std": (0.5,) * channels, "crop_pct": 1.0, "crop_mode": "squash", "processor": None}
    size, crop = getattr(processor, "size", None), getattr(processor, "crop_size", None)
    height, width = _size(size, "height"), _size(size, "width")
    shortest = _size(size, "shortest_edge")
    if height and width:
        mode, scale = "squash", (height, width)
    else:
        mode, scale = "center", (shortest or side,) * 2
    crop_height, crop_width = _size(crop, "height"), _size(crop, "width")
    cropping = bool(getattr(processor, "do_center_crop", False))
    out = (crop_height, crop_width) if cropping and crop_height and crop_width else scale
    crop_pct = min(o / (s + 1e-6) for o, s in zip(out, scale))  # timm scales by floor(out / crop_pct)
    normalize = getattr(processor, "do_normalize", True)
    mean = tuple(processor.image_mean) if normalize else (0.0,) * channels
    std = tuple(processor.image_std) if normalize else (1.0,) * channels
    resample = getattr(processor, "resample", 2)
    return {"input_size": (channels, *out), "interpolation": _RESAMPLE.get(int(resample), "bilinear"),
            "mean": mean, "std": std, "crop_pct": min(crop_pct, 1.0),
            "crop_mode": mode, "processor": type(processor).__name__}


def preprocessing_note(config: Dict[str, Any]) -> Optional[str]:
    """What a user should know about the preprocessing of ``config``, or ``None``: said when
    a ``transformers`` model came without an image processor and defaults were used."""
    if "processor" not in config or config["processor"] is not None:
        return None
    height, width = config["input_size"][-2:]
    return (f"no image processor config was saved with this model: images are resized to {height}x{width} and "
            f"normalised with mean and std 0.5 (save the processor beside the model to use its own)")
