"""``vitprune show IMAGE``: draw which patches a pruned model keeps in one image."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from ..core.config import method_options
from ..core.patching import patch
from ..data import models
from ..data.hf_models import preprocessing_note
from ..data.pictures import load_picture, prepare_greyscale, prepare_timm
from ..pictures import pyplot

if TYPE_CHECKING:
    import torch
    from torch import nn


def load_model(name: Optional[str], checkpoint: Optional[str], pretrained: bool
               ) -> "Tuple[nn.Module, Callable[[Any], Tuple[torch.Tensor, torch.Tensor]], str]":
    """``(model, prepare, where its weights come from)``: a timm or ``hf:`` model by name
    (``prepare(picture)`` is its own preprocessing), or a checkpoint of vitprune's own models."""
    if checkpoint is not None:
        model, config, source = models.load_model(None, checkpoint, False)
        return model, functools.partial(prepare_greyscale, config), source
    model, config, source = models.load_model(name, None, pretrained)
    note = preprocessing_note(config)
    if note:
        print(f"note: {note}")
    return model, functools.partial(prepare_timm, config), source


def main(args: argparse.Namespace) -> int:
    from ..pictures.visualize import visualize

    try:
        pyplot(files_only=True)  # a command writes files: no window
        if not args.out.lower().endswith(".png"):
            raise ValueError(f"--out must be a .png file, got {args.out!r}")
        picture = load_picture(args.image)
        model, prepare, source = load_model(args.model, args.checkpoint, args.pretrained)
        if source == "random weights":
            print(f"note: {args.model} has random weights (no --pretrained or --checkpoint): what it keeps says "
                  "nothing about the image")
        patch(model, keep_rate=args.keep_rate, overlap_stride=args.overlap_stride,
              **method_options(args.indicator, args.stages))
        x, display = prepare(picture)
        figure = visualize(model, x, display, show=args.view)
        figure.savefig(args.out, dpi=100)
    except (FileNotFoundError, ImportError, ValueError, TypeError) as error:
        print(f"vitprune show: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
