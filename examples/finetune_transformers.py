"""Fine-tune a Hugging Face ViT with ``transformers.Trainer`` while vitprune reduces its
tokens: a plain Trainer script plus one line (``vitprune.patch``).

    python examples/finetune_transformers.py --steps 100            # the shipped Fashion-MNIST images
    python examples/finetune_transformers.py --model google/vit-base-patch16-224 ...   # your weights

Without ``--model`` a small ViT is built from a config with random weights (nothing is
downloaded) and trained on the shipped Fashion-MNIST test subset, upscaled to 3 channels.
"""

from __future__ import annotations

import argparse
from typing import Dict, Optional

import torch
import transformers as T

import vitprune
from vitprune.data.datasets import to_input
from vitprune.data.shipped import load_test_subset


class Images(torch.utils.data.Dataset):
    """``{"pixel_values", "labels"}`` items, as Trainer passes them to the model."""

    def __init__(self, pixels: torch.Tensor, labels: torch.Tensor) -> None:
        self.pixels, self.labels = pixels, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[index], "labels": self.labels[index]}


def shipped_images(size: int, limit: Optional[int] = None) -> Images:
    """The shipped Fashion-MNIST subset as 3-channel ``size`` x ``size`` model inputs."""
    images, labels = load_test_subset("fashion_mnist")
    images, labels = images[:limit], labels[:limit]
    x = torch.nn.functional.interpolate(to_input(images), size=(size, size), mode="bilinear", align_corners=False)
    return Images(x.expand(-1, 3, -1, -1).contiguous(), labels)


def small_vit(num_labels: int = 10) -> T.ViTForImageClassification:
    config = T.ViTConfig(image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=128, num_labels=num_labels)
    return T.ViTForImageClassification(config)


def main(argv: Optional[list] = None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a transformers checkpoint (default: a small random ViT)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--keep-rate", type=float, default=0.7)
    parser.add_argument("--limit", type=int, default=None, help="use the first N shipped images")
    parser.add_argument("--out", default="runs/finetune_transformers")
    args = parser.parse_args(argv)

    model = (T.AutoModelForImageClassification.from_pretrained(args.model, num_labels=10,
                                                               ignore_mismatched_sizes=True)
             if args.model else small_vit())
    vitprune.patch(model, keep_rate=args.keep_rate)  # the one line

    size = model.config.image_size
    data = shipped_images(size, args.limit)
    split = len(data) * 4 // 5
    train = Images(data.pixels[:split], data.labels[:split])
    test = Images(data.pixels[split:], data.labels[split:])
    trainer = T.Trainer(
        model=model,
        args=T.TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=32,
                                 learning_rate=5e-4, report_to=[], save_strategy="no", logging_steps=10,
                                 use_cpu=not torch.cuda.is_available()),
        train_dataset=train,
        eval_dataset=test,
        compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())},
    )
    trainer.train()
    metrics = trainer.evaluate()
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
    return metrics


if __name__ == "__main__":
    main()
