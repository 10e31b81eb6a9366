"""Fine-tune with pruning active: a plain PyTorch training loop plus one line.

    python examples/finetune.py

The task is made up so the script runs anywhere in seconds: 32x32 images of noise with
one bright 8x8 square, labelled by the quadrant it lies in. The loop is ordinary; only
``vitprune.patch`` is added, and the checkpoint it saves loads into an unpatched model.
"""

from __future__ import annotations

import argparse

import timm
import torch
import torch.nn.functional as F

import vitprune


def quadrant_batch(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise images with one bright square; the label is the quadrant holding its centre."""
    images = 0.2 * torch.randn(batch, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 4, (batch,), generator=generator)
    offsets = torch.randint(0, 9, (batch, 2), generator=generator)
    for i, (label, (dy, dx)) in enumerate(zip(labels.tolist(), offsets.tolist())):
        top, left = 16 * (label // 2) + dy // 2, 16 * (label % 2) + dx // 2
        images[i, :, top:top + 8, left:left + 8] += 2.0
    return images, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--keep-rate", type=float, default=0.5)
    parser.add_argument("--out", default=None, help="save the fine-tuned state_dict here")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=96, depth=6, num_heads=3, num_classes=4,
    )
    vitprune.patch(model, keep_rate=args.keep_rate)  # the one added line (the measured-best defaults)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.Generator().manual_seed(1)
    model.train()
    for step in range(1, args.steps + 1):
        images, labels = quadrant_batch(64, data)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")

    model.eval()
    images, labels = quadrant_batch(1000, torch.Generator().manual_seed(2))
    with torch.no_grad():
        accuracy = (model(images).argmax(-1) == labels).float().mean().item()
    kept = [p.shape[1] for p in vitprune.kept_positions(model)]
    print(f"held-out accuracy with pruning: {accuracy:.1%} (tokens after each stage: {kept} of 64)")
    if args.out:
        torch.save(vitprune.unpatch(model).state_dict(), args.out)  # plain timm weights
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
