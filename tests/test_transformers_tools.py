"""FLOP counts, budget fits, ``bench``, ``eval``, ``show`` and ``visualize`` on ``transformers``
ViTs (tiny random configs saved to a folder: no download)."""

import copy
import json
import time

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import HF_SIZES as SIZES, onnxruntime_output, require_transformers

transformers = require_transformers()

import vitprune  # noqa: E402
from vitprune.commands.cli import main  # noqa: E402
from vitprune.data import folders  # noqa: E402
from vitprune.data.hf_models import data_config  # noqa: E402
from vitprune.measure.baseline import fit_merging  # noqa: E402
from vitprune.measure.flops import schedule_flops  # noqa: E402

T = transformers

#: One tiny model of each class vitprune patches.
CLASSES = {
    "ViTModel": lambda: T.ViTModel(T.ViTConfig(**SIZES)),
    "ViTForImageClassification": lambda: T.ViTForImageClassification(T.ViTConfig(**SIZES, num_labels=3)),
    "DeiTForImageClassificationWithTeacher": lambda: T.DeiTForImageClassificationWithTeacher(
        T.DeiTConfig(**SIZES, num_labels=3)),
    "Dinov2ForImageClassification": lambda: T.Dinov2ForImageClassification(T.Dinov2Config(**SIZES, num_labels=3)),
    "Dinov2Model (SwiGLU)": lambda: T.Dinov2Model(T.Dinov2Config(**SIZES, use_swiglu_ffn=True)),
    "Dinov2WithRegistersModel": lambda: T.Dinov2WithRegistersModel(
        T.Dinov2WithRegistersConfig(**SIZES, num_register_tokens=2)),
    "CLIPVisionModelWithProjection": lambda: T.CLIPVisionModelWithProjection(
        T.CLIPVisionConfig(**SIZES, projection_dim=16)),
    "SiglipVisionModel": lambda: T.SiglipVisionModel(T.SiglipVisionConfig(**SIZES)),
}


def build(name):
    torch.manual_seed(0)
    return CLASSES[name]().eval()


def test_analytic_flops_of_a_tiny_vit_classifier_by_hand():
    model = build("ViTForImageClassification")
    C, hidden, patches, L, depth, classes = 32, 64, 16, 17, 4, 3
    embed = patches * C * 3 * 8 * 8
    block = L * 4 * C * C + 2 * L * L * C + 2 * L * C * hidden  # q k v o, two products, MLP
    assert vitprune.analytic_flops(model) == embed + depth * block + C * classes


def test_analytic_flops_of_siglip_count_its_attention_pooling_head():
    model = build("SiglipVisionModel")
    C, hidden, L, depth = 32, 64, 16, 4  # no class token
    embed = L * C * 3 * 8 * 8
    block = L * 4 * C * C + 2 * L * L * C + 2 * L * C * hidden
    pool = C * C + 2 * L * C * C + 2 * L * C + C * C + 2 * C * hidden  # probe, keys/values, products, out, MLP
    assert vitprune.analytic_flops(model) == embed + depth * block + pool


@pytest.mark.parametrize("options", [None, dict(keep_rate=0.7),
                                     dict(indicator="var", keep_rate=0.5, stages=(1, 2), selection="top",
                                          reduction="fuse", size_aware=False)])
@pytest.mark.parametrize("name", CLASSES)
def test_fvcore_and_the_analytic_count_agree(name, options):
    """They differ by the norms fvcore counts (a larger share at width 32 than in real models)."""
    model = build(name)
    unpruned = vitprune.analytic_flops(model)
    if options is not None:
        vitprune.patch(model, **options)
    traced, analytic = vitprune.count_flops(model), vitprune.analytic_flops(model)
    assert 0 < traced - analytic < 0.05 * analytic
    if options is not None:
        assert analytic < unpruned


@pytest.mark.parametrize("name", CLASSES)
def test_count_flops_at_another_input_size_interpolates_the_position_embedding(name):
    """transformers refuses another size unless asked to interpolate; count_flops asks."""
    model = build(name)
    for options in (None, {"keep_rate": 0.5}):
        if options is not None:
            vitprune.patch(model, **options)
        predicted = schedule_flops(model, None if options is None else vitprune.PruneConfig(**options), (48, 40))
        traced = vitprune.count_flops(model, (48, 40), products_only=True)
        assert abs(traced - predicted) / traced < 0.005, (options, traced, predicted)
        assert traced > 1.5 * vitprune.count_flops(model, products_only=True)  # 30 patches, not 16


