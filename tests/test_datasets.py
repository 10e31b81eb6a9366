"""The data loaders: IDX parsing by hand, the cluttered canvas, and real Fashion-MNIST when installed."""

import gzip
import struct

import pytest
import torch

from vitprune.data import datasets

HAVE_FASHION_MNIST = (datasets.FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz").exists()
needs_data = pytest.mark.skipif(not HAVE_FASHION_MNIST, reason="apt-get install dataset-fashion-mnist")


def write_idx(path, values, shape):
    header = b"\x00\x00\x08" + bytes([len(shape)]) + b"".join(struct.pack(">I", s) for s in shape)
    with gzip.open(path, "wb") as out:
        out.write(header + bytes(values))


def test_read_idx_by_hand(tmp_path):
    write_idx(tmp_path / "x.gz", range(24), (2, 3, 4))
    data = datasets.read_idx(tmp_path / "x.gz")
    assert data.shape == (2, 3, 4) and data.dtype == torch.uint8
    assert data[1, 2, 3].item() == 23 and data[0, 1, 0].item() == 4


def test_read_idx_rejects_other_files(tmp_path):
    with gzip.open(tmp_path / "bad.gz", "wb") as out:
        out.write(b"\x00\x00\x0d\x01" + struct.pack(">I", 1) + b"\x00" * 4)  # float IDX
    with pytest.raises(ValueError, match="unsigned-byte IDX"):
        datasets.read_idx(tmp_path / "bad.gz")


def test_missing_data_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        datasets.load_fashion_mnist("test", root=tmp_path)
    with pytest.raises(ValueError, match="'train' or 'test'"):
        datasets.load_fashion_mnist("validation", root=tmp_path)
    with pytest.raises(ValueError, match="accepted: fashion_mnist, cluttered"):
        datasets.load("mnist", "test")


def test_clutter_canvas_is_deterministic_and_holds_the_object():
    images = torch.zeros(5, 28, 28, dtype=torch.uint8)
    images[:, 10:18, 10:18] = 200
    a, b = datasets.clutter_canvas(images, seed=3), datasets.clutter_canvas(images, seed=3)
    assert a.shape == (5, 56, 56) and torch.equal(a, b)
    assert not torch.equal(a, datasets.clutter_canvas(images, seed=4))
    assert ((a == 200).flatten(1).sum(1) >= 64).all()  # the object's 8x8 square is drawn in full
    assert (a.max() <= 200) and ((a > 0) & (a < 200)).any()  # dim clutter (brightness 0.5 of 200 = 100)


def test_to_input_normalises():
    x = datasets.to_input(torch.full((2, 28, 28), 255, dtype=torch.uint8))
    assert x.shape == (2, 1, 28, 28)
    assert torch.allclose(x, torch.full_like(x, (1 - datasets.MEAN) / datasets.STD))


@needs_data
def test_real_fashion_mnist_test_split():
    images, labels = datasets.load_fashion_mnist("test")
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    assert torch.bincount(labels).tolist() == [1000] * 10  # the test split is balanced
