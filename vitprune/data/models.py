"""A model for the commands, by timm name (random, pretrained or from a checkpoint), as
one of vitprune's own small models, or as ``hf:NAME_OR_FOLDER`` for a ``transformers`` one
(``hf_models``), with the preprocessing that belongs to it."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import timm
import torch
from torch import nn

from .hf_models import is_transformers_name, load_transformers_model

HUB_HOST = "huggingface.co"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers a connection within ``timeout`` seconds."""
    answered = []

    def probe() -> None:
        try:
            socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def offline_unless_reachable() -> bool:
    """Put the Hugging Face hub client offline (cache only) when the hub cannot be reached,
    so loading uncached pretrained weights fails at once instead of after a minute of
    retries. Returns whether it went offline."""
    if os.environ.get("HF_HUB_OFFLINE") or hub_reachable():
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import huggingface_hub.constants as constants

        constants.HF_HUB_OFFLINE = True  # read at call time by the download functions
    except ImportError:
        pass
    return True


def is_own_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint of vitprune's own small models (a record with its dataset)."""
    try:
        record = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return False
    return isinstance(record, dict) and {"dataset", "state_dict"} <= set(record)


def load_model(name: Optional[str], checkpoint: Optional[str], pretrained: bool,
               img_size: Optional[int] = None) -> Tuple[nn.Module, Dict[str, Any], str]:
    """The model in eval mode, its timm data config, and a phrase saying where its weights came from.

    ``name`` is a timm model name or ``hf:`` and a ``transformers`` hub id or saved folder.

    Raises:
        ImportError: An ``hf:`` model without ``transformers`` installed.
        FileNotFoundError: No such checkpoint.
        ValueError: An unknown model, a checkpoint that does not fit it, or pretrained
            weights that cannot be had (no network and not cached).
    """
    if checkpoint is not None and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"no such checkpoint: {checkpoint}")
    if checkpoint is not None and name is None:
        if not is_own_checkpoint(Path(checkpoint)):
            raise ValueError(f"cannot load checkpoint {checkpoint}: it is not one of vitprune's own small models "
                             "(for a timm checkpoint, name its model with --model)")
        from .shipped import data_config, load_checkpoint

        try:
            model, record = load_checkpoint(Path(checkpoint))
        except Exception as error:  # a damaged file: say which, not a traceback
            raise ValueError(f"cannot load checkpoint {checkpoint}: {str(error).splitlines()[0]}") from None
        return model, data_config(model), f"vitprune's {record['dataset']} model ({checkpoint})"
    if name is None:
        raise ValueError("name a model (--model NAME) or give one of vitprune's own checkpoints (--checkpoint)")
    if is_transformers_name(name):
        if checkpoint is not None:
            raise ValueError(f"--checkpoint does not apply to {name}: give a saved transformers model's folder "
                             "as --model hf:FOLDER")
        if img_size is not None:
            raise ValueError(f"--img-size does not apply to {name}: a transformers model runs at its config's "
                             "image size")
        return load_transformers_model(name, pretrained)
    if not timm.is_model(name):
        raise ValueError(f"unknown timm model {name!r}")
    kwargs: Dict[str, Any] = {} if img_size is None else {"img_size": img_size}
    if pretrained:
        offline_unless_reachable()
    try:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except TypeError as error:
        raise ValueError(f"cannot build {name}: {error}") from None
    except Exception as error:  # no network and no cache: one line, not a traceback
        if not pretrained:
            raise
        raise ValueError(f"cannot load pretrained weights for {name} (no network and not in the cache?): "
                         f"{str(error).splitlines()[0]}") from None
    source = "pretrained weights" if pretrained else "random weights"
    if checkpoint is not None:
        try:
            timm.models.load_checkpoint(model, checkpoint)
        except Exception as error:
            raise ValueError(f"checkpoint {checkpoint} does not fit {name}: {str(error).splitlines()[0]}") from None
        source = f"weights from {checkpoint}"
    config = timm.data.resolve_data_config({} if img_size is None else {"input_size": (3, img_size, img_size)},
                                           model=model)
    return model.eval(), config, source