def test_count_flops_counts_a_convolution_with_string_padding():
    """SigLIP's patch embedding pads with "valid", which fvcore alone counts as nothing."""
    valid = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 4, stride=4, padding="valid"))
    zero = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 4, stride=4, padding=0))
    assert vitprune.count_flops(valid, 16) == vitprune.count_flops(zero, 16) == 16 * 8 * 3 * 4 * 4


@pytest.mark.parametrize("stages", ["spread", "all", (1, 3)])
@pytest.mark.parametrize("name", ["ViTForImageClassification", "Dinov2WithRegistersModel", "SiglipVisionModel"])
def test_fit_keep_rate_meets_the_budget_within_one_token(name, stages):
    model = build(name)
    target = 0.7 * vitprune.analytic_flops(model) / 1e9
    rate = vitprune.fit_keep_rate(model, target, stages=stages)
    reached = schedule_flops(model, vitprune.PruneConfig(keep_rate=rate, stages=stages))
    assert reached <= target * 1e9
    over = next(flops for step in range(1, 2000)
                if (flops := schedule_flops(model, vitprune.PruneConfig(keep_rate=min(1.0, rate + step * 1e-3),
                                                                        stages=stages))) != reached)
    assert over > target * 1e9
    vitprune.patch(model, keep_rate=rate, stages=stages)
    assert vitprune.analytic_flops(model) == reached


def test_the_merging_baseline_fits_a_budget_and_runs():
    model = build("Dinov2ForImageClassification")
    target = 0.75 * vitprune.analytic_flops(model) / 1e9
    config = fit_merging(model, target)
    assert schedule_flops(model, config) <= target * 1e9
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = vitprune.patch(model, config)(x).logits
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()


def test_fit_keep_rate_refuses_what_patch_refuses():
    clip = T.CLIPModel(T.CLIPConfig(vision_config=SIZES, text_config=dict(hidden_size=32, num_hidden_layers=1,
                                                                            num_attention_heads=4,
                                                                            intermediate_size=64)))
    with pytest.raises(TypeError, match="vision_model"):
        vitprune.fit_keep_rate(clip, 0.001)
    model = build("ViTModel")
    for call in (lambda: vitprune.patch(model, overlap_stride=4),
                 lambda: vitprune.fit_keep_rate(model, 0.001, overlap_stride=4),
                 lambda: vitprune.overlap_options(model, 0.001), lambda: vitprune.fit_overlap(model)):
        with pytest.raises(TypeError, match="overlap_stride is supported for VisionTransformer models only"):
            call()


@pytest.fixture(scope="module")
def saved_classifier(tmp_path_factory):
    """A tiny ViT classifier saved with DeiT's processor (resize 40x40, crop 32, bicubic)."""
    folder = tmp_path_factory.mktemp("hf_vit")
    build("ViTForImageClassification").save_pretrained(folder)
    T.DeiTImageProcessor(size={"height": 40, "width": 40}, crop_size={"height": 32, "width": 32}).save_pretrained(
        folder)
    return folder


