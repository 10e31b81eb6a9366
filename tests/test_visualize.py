"""Kept-patch pictures: the drawn masks agree exactly with the recorded kept positions."""

import importlib.util
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image

import vitprune
from vitprune.commands.cli import main
from vitprune.core.config import PAPER_OPTIONS
from vitprune.data.shipped import load_shipped
from vitprune.pictures.visualize import BORDER, draw_panels, group_panels, kept_masks, patch_footprints, visualize


def small_model(**options):
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4).eval()
    return vitprune.patch(model, stages=(1, 3), **options)


def test_footprints_tile_the_image_without_overlap_and_overlap_with_a_smaller_stride():
    model = small_model(keep_rate=0.5)
    plain = patch_footprints(model, (64, 64))
    assert plain.shape == (16, 64, 64)
    assert (plain.sum(0) == 1).all()  # every pixel in exactly one patch
    assert plain[5, 16:32, 16:32].all() and plain[5].sum() == 256  # row 1, column 1
    overlapped = patch_footprints(small_model(keep_rate=0.5, overlap_stride=12), (64, 64))
    assert overlapped.shape == (25, 64, 64)  # (64 - 16) // 12 + 1 = 5 per side
    assert overlapped[1, 0:16, 12:28].all() and overlapped[1].sum() == 256
    assert (overlapped.sum(0) > 1).any()


@pytest.mark.parametrize("kernel, stride, padding", [(4, 4, 0), (4, 3, 1), (3, 2, "valid"), (3, 1, "same"),
                                                     (4, 1, "same"), ((3, 4), (2, 3), (1, 0))])
def test_a_footprint_is_the_pixels_its_token_reads(kernel, stride, padding, monkeypatch):
    # the pixels whose gradient reaches one output position of the convolution, torch's padding rules included
    conv = torch.nn.Conv2d(1, 1, kernel, stride=stride, padding=padding, bias=False)
    torch.nn.init.constant_(conv.weight, 1.0)
    monkeypatch.setattr("vitprune.pictures.visualize.patch_conv", lambda model: conv)
    footprints = patch_footprints(torch.nn.Identity(), (11, 10))
    image = torch.zeros(1, 1, 11, 10, requires_grad=True)
    with warnings.catch_warnings():  # torch may warn that an even kernel's "same" padding copies the input
        warnings.simplefilter("ignore")
        out = conv(image)[0, 0]
    assert footprints.shape[0] == out.numel()
    for token in range(out.numel()):
        reached, = torch.autograd.grad(out.flatten()[token], image, retain_graph=True)
        assert torch.equal(footprints[token], reached[0, 0] != 0), token


