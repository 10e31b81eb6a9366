"""Images from a folder tree (or anything ``timm.data.create_dataset`` reads), preprocessed by
timm's own transforms from the model's data config, in batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import timm.data
import torch
from torch.utils.data import DataLoader, Subset


def eval_transform(config: Dict[str, Any]) -> Callable[[Any], torch.Tensor]:
    """timm's evaluation transform for a data config (``resolve_data_config``'s dict)."""
    return timm.data.create_transform(
        input_size=config["input_size"], is_training=False, interpolation=config.get("interpolation", "bilinear"),
        mean=config["mean"], std=config["std"], crop_pct=config.get("crop_pct"), crop_mode=config.get("crop_mode"))


def open_images(data_dir: str, split: str, config: Dict[str, Any]) -> Any:
    """The dataset with timm's eval transform for ``config`` (``resolve_data_config``'s dict).

    Raises:
        FileNotFoundError: ``data_dir`` is not a folder.
        ValueError: It holds no images timm can read, or the first cannot be decoded.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no such data folder: {data_dir}")
    channels = int(config["input_size"][0])
    try:
        dataset = timm.data.create_dataset("", root=str(root), split=split, is_training=False,
                                           input_img_mode="L" if channels == 1 else "RGB")
    except Exception as error:  # timm's reader refuses a folder it cannot parse, or an empty one
        if "Found 0" in str(error):
            raise ValueError(f"{data_dir} holds no images (expected one sub-folder per class)") from None
        raise ValueError(f"cannot read {data_dir} as an image folder: {str(error).splitlines()[0]}") from None
    if len(dataset) == 0:
        raise ValueError(f"{data_dir} holds no images (expected one sub-folder per class)")
    dataset.transform = eval_transform(config)
    try:
        dataset[0]  # one image read now, not an error after minutes of work
    except Exception as error:
        raise ValueError(f"cannot read the images in {data_dir}: {str(error).splitlines()[0]}") from None
    return dataset


def class_names(dataset: Any) -> List[str]:
    """The class of each label index, as the reader found them (sorted folder names)."""
    reader = getattr(dataset, "reader", None)
    mapping = getattr(reader, "class_to_idx", None) or {}
    return [name for name, _ in sorted(mapping.items(), key=lambda item: item[1])]


def spread(count: int, limit: Optional[int]) -> List[int]:
    """``limit`` indices evenly spread over ``range(count)`` (all of them without a limit),
    so a limited run samples every class of a class-sorted folder."""
    if limit is None or limit >= count:
        return list(range(count))
    return [int(i) for i in torch.linspace(0, count - 1, limit).round().long().unique()]


def batches(dataset: Any, batch_size: int, workers: int = 0, limit: Optional[int] = None) -> "DataLoader[Any]":
    """Batches of ``(images, labels)`` in order, of all images or ``limit`` spread over them."""
    chosen = spread(len(dataset), limit)
    subset = dataset if len(chosen) == len(dataset) else Subset(dataset, chosen)
    return DataLoader(subset, batch_size=batch_size, shuffle=False, num_workers=workers)