@pytest.fixture(scope="module")
def saved_tower(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_siglip")
    build("SiglipVisionModel").save_pretrained(folder)
    return folder


def _pictures():
    from matplotlib import cbook

    rng = np.random.default_rng(1)
    return [Image.open(cbook.get_sample_data("grace_hopper.jpg")).convert("RGB"),
            Image.fromarray(rng.integers(0, 255, (300, 500, 3), dtype=np.uint8))]


@pytest.mark.parametrize("processor", ["ViTImageProcessor", "DeiTImageProcessor", "CLIPImageProcessor",
                                       "BitImageProcessor", "SiglipImageProcessor"])
def test_the_data_config_reproduces_the_image_processor(processor, tmp_path):
    getattr(T, processor)().save_pretrained(tmp_path)
    model = T.ViTModel(T.ViTConfig(**{**SIZES, "image_size": 224}))
    transform = folders.eval_transform(data_config(str(tmp_path), model))
    loaded = T.AutoImageProcessor.from_pretrained(tmp_path)
    for picture in _pictures():
        ours = transform(picture)
        theirs = torch.as_tensor(loaded(picture, return_tensors="pt")["pixel_values"][0])
        assert ours.shape == theirs.shape == (3, 224, 224)
        level = 1.01 / 255 / min(loaded.image_std)  # one step of 8-bit rounding after normalisation
        assert (ours - theirs).abs().max() <= 2 * level  # resampling rounds a few pixels differently
        assert ((ours - theirs).abs() > level / 2).float().mean() < 0.01
        assert (ours - theirs).abs().mean() < 1e-3


def test_eval_on_a_transformers_classifier(saved_classifier, rgb_tree, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["eval", "--model", f"hf:{saved_classifier}", "--data-dir", str(rgb_tree), "--keep-rates", "0.7",
                 "--budgets", "0.8", "--indicators", "default", "var", "--baseline", "merge", "--batch-size", "5",
                 "--no-progress", "--out", str(out)]) == 0
    assert "random weights" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["versions"]["transformers"] == transformers.__version__
    rows = {r["setting"]: r for r in result["rows"]}
    assert set(rows) == {"unpruned", "default keep 0.7", "default 80% FLOPs", "var keep 0.7", "var 80% FLOPs",
                         "merging 80% FLOPs", "merging at default keep 0.7"}
    assert rows["default 80% FLOPs"]["flops_share"] <= 0.8 and rows["merging 80% FLOPs"]["flops_share"] <= 0.8
    model = T.ViTForImageClassification.from_pretrained(saved_classifier).eval()
    dataset = folders.open_images(str(rgb_tree), "validation", data_config(str(saved_classifier), model))
    images, labels = (torch.cat(part) for part in zip(*folders.batches(dataset, 5)))
    for setting, rate in [("unpruned", None), ("default keep 0.7", 0.7)]:
        run = model if rate is None else vitprune.patch(copy.deepcopy(model), keep_rate=rate)
        with torch.no_grad():
            correct = (run(images).logits.argmax(-1) == labels).float().mean().item()
        assert rows[setting]["top1"] == pytest.approx(100 * correct), setting


@pytest.mark.parametrize("options, message", [
    (["--model", "hf:{tower}"], "needs an image classifier"),
    (["--model", "hf:{classifier}", "--checkpoint", "{classifier}/model.safetensors"], "--checkpoint does not apply"),
    (["--model", "hf:{classifier}", "--img-size", "64"], "--img-size does not apply"),
])
def test_eval_refuses_with_one_line(options, message, saved_classifier, saved_tower, rgb_tree, capsys):
    options = [o.format(tower=saved_tower, classifier=saved_classifier, tree=rgb_tree) for o in options]
    assert main(["eval", *options, "--data-dir", str(rgb_tree), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_a_hub_id_without_network_fails_at_once(rgb_tree, monkeypatch, capsys):
    import huggingface_hub.constants as constants

    from vitprune.data import models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)  # restored afterwards
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setenv("HF_HOME", str(rgb_tree / "empty-cache"))
    started = time.perf_counter()
    assert main(["eval", "--model", "hf:no-such-user/no-such-vit", "--pretrained", "--data-dir", str(rgb_tree),
                 "--no-progress"]) == 2
    assert time.perf_counter() - started < 20
    assert "cannot load the transformers config of no-such-user/no-such-vit" in capsys.readouterr().err
    assert constants.HF_HUB_OFFLINE is True


def test_bench_times_a_transformers_model(saved_classifier, tmp_path):
    out = tmp_path / "rows.json"
    assert main(["bench", "--model", f"hf:{saved_classifier}", "--batch", "2", "--rounds", "1", "--warmup", "0",
                 "--indicators", "default", "var", "--keep-rates", "0.5", "--no-memory", "--no-progress",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["setting"] for r in rows] == ["unpruned", "default keep 0.5", "var keep 0.5"]
    assert rows[0]["img_size"] == [32, 32] and all(r["gflops"] > 0 and r["images_per_s"] > 0 for r in rows)
    assert rows[1]["ideal_speedup"] > 1 and rows[2]["ideal_speedup"] > 1


def test_bench_trains_a_vision_tower(saved_tower):
    """A tower has no logits: the stand-in loss is over its pooled output."""
    assert main(["bench", "--model", f"hf:{saved_tower}", "--mode", "train", "--batch", "2", "--rounds", "1",
                 "--warmup", "0", "--indicators", "var", "--keep-rates", "0.5", "--no-memory",
                 "--no-progress"]) == 0


def test_bench_refuses_an_img_size_for_a_transformers_model(saved_tower, capsys):
    assert main(["bench", "--model", f"hf:{saved_tower}", "--img-size", "64", "--no-memory"]) == 2
    assert "--img-size does not apply" in capsys.readouterr().err


def test_visualize_a_transformers_model():
    pytest.importorskip("matplotlib")
    model = vitprune.patch(build("CLIPVisionModelWithProjection"), indicator="var", keep_rate=0.5, stages=(1, 2))
    x = torch.randn(2, 3, 32, 32)
    figure = vitprune.visualize(model, x)
    assert len(figure.axes) == 2 * 3
    masks = vitprune.kept_masks(model, (32, 32))
    kept = [int((stage[0] >= 0).sum()) for stage in vitprune.kept_positions(model)]
    assert masks.shape == (2, 2, 32, 32)
    assert [int(masks[0, s].sum()) for s in range(2)] == [8 * 8 * k for k in kept]


def test_visualize_a_transformers_model_at_another_input_size():
    """It runs the model with interpolate_pos_encoding=True there, as transformers requires."""
    pytest.importorskip("matplotlib")
    model = vitprune.patch(build("ViTForImageClassification"), keep_rate=0.5, stages="all")
    figure = vitprune.visualize(model, torch.randn(1, 3, 48, 40))
    assert len(figure.axes) == 1 + 3  # the input, blocks 0-2 (the last computes the class token alone)
    kept = [int((stage[0] >= 0).sum()) for stage in vitprune.kept_positions(model)]
    assert kept[0] == 15  # half of the 6 x 5 patches
    assert int(vitprune.kept_masks(model, (48, 40))[0, 0].sum()) == 8 * 8 * 15


def test_show_draws_a_transformers_tower_with_the_default_preprocessing(saved_tower, tmp_path, capsys):
    picture, out = tmp_path / "in.png", tmp_path / "kept.png"
    _pictures()[0].save(picture)
    assert main(["show", str(picture), "--model", f"hf:{saved_tower}", "--stages", "1,2", "--out", str(out)]) == 0
    assert "no image processor config" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("name, backend", [
    ("ViTForImageClassification", "inductor"), ("DeiTForImageClassificationWithTeacher", "aot_eager"),
    ("Dinov2ForImageClassification", "aot_eager"), ("CLIPVisionModelWithProjection", "aot_eager"),
    ("SiglipVisionModel", "aot_eager")])
def test_torch_export_and_compile_reproduce_eager(name, backend):
    """While exporting, transformers hands the layers its all-visible mask: it is ignored there.
    One model compiles through inductor; the others through aot_eager, the same graph capture
    (fullgraph) without inductor's C++ build (test_compile.py says more)."""
    model = vitprune.patch(build(name), keep_rate=0.7)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        exported = torch.export.export(model, (x,)).module()(x)
        compiled = torch.compile(model, fullgraph=True, backend=backend)(x)
    key = next(k for k in ("logits", "image_embeds", "pooler_output") if getattr(expected, k, None) is not None)
    torch.testing.assert_close(exported[key], expected[key], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled[key], expected[key], rtol=1e-5, atol=1e-5)



@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(keep_rate=0.6), dict(indicator="var", keep_rate=0.6, stages=(1, 2),
                                                                selection="top", reduction="fuse", size_aware=False)],
                         ids=["defaults", "paper"])
@pytest.mark.parametrize("name", ["ViTForImageClassification", "SiglipVisionModel"])
def test_onnx_export_reproduces_eager_in_onnxruntime(tmp_path, name, options):
    """The exported graph of a patched model (its main output) run by onnxruntime."""
    from test_transformers import MainOutput

    model, x = MainOutput(vitprune.patch(build(name), **options)).eval(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x).numpy()
    assert abs(onnxruntime_output(model, x, tmp_path) - expected).max() < 1e-4


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",  # the exporter is deprecated
                            "ignore::torch.jit.TracerWarning")  # timm and transformers code before the refusal