@pytest.mark.parametrize("keep_rate", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("overlap_stride", [None, 12])
def test_masks_agree_exactly_with_kept_positions(keep_rate, overlap_stride):
    model = small_model(keep_rate=keep_rate, overlap_stride=overlap_stride)
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        model(x)
    positions = vitprune.kept_positions(model)
    masks = kept_masks(model, (64, 64))
    footprints = patch_footprints(model, (64, 64))
    assert masks.shape == (3, len(positions), 64, 64)
    for s, stage in enumerate(positions):
        for b in range(3):
            expected = torch.zeros(64, 64, dtype=torch.bool)
            for p in stage[b].tolist():
                if p >= 0:
                    expected |= footprints[p]
            assert torch.equal(masks[b, s], expected)


def test_a_hybrids_tokens_tile_the_image_by_their_grid_and_draw():
    # the stem's 56x56 map cut by an 8x8 projection: 7x7 tokens of 32x32 pixels, not 784 of 8x8
    torch.manual_seed(0)
    model = vitprune.patch(timm.create_model("vit_tiny_r_s16_p8_224", depth=2).eval(), keep_rate=0.5)
    footprints = patch_footprints(model, (224, 224))
    assert footprints.shape == (49, 224, 224) and (footprints.sum(0) == 1).all()
    assert footprints[8, 32:64, 32:64].all() and footprints[8].sum() == 32 * 32  # row 1, column 1
    uneven = patch_footprints(model, (100, 130))  # a 3x4 grid: cells of 33-34 by 32-33 pixels
    assert uneven.shape == (12, 100, 130) and (uneven.sum(0) == 1).all()
    assert uneven[0, :34, :33].all() and uneven[0].sum() == 34 * 33  # rows r * 3 // 100 == 0: r < 33.4
    with torch.no_grad():
        model(torch.randn(2, 3, 224, 224))
    masks = kept_masks(model, (224, 224))
    kept = [p for p in vitprune.kept_positions(model)[-1][0].tolist() if p >= 0]
    assert torch.equal(masks[0, -1], footprints[kept].any(0))
    assert visualize(model, torch.randn(1, 3, 224, 224)) is not None


def test_drawn_panels_keep_kept_pixels_and_dim_pruned_ones():
    model = small_model(keep_rate=0.4)
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        model(x)
    masks = kept_masks(model, (64, 64))
    panels = draw_panels(x, masks, dim=0.25)
    assert panels.shape == (2, 1 + 2, 64, 64, 3)
    rgb = x.permute(0, 2, 3, 1)
    assert torch.equal(panels[:, 0], rgb)
    for s in range(2):
        kept = masks[:, s]
        assert torch.equal(panels[:, s + 1][kept], rgb[kept])
        assert not torch.isclose(panels[:, s + 1][~kept], rgb[~kept]).all()


def test_visualize_returns_a_figure_with_a_row_per_image(tmp_path):
    model = small_model(keep_rate=0.5)
    figure = visualize(model, torch.randn(2, 3, 64, 64), titles=["a", "b"])
    assert len(figure.axes) == 2 * 3
    assert figure.axes[1].get_title() == "after block 1: 8 kept"
    figure.savefig(tmp_path / "grid.png")
    assert Image.open(tmp_path / "grid.png").size[0] > Image.open(tmp_path / "grid.png").size[1]


def test_group_panels_by_hand():
    # a 2 x 6 image of three 2 x 2 patches: patches 0 and 1 merged into one token, patch 2 dropped
    image = torch.arange(12, dtype=torch.float32).view(1, 1, 2, 6) / 12
    footprints = torch.zeros(3, 2, 6, dtype=torch.bool)
    for p in range(3):
        footprints[p, :, 2 * p:2 * p + 2] = True
    panels = group_panels(image, [torch.tensor([[0, 0, -1]])], footprints, dim=0.25)
    assert panels.shape == (1, 2, 2, 6, 3)
    mean = image[0, 0, :, :4].mean()  # the group's mean colour
    rgb = image[0, 0, ..., None].expand(2, 6, 3)
    dimmed = draw_panels(image, torch.zeros(1, 1, 2, 6, dtype=torch.bool), 0.25)[0, 1]
    drawn = panels[0, 1]
    assert torch.equal(panels[0, 0], rgb)  # the input
    assert torch.allclose(drawn[:, :3], mean.expand(2, 3, 3))
    # column 3 borders the dropped patch: half the group's colour, half the border's
    assert torch.allclose(drawn[:, 3], (mean + torch.tensor(BORDER)).expand(2, 3) / 2)
    assert torch.equal(drawn[:, 4:], dimmed[:, 4:])


def test_visualize_draws_groups_and_refuses_an_unknown_view():
    model = small_model(keep_rate=0.5, indicator="var", selection="top", reduction="fuse")
    figure = visualize(model, torch.randn(2, 3, 64, 64), show="groups")
    assert len(figure.axes) == 2 * 3
    assert figure.axes[1].get_title() == "after block 1: 9 tokens"  # 8 kept and the fusion token
    with pytest.raises(ValueError, match="unknown show 'merged'; accepted: 'kept', 'groups'"):
        visualize(model, torch.randn(2, 3, 64, 64), show="merged")


@pytest.mark.parametrize("options, error, match", [
    ({"dim": 1.5}, ValueError, r"dim is the brightness of pruned pixels against kept ones, in \[0, 1\], got 1.5"),
    ({"dim": -0.1}, ValueError, r"in \[0, 1\], got -0.1"),  # both drew, clipped by matplotlib with a warning
    ({"dim": "0.5"}, TypeError, r"dim must be a number in \[0, 1\], got str '0.5'"),  # failed deep in torch
    ({"dim": float("nan")}, ValueError, r"in \[0, 1\], got nan"),
    ({"panel_inches": 0}, ValueError, r"panel_inches must be > 0 and finite, got 0"),  # numpy's 'Singular matrix'
    ({"panel_inches": float("inf")}, ValueError, r"panel_inches must be > 0 and finite, got inf"),
    ({"panel_inches": None}, TypeError, r"panel_inches must be a number > 0, got NoneType None"),
])
def test_visualize_refuses_a_bad_brightness_or_size_before_the_model_runs(options, error, match):
    model = small_model(keep_rate=0.5)
    with pytest.raises(error, match=match):
        visualize(model, torch.randn(1, 3, 64, 64), **options)
    with pytest.raises(ValueError, match="run a forward pass"):  # nothing ran
        kept_masks(model, (64, 64))


def test_masks_take_a_side_or_a_pair_and_name_anything_else():
    model = small_model(keep_rate=0.5)
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    assert torch.equal(kept_masks(model, 64), kept_masks(model, (64, 64)))
    for bad in ((64.0, 64), "64", True, (64, 64, 3)):  # each failed inside the drawing code
        with pytest.raises(TypeError, match=r"img_size must be an int or a pair of ints \(H, W\)"):
            kept_masks(model, bad)


def test_masks_need_a_forward_first():
    with pytest.raises(ValueError, match="run a forward pass"):
        kept_masks(small_model(keep_rate=0.5), (64, 64))


@pytest.mark.slow
def test_show_writes_a_readable_png(tmp_path):
    # the real console entry, in a fresh process
    image = tmp_path / "photo.png"
    Image.fromarray(torch.randint(0, 255, (40, 50, 3), dtype=torch.uint8).numpy()).save(image)
    out = tmp_path / "kept.png"
    result = subprocess.run([sys.executable, "-m", "vitprune", "show", str(image), "--model", "deit_tiny_patch16_224",
                             "--keep-rate", "0.5", "--out", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.size[0] > 400


@pytest.mark.parametrize("make_args, message", [
    (lambda d: [str(d / "missing.png")], "no such file"),
    (lambda d: [str(d / "notes.txt")], "cannot read"),
    (lambda d: [str(d / "photo.png"), "--model", "no_such_vit"], "unknown timm model"),
    (lambda d: [str(d / "photo.png"), "--keep-rate", "2"], "keep_rate must be in (0, 1]"),
    (lambda d: [str(d / "photo.png"), "--out", str(d / "kept.jpg")], "must be a .png"),
    (lambda d: [str(d / "photo.png"), "--checkpoint", str(d / "none.pt")], "no such checkpoint"),
    (lambda d: [str(d / "photo.png"), "--checkpoint", str(d / "notes.txt")], "cannot load checkpoint"),
])
def test_show_bad_input_exits_non_zero_with_a_message(tmp_path, make_args, message, capsys):
    Image.new("RGB", (32, 32)).save(tmp_path / "photo.png")
    (tmp_path / "notes.txt").write_text("not an image")
    assert main(["show", *make_args(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_show_draws_the_groups_of_a_shipped_checkpoint(tmp_path, capsys):
    Image.fromarray(torch.randint(0, 255, (28, 28), dtype=torch.uint8).numpy()).save(tmp_path / "item.png")
    out = tmp_path / "groups.png"
    checkpoint = Path(vitprune.__file__).parent / "assets" / "fashion_mnist_vit.pt"
    assert main(["show", str(tmp_path / "item.png"), "--checkpoint", str(checkpoint), "--keep-rate", "0.5",
                 "--view", "groups", "--out", str(out)]) == 0
    with Image.open(out) as picture:
        assert picture.format == "PNG"
    with pytest.raises(SystemExit):
        main(["show", str(tmp_path / "item.png"), "--view", "merged"])
    assert "invalid choice: 'merged'" in capsys.readouterr().err


@pytest.mark.parametrize("options, expected", [
    ([], dict(indicator="var", **PAPER_OPTIONS)),  # an indicator: the paper's method with it
    (["--indicator", "default"], {}),  # vitprune's defaults
    (["--indicator", "default", "--stages", "paper"], dict(stages=None)),
    (["--indicator", "medad", "--stages", "spread2"], dict(indicator="medad", **{**PAPER_OPTIONS, "stages": "spread2"})),
    (["--stages", "1,3"], dict(indicator="var", **{**PAPER_OPTIONS, "stages": (1, 3)})),
])
def test_show_patches_the_method_it_names(tmp_path, monkeypatch, options, expected):
    import vitprune.commands.show as show_module
    configs, real = [], show_module.patch
    monkeypatch.setattr(show_module, "patch", lambda model, **kw: configs.append(vitprune.get_config(real(model, **kw))))
    import vitprune.pictures.visualize as drawing
    monkeypatch.setattr(drawing, "visualize", lambda *args, **kw: types.SimpleNamespace(savefig=lambda *a, **k: None))
    Image.fromarray(torch.randint(0, 255, (28, 28), dtype=torch.uint8).numpy()).save(tmp_path / "item.png")
    checkpoint = Path(vitprune.__file__).parent / "assets" / "fashion_mnist_vit.pt"
    assert main(["show", str(tmp_path / "item.png"), "--checkpoint", str(checkpoint), "--keep-rate", "0.5",
                 "--out", str(tmp_path / "out.png"), *options]) == 0
    model, _ = load_shipped("fashion_mnist")
    assert configs == [vitprune.get_config(vitprune.patch(model, keep_rate=0.5, **expected))]


def test_the_readme_pictures_script_still_runs(tmp_path, monkeypatch):
    # examples/make_pictures.py against today's API (it once called prepare_timm with a model)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    import make_pictures

    monkeypatch.setattr(make_pictures, "OUT", tmp_path)
    make_pictures.shipped("cluttered", count=2)
    make_pictures.merged_groups(count=2)
    expected = ["cluttered_kept.png", "fashion_mnist_groups.png"]
    if importlib.util.find_spec("sklearn") is not None:  # the photograph ships with scikit-learn (the docs extra)
        make_pictures.photograph()
        expected.append("photo_random_weights.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
