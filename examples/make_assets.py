"""Write the files vitprune ships: test subsets, and the trained checkpoints copied in.

    python examples/make_assets.py --checkpoints runs/fashion_mnist_seed0.pt runs/cluttered_seed0.pt

Test subsets: the first 2,000 images of each dataset's test split (needs
``apt-get install dataset-fashion-mnist``). Checkpoints are stored in float16 (half the
size; the model is float32 again once loaded) under ``vitprune/assets/``.
"""

from __future__ import annotations

import argparse

import torch

from vitprune.data import datasets
from vitprune.data import shipped as demo_models

SUBSET = 2000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="*", default=[], help="checkpoints from train_small_vit.py")
    args = parser.parse_args()
    demo_models.ASSETS.mkdir(exist_ok=True)
    for dataset in datasets.DATASETS:
        images, labels = datasets.load(dataset, "test")
        path = demo_models.save_test_subset(dataset, images[:SUBSET], labels[:SUBSET])
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    for source in args.checkpoints:
        with torch.serialization.safe_globals([torch.torch_version.TorchVersion]):
            record = torch.load(source, map_location="cpu", weights_only=True)
        record["state_dict"] = {k: v.half() for k, v in record["state_dict"].items()}
        record["torch"] = str(record["torch"])
        path = demo_models.checkpoint_path(record["dataset"])
        torch.save(record, path)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB), test accuracy {record['test_accuracy']:.4f}")


if __name__ == "__main__":
    main()
