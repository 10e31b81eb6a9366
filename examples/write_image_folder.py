"""Write a shipped test subset as an image-folder tree (one folder per class, PNG files),
the layout ``vitprune eval --data-dir`` reads, e.g.:

    python examples/write_image_folder.py --dataset fashion_mnist --out /tmp/fashion_mnist
    vitprune eval --checkpoint vitprune/assets/fashion_mnist_vit.pt --data-dir /tmp/fashion_mnist
"""

import argparse
from pathlib import Path

from PIL import Image

from vitprune.data import DATASETS
from vitprune.data.shipped import load_test_subset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="fashion_mnist")
    parser.add_argument("--out", required=True, help="the folder to write (created)")
    args = parser.parse_args()
    images, labels = load_test_subset(args.dataset)
    root = Path(args.out)
    for index, (image, label) in enumerate(zip(images, labels)):
        folder = root / f"{int(label)}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image.numpy()).save(folder / f"{index:05d}.png")  # uint8 (H, W): mode L
    print(f"wrote {len(images)} images in {len(set(labels.tolist()))} class folders under {root}")


if __name__ == "__main__":
    main()
