"""Prune a timm ViT at inference: one added line, then compare with the unpruned model.

    python examples/inference.py                                  # random weights, no download
    python examples/inference.py --pretrained --image cat.jpg     # with weights you have

With random weights the predictions mean nothing; the script still shows the token
schedule, the FLOPs saved, the speedup and how often pruned and unpruned agree.
"""

from __future__ import annotations

import argparse
import copy
import time

import timm
import torch
from PIL import Image

import vitprune
from vitprune.measure.flops import analytic_flops
from vitprune.data.pictures import prepare_timm


def load_input(model: torch.nn.Module, image: str | None, batch: int) -> torch.Tensor:
    """The image through the model's own preprocessing, or a seeded random batch."""
    if image is None:
        return torch.randn(batch, 3, *model.patch_embed.img_size, generator=torch.Generator().manual_seed(0))
    return prepare_timm(model, Image.open(image))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--pretrained", action="store_true", help="load timm's weights (needs them cached)")
    parser.add_argument("--image", default=None, help="an image file; default: a random batch")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--indicator", default=None, choices=vitprune.INDICATORS,
                        help="choose tokens by this score (the paper's top-k) instead of the defaults' matching")
    parser.add_argument("--keep-rate", type=float, default=0.7)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=args.pretrained).eval()
    x = load_input(model, args.image, args.batch)
    pruned = copy.deepcopy(model)

    vitprune.patch(pruned, indicator=args.indicator, keep_rate=args.keep_rate)  # the one line

    with torch.inference_mode():
        model(x), pruned(x)  # warm-up
        start = time.perf_counter()
        full_logits = model(x)
        middle = time.perf_counter()
        pruned_logits = pruned(x)
        end = time.perf_counter()

    config = vitprune.get_config(pruned)
    counts = [p.shape[1] for p in vitprune.kept_positions(pruned)]
    agree = (full_logits.argmax(-1) == pruned_logits.argmax(-1)).float().mean().item()
    print(f"{args.model}: {config.selection} selection ({config.indicator or 'no indicator'}), "
          f"{config.reduction}, keep {config.keep_rate} at blocks {config.stages}")
    print(f"non-prefix tokens after each stage: {counts} (of {model.patch_embed.num_patches})")
    print(f"GFLOPs per image: {analytic_flops(model) / 1e9:.2f} -> {analytic_flops(pruned) / 1e9:.2f}")
    print(f"speedup for {x.shape[0]} image(s), one timed pass each (noisy; vitprune bench measures properly): "
          f"{(middle - start) / (end - middle):.2f}x")
    print(f"top-1 agreement with the unpruned model: {agree:.1%}")
    if args.image is not None:
        top = pruned_logits.softmax(-1)[0].topk(5)
        print("pruned top-5 (class index: probability):",
              ", ".join(f"{i}: {p:.3f}" for p, i in zip(top.values.tolist(), top.indices.tolist())))


if __name__ == "__main__":
    main()
