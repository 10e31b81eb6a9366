"""Train a small timm ViT from scratch on Fashion-MNIST or its cluttered variant, on CPU.

    python examples/train_small_vit.py --dataset fashion_mnist --seed 0 --out vitprune/assets/fashion_mnist_vit.pt
    python examples/train_small_vit.py --dataset cluttered --patch-size 4 --seed 0 --steps 2000 \
        --out runs/cluttered_p4_seed0.pt   # 14 x 14 = 196 patches, deit_small's count at 224 pixels

A fixed, step-based schedule (AdamW, linear warm-up, cosine decay; random shifts and
horizontal flips), reproducible from --seed. The checkpoint records the config, the
seed, this command, the test accuracy on the full test set and the training time.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vitprune.data import datasets
from vitprune.data import shipped as demo_models
from vitprune.data.accuracy import accuracy as evaluate


def augment(images: torch.Tensor, generator: torch.Generator, shift: int) -> torch.Tensor:
    """Random translations of up to ``shift`` pixels (zero fill) and horizontal flips."""
    n, _, h, w = images.shape
    padded = F.pad(images, (shift, shift, shift, shift), value=float(images.min()))
    offsets = torch.randint(0, 2 * shift + 1, (n, 2), generator=generator).tolist()
    out = torch.stack([padded[i, :, y:y + h, x:x + w] for i, (y, x) in enumerate(offsets)])
    flip = torch.rand(n, generator=generator) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def train(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, dataset: str, *, steps: int,
          batch: int, lr: float, warmup: int, seed: int, desc: str = "train") -> None:
    """AdamW (weight decay 0.05 on matrices only), linear warm-up then cosine decay, label
    smoothing 0.1, random shifts and flips; batches drawn without replacement, per epoch."""
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "token" in n or "pos_embed" in n]
    decay = [p for n, p in model.named_parameters() if not (p.ndim < 2 or "token" in n or "pos_embed" in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    generator = torch.Generator().manual_seed(seed)
    shift = 2 if dataset == "fashion_mnist" else 4
    order = torch.randperm(len(images), generator=generator)
    cursor = 0
    model.train()
    for step in tqdm(range(steps), desc=desc, file=sys.stderr):
        if cursor + batch > len(order):
            order, cursor = torch.randperm(len(images), generator=generator), 0
        index = order[cursor:cursor + batch]
        cursor += batch
        x = augment(datasets.to_input(images[index]), generator, shift)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup)
        loss = F.cross_entropy(model(x), labels[index], label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=datasets.DATASETS, default="fashion_mnist")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depth", type=int, default=None, help="blocks (default: the shipped models' 6)")
    parser.add_argument("--patch-size", type=int, default=None,
                        help="patch side in pixels (default: the shipped models' 7 x 7 grid, 4 on Fashion-MNIST "
                             "and 8 on the cluttered canvas; half that gives deit_small's 196 patches)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train_images, train_labels = datasets.load(args.dataset, "train")
    test_images, test_labels = datasets.load(args.dataset, "test")
    model = demo_models.build(args.dataset, args.depth, args.patch_size)
    start = time.time()
    train(model, train_images, train_labels, args.dataset, steps=args.steps, batch=args.batch, lr=args.lr,
          warmup=args.warmup, seed=args.seed, desc=f"train {args.dataset} seed {args.seed}")
    seconds = time.time() - start
    accuracy = evaluate(model, test_images, test_labels)
    print(f"{args.dataset} seed {args.seed}: test accuracy {accuracy:.4f} after {args.steps} steps, {seconds / 60:.1f} min")
    torch.save({
        "dataset": args.dataset, "seed": args.seed,
        "model_args": {**demo_models.MODEL_ARGS[args.dataset], "depth": len(model.blocks),
                       "patch_size": model.patch_embed.patch_size[0]},
        "steps": args.steps, "batch": args.batch, "lr": args.lr, "test_accuracy": accuracy,
        "train_seconds": seconds, "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "torch": str(torch.__version__), "state_dict": model.state_dict(),
    }, args.out)


if __name__ == "__main__":
    main()
