"""``vitprune show IMAGE``: draw which patches a pruned model keeps in one image."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import timm

from ..core.patching import patch
from ..pictures import pyplot
from ..data.pictures import load_picture, prepare_greyscale, prepare_timm


def load_model(name: Optional[str], checkpoint: Optional[str], pretrained: bool):
    """``(model, prepare)``: a timm model by name, or a checkpoint of vitprune's own models."""
    if checkpoint is not None:
        from ..data.shipped import load_checkpoint

        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"no such checkpoint: {checkpoint}")
        try:
            model, _ = load_checkpoint(Path(checkpoint))
        except Exception as error:  # a corrupt or foreign file: say which, not a traceback
            raise ValueError(f"cannot load checkpoint {checkpoint}: {error}") from None
        return model, prepare_greyscale
    if not timm.is_model(name):
        raise ValueError(f"unknown timm model {name!r}")
    return timm.create_model(name, pretrained=pretrained).eval(), prepare_timm


def main(args: argparse.Namespace) -> int:
    from ..pictures.visualize import visualize

    try:
        pyplot(files_only=True)  # a command writes files: no window
        if not args.out.lower().endswith(".png"):
            raise ValueError(f"--out must be a .png file, got {args.out!r}")
        picture = load_picture(args.image)
        model, prepare = load_model(args.model, args.checkpoint, args.pretrained)
        patch(model, indicator=args.indicator, keep_rate=args.keep_rate, stages=args.stages,
              overlap_stride=args.overlap_stride)
        x, display = prepare(model, picture)
        figure = visualize(model, x, display)
        figure.savefig(args.out, dpi=100)
    except (FileNotFoundError, ImportError, ValueError, TypeError) as error:
        print(f"vitprune show: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