@pytest.mark.parametrize("name", ["ViTModel", "ViTForImageClassification"])
def test_the_torchscript_onnx_exporter_is_refused_for_backbones_and_classifiers(tmp_path, name):
    from test_transformers import MainOutput

    model, x = MainOutput(vitprune.patch(build(name), keep_rate=0.6)).eval(), torch.randn(2, 3, 32, 32)
    with pytest.raises(TypeError, match=r"TorchScript-based ONNX exporter.*dynamo=True"):
        torch.onnx.export(model, (x,), str(tmp_path / "model.onnx"), dynamo=False)


@pytest.mark.parametrize("pretrained", [True, False])
def test_a_full_clip_checkpoint_loads_as_its_vision_tower(tmp_path, pretrained):
    from vitprune.data.hf_models import load_transformers_model

    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    torch.manual_seed(0)
    full = T.CLIPModel(T.CLIPConfig(vision_config=SIZES, text_config=text, projection_dim=16))
    full.save_pretrained(tmp_path)
    model, config, source = load_transformers_model(f"hf:{tmp_path}", pretrained)
    assert type(model) is T.CLIPVisionModelWithProjection and source.startswith("pretrained" if pretrained else "random")
    assert config["input_size"] == (3, 32, 32) and config["processor"] is None
    for ours, theirs in [(model.vision_model.embeddings.patch_embedding, full.vision_model.embeddings.patch_embedding),
                         (model.visual_projection, full.visual_projection)]:
        assert ours.weight.shape == theirs.weight.shape
        assert torch.equal(ours.weight, theirs.weight) == pretrained
    vitprune.patch(model, keep_rate=0.7)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).image_embeds.shape == (1, 16)
