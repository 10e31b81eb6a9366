"""The shipped checkpoints and test subsets, and the demo that uses them."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitprune
from conftest import PAPER, small_vit
from vitprune.data import datasets
from vitprune.commands.cli import main
from vitprune.commands.demo import settings_of
from vitprune.data.shipped import (build, checkpoint_path, load_checkpoint, load_shipped, load_test_subset,
                                   subset_path)
from vitprune.data.accuracy import accuracy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpu_checks import agreement  # noqa: E402  (kept-set agreement, as the CUDA checks measure it)


@pytest.mark.parametrize("dataset", datasets.DATASETS)
def test_shipped_files_are_small_and_say_how_they_were_made(dataset):
    assert checkpoint_path(dataset).stat().st_size < 10 * 2**20
    assert subset_path(dataset).stat().st_size < 10 * 2**20
    model, record = load_shipped(dataset)
    assert record["command"].startswith("python examples/train_small_vit.py")
    assert record["dataset"] == dataset and isinstance(record["seed"], int)
    assert isinstance(model, torch.nn.Module) and not model.training
    images, labels = load_test_subset(dataset)
    assert images.dtype == torch.uint8 and len(images) == len(labels) == 2000
    assert images.shape[1:] == tuple(model.patch_embed.img_size)


def saved_and_loaded(tmp_path, dataset, **model_args):
    """A model built with ``model_args``, saved as a train_small_vit.py record and loaded back
    with ``load_checkpoint``, which must give its logits exactly: (built, loaded, record kept)."""
    model = build(dataset, **model_args)
    torch.save({"dataset": dataset, "model_args": model_args, "seed": 0, "state_dict": model.state_dict()},
               tmp_path / "saved.pt")
    loaded, kept = load_checkpoint(tmp_path / "saved.pt")
    side = model.patch_embed.img_size[0]
    x = torch.randn(2, 1, side, side)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), model.eval()(x), rtol=0, atol=0)
    return model, loaded, kept


def test_a_checkpoint_of_another_depth_loads_at_its_depth(tmp_path):
    _, loaded, kept = saved_and_loaded(tmp_path, "fashion_mnist", depth=3)
    assert len(loaded.blocks) == 3 and "state_dict" not in kept
    with pytest.raises(ValueError, match="depth must be a positive"):
        build("fashion_mnist", depth=0)


@pytest.mark.parametrize("dataset, patch_size", [("fashion_mnist", 2), ("cluttered", 4)])
def test_a_checkpoint_with_smaller_patches_loads_with_them(tmp_path, dataset, patch_size):
    """deit_small's 196 patches on our data: the patch size travels in the record."""
    model, loaded, _ = saved_and_loaded(tmp_path, dataset, depth=2, patch_size=patch_size)
    assert model.patch_embed.num_patches == loaded.patch_embed.num_patches == 196
    assert model.pos_embed.shape[1] == 197


def test_a_patch_size_that_does_not_divide_the_images_is_refused():
    with pytest.raises(ValueError, match=r"patch_size must divide the 28-pixel fashion_mnist images; "
                                         r"accepted: 1, 2, 4, 7, 14, 28; got 3"):
        build("fashion_mnist", patch_size=3)
    with pytest.raises(ValueError, match="accepted: 1, 2, 4, 7, 8, 14, 28, 56; got 0"):
        build("cluttered", patch_size=0)


@pytest.mark.parametrize("options, named", [
    ({"patch_size": 2.0}, "patch_size must be a whole number (int), got float 2.0"),
    ({"patch_size": True}, "patch_size must be a whole number (int), got bool True"),
    ({"depth": 3.0}, "depth must be a whole number (int), got float 3.0"),
])
def test_a_size_that_is_not_a_whole_number_is_refused(options, named):
    """Handed on, a float patch size failed inside torch's ``empty`` while timm built the
    patch convolution, with a message that named neither: refused by name before."""
    with pytest.raises(TypeError, match=re.escape(named)):
        build("fashion_mnist", **options)


def test_numpy_integers_are_whole_numbers():
    model = build("fashion_mnist", depth=np.int64(2), patch_size=np.int64(2))
    assert len(model.blocks) == 2 and model.patch_embed.num_patches == 196


def test_the_fashion_mnist_model_meets_its_accuracy_target():
    _, record = load_shipped("fashion_mnist")
    assert record["test_accuracy"] >= 0.89  # on the full 10,000-image test split, when trained


@pytest.mark.parametrize("dataset", datasets.DATASETS)
def test_subset_accuracy_matches_the_recorded_full_test_accuracy(dataset):
    model, record = load_shipped(dataset)
    images, labels = load_test_subset(dataset)
    # 2,000 of the 10,000 test images, float16-stored weights: within 2 points
    assert abs(accuracy(model, images, labels) - record["test_accuracy"]) < 0.02


@pytest.mark.parametrize("dataset", datasets.DATASETS)
def test_a_bfloat16_model_merges_the_tokens_its_float32_self_does(dataset):
    """The matching works in float32 whatever the model's dtype (``merging.key_metric``): with
    bfloat16 weights the defaults keep 99 % of the patches the float32 model keeps at every
    stage (in bfloat16 the matching kept 89 to 96 %, as cosines of near copies tie)."""
    model, _ = load_shipped(dataset)
    x = datasets.to_input(load_test_subset(dataset)[0])
    vitprune.patch(model, keep_rate=0.7)
    with torch.inference_mode():
        model(x)
        reference = vitprune.kept_positions(model)
        model.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert agreement(reference, vitprune.kept_positions(model)) > 0.98


@pytest.mark.slow
def test_demo_runs_and_writes_a_plot(tmp_path, capsys):
    out = tmp_path / "demo.png"
    code = main(["demo", "--datasets", "fashion_mnist", "--keep-rates", "0.7", "--rounds", "1", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "var keep 0.7" in text and "medad keep 0.7" in text and "unpruned" in text
    assert "default keep 0.7" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    width, height = Image.open(out).size
    assert height > width  # one column, two panels: against GFLOPs, then against measured speedup


def test_the_demos_paper_rows_run_the_papers_method():
    # its three stages, the top-scored tokens, one fusion token, plain attention: not the
    # defaults' schedule with the paper's indicator
    paper_rows = [(rate, options) for method, rate, options in settings_of(["var", "medad"], [0.7])
                  if method.endswith("(paper)")]
    assert len(paper_rows) == 2
    for rate, options in paper_rows:
        config = vitprune.get_config(vitprune.patch(small_vit(), keep_rate=rate, **options))
        expected = vitprune.get_config(vitprune.patch(small_vit(), keep_rate=rate, indicator=options["indicator"],
                                                      **PAPER))
        assert config == expected and config.stages == (3, 6, 9)


@pytest.mark.parametrize("options, message", [
    (["--keep-rates", "0"], "keep rates must be in (0, 1]"),
    (["--out", "demo.jpg"], "must be a .png"),
])
def test_demo_bad_options(options, message, capsys):
    assert main(["demo", *options]) == 2
    assert message in capsys.readouterr().err
