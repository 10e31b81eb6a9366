"""The kept-patch pictures in README.

    pip install -e ".[docs]" && python examples/make_pictures.py [--out docs/images]

1. A real photograph that ships inside scikit-learn (``load_sample_image("china.jpg")``)
   through ``deit_small_patch16_224`` with random weights (nothing can be downloaded here):
   the choice of patches shows the mechanics only, not what a trained model attends to.
2. Fashion-MNIST and cluttered Fashion-MNIST test images through the shipped trained models.
3. The defaults (token merging in every block) on the shipped Fashion-MNIST model, drawn as
   the groups of patches each token holds (``show="groups"``).

Pictures 1 and 2 run the paper's method with var (``PAPER_OPTIONS``: its three stages, one
fusion token), as ``vitprune show --indicator var`` draws it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from PIL import Image

import vitprune
from vitprune.core.config import PAPER_OPTIONS
from vitprune.data import datasets, models
from vitprune.data.shipped import load_shipped, load_test_subset
from vitprune.data.pictures import prepare_timm

OUT = Path("docs/images")


def photograph() -> None:
    from sklearn.datasets import load_sample_image

    torch.manual_seed(0)
    model, config, _ = models.load_model("deit_small_patch16_224", None, pretrained=False)  # and its data config
    vitprune.patch(model, indicator="var", keep_rate=0.7, **PAPER_OPTIONS)  # the paper's stages: three panels
    x, display = prepare_timm(config, Image.fromarray(load_sample_image("china.jpg")))
    figure = vitprune.visualize(model, x, display)
    figure.suptitle("var, keep 0.7 - deit_small with RANDOM weights: mechanics only", fontsize=10)
    figure.savefig(OUT / "photo_random_weights.png", dpi=90)


def shipped(dataset: str, indicator: str = "var", keep_rate: float = 0.5, count: int = 4) -> None:
    model, _ = load_shipped(dataset)
    vitprune.patch(model, indicator=indicator, keep_rate=keep_rate, **PAPER_OPTIONS)
    images, labels = load_test_subset(dataset)
    x = datasets.to_input(images[:count])
    with torch.no_grad():
        predicted = model(x).argmax(-1).tolist()
    titles = [f"{datasets.CLASSES[p]}\n(true: {datasets.CLASSES[t]})" for p, t in zip(predicted, labels[:count].tolist())]
    figure = vitprune.visualize(model, x, images[:count].unsqueeze(1).float() / 255, titles=titles, panel_inches=1.8)
    figure.savefig(OUT / f"{dataset}_kept.png", dpi=90)


def merged_groups(dataset: str = "fashion_mnist", keep_rate: float = 0.5, count: int = 3) -> None:
    model, _ = load_shipped(dataset)
    vitprune.patch(model, keep_rate=keep_rate)  # the defaults: a few tokens merged in every block
    images, _ = load_test_subset(dataset)
    display = images[:count].unsqueeze(1).float() / 255
    figure = vitprune.visualize(model, datasets.to_input(images[:count]), display, show="groups", panel_inches=1.6)
    figure.savefig(OUT / f"{dataset}_groups.png", dpi=90)


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description="Draw the kept-patch pictures of README (needs scikit-learn: "
                                     'pip install -e ".[docs]").')
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder the pictures go to (default: {OUT})")
    OUT = parser.parse_args().out
    OUT.mkdir(parents=True, exist_ok=True)
    photograph()
    for dataset in datasets.DATASETS:
        shipped(dataset)
    merged_groups()
    print(f"wrote {sorted(p.name for p in OUT.glob('*.png'))}")


if __name__ == "__main__":
    main()
