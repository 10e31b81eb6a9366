"""``vitprune eval`` and ``vitprune.measure.evaluate`` on image-folder trees written from real data."""

import copy
import csv
import json
import re
import shlex
import types

import pytest
import timm
import torch
from PIL import Image

import vitprune
from conftest import small_vit
from vitprune.commands.cli import build_parser, main
from vitprune.commands.eval import problem_with, record
from vitprune.data import folders
from vitprune.data.accuracy import accuracy
from vitprune.data.shipped import checkpoint_path, data_config, load_shipped, load_test_subset
from vitprune.measure.evaluate import apply_setting, build_settings, evaluate, gflops_of, median_speedups
from vitprune.pictures import pyplot
from vitprune.pictures.frontier import draw_frontier, draw_frontiers, pareto_front

ASSET = str(checkpoint_path("fashion_mnist"))


@pytest.fixture(scope="module")
def fashion_tree(tmp_path_factory):
    """The shipped Fashion-MNIST test subset as PNG files, one folder per class."""
    root = tmp_path_factory.mktemp("fashion")
    images, labels = load_test_subset("fashion_mnist")
    for index, (image, label) in enumerate(zip(images, labels)):
        folder = root / str(int(label))
        folder.mkdir(exist_ok=True)
        Image.fromarray(image.numpy()).save(folder / f"{index:05d}.png")  # uint8 (H, W): mode L
    return root


def test_eval_reports_the_same_top1_as_the_demo_computes(fashion_tree, tmp_path):
    out = tmp_path / "rows.json"
    assert main(["eval", "--checkpoint", ASSET, "--data-dir", str(fashion_tree), "--keep-rates", "1.0", "0.7",
                 "--batch-size", "256", "--no-progress", "--out", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    model, _ = load_shipped("fashion_mnist")
    images, labels = load_test_subset("fashion_mnist")
    for setting, rate in [("unpruned", None), ("default keep 1", 1.0), ("default keep 0.7", 0.7)]:
        run = model if rate is None else vitprune.patch(copy.deepcopy(model), keep_rate=rate)
        assert rows[setting]["top1"] == pytest.approx(100 * accuracy(run, images, labels), abs=1e-9), setting
        assert rows[setting]["images"] == len(images)


def test_the_unpruned_row_is_timms_own_validation(rgb_tree):
    """The same images, transforms and labels as timm's own loader gives."""
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", num_classes=3).eval()
    config = timm.data.resolve_data_config({}, model=model)
    ours = folders.open_images(str(rgb_tree), "validation", config)
    theirs = timm.data.create_dataset("", root=str(rgb_tree), split="validation")
    loader = timm.data.create_loader(theirs, input_size=config["input_size"], batch_size=5, use_prefetcher=False,
                                     interpolation=config["interpolation"], mean=config["mean"], std=config["std"],
                                     crop_pct=config["crop_pct"], crop_mode=config["crop_mode"], num_workers=0,
                                     persistent_workers=False, device=torch.device("cpu"))
    expected_images, expected_labels = zip(*loader)
    got_images, got_labels = zip(*folders.batches(ours, 5))
    assert torch.equal(torch.cat(got_images), torch.cat(expected_images))
    assert torch.equal(torch.cat(got_labels), torch.cat(expected_labels))
    settings = build_settings(model, keep_rates=[0.5])
    rows = evaluate(model, folders.batches(ours, 5), settings)
    with torch.no_grad():
        logits = model(torch.cat(expected_images))
    assert rows[0].top1 == pytest.approx(100 * (logits.argmax(-1) == torch.cat(expected_labels)).float().mean().item())


def test_a_random_timm_model_runs_on_a_small_rgb_tree_with_a_limit(rgb_tree, tmp_path, capsys):
    out = tmp_path / "rows.csv"
    plot = tmp_path / "front.png"
    assert main(["eval", "--model", "deit_tiny_patch16_224", "--data-dir", str(rgb_tree), "--limit", "5",
                 "--batch-size", "2", "--keep-rates", "0.7", "0.5", "--indicators", "default", "var",
                 "--no-progress", "--out", str(out), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "random weights" in text and "var keep 0.5" in text
    assert "the median of 3 per-batch time ratios" in text and "note: only 3 batches timed" in text
    with open(out) as handle:
        rows = list(csv.DictReader(handle))
    assert [r["setting"] for r in rows] == ["unpruned", "default keep 0.7", "default keep 0.5", "var keep 0.7",
                                            "var keep 0.5"]
    for row in rows:
        assert row["images"] == "5" and row["command"].startswith("vitprune eval --model deit_tiny_patch16_224")
        assert row["torch_version"] == torch.__version__ and row["timm_version"] == timm.__version__
        assert float(row["gflops"]) > 0 and float(row["images_per_s"]) > 0
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[4]["flops_share"]) < float(rows[1]["flops_share"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = Image.open(plot).size
    assert width > 2 * height  # two panels side by side: against GFLOPs and against measured speedup


def test_json_rows_carry_the_schema(fashion_tree, tmp_path):
    out = tmp_path / "rows.json"
    assert main(["eval", "--checkpoint", ASSET, "--data-dir", str(fashion_tree), "--limit", "100", "--budgets",
                 "0.7", "--indicators", "default", "var", "--baseline", "merge", "--no-progress", "--out",
                 str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("vitprune eval --checkpoint")
    assert set(result["versions"]) == {"vitprune", "torch", "timm"}
    assert result["device"] == "cpu" and result["amp"] is False and ASSET in result["weights"]
    keys = {"setting", "method", "keep_rate", "budget", "top1", "top5", "gflops", "flops_share", "images_per_s",
            "speedup", "images", "batches"}
    assert all(keys <= set(row) for row in result["rows"])
    assert all(row["batches"] == 2 for row in result["rows"])  # 100 images at the default batch of 64
    assert [r["method"] for r in result["rows"]] == ["unpruned", "default", "var", "merging"]
    for row in result["rows"][1:]:  # each fitted to 70 % of the unpruned FLOPs, from below
        assert row["budget"] == 0.7 and 0.6 < row["flops_share"] <= 0.7
        assert 0 <= row["top1"] <= row["top5"] <= 100


def test_every_image_is_read_once_however_many_settings(fashion_tree, monkeypatch):
    model, _ = load_shipped("fashion_mnist")
    dataset = folders.open_images(str(fashion_tree), "validation", data_config(model))
    reads = []
    original = type(dataset).__getitem__
    monkeypatch.setattr(type(dataset), "__getitem__", lambda self, i: (reads.append(i), original(self, i))[1])
    settings = build_settings(model, methods=["default", "var", "cls"], keep_rates=[0.9, 0.7, 0.5])
    rows = evaluate(model, folders.batches(dataset, 64, limit=300), settings)
    assert len(settings) == 10 and len(rows) == 10
    assert all(r.images == 300 and r.batches == 5 for r in rows)  # 64, 64, 64, 64, 44
    assert sorted(reads) == folders.spread(len(dataset), 300) and len(set(reads)) == len(reads)


@pytest.mark.parametrize("limit, error, message", [
    (0, ValueError, "limit must be >= 1 image, or None for all, got 0"),
    (-1, ValueError, "limit must be >= 1 image, or None for all, got -1"),
    (True, TypeError, "limit must be a whole number of images (int) or None for all, got bool True"),
    (2.5, TypeError, "limit must be a whole number of images (int) or None for all, got float 2.5"),
    ("2", TypeError, "limit must be a whole number of images (int) or None for all, got str '2'"),
])
def test_a_limit_that_is_no_count_of_images_is_refused_before_any_data_is_read(limit, error, message):
    """0 and -1 read as 'the data is empty', True as one image; 2.5 and "2" failed in a slice."""
    model, _ = load_shipped("fashion_mnist")
    read = []

    def batches():
        read.append(True)
        yield torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)

    with pytest.raises(error, match=re.escape(message)):
        evaluate(model, batches(), build_settings(model, keep_rates=[0.7]), limit=limit)
    assert not read


@pytest.mark.parametrize("amp", ["false", 1, None])
def test_amp_that_is_no_bool_is_refused_before_any_data_is_read(amp):
    """"false" switched autocast on in torch's hands (or failed there after every copy and count)."""
    model, _ = load_shipped("fashion_mnist")
    read = []

    def batches():
        read.append(True)
        yield torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)

    with pytest.raises(TypeError, match=rf"amp must be True or False, got {amp!r}"):
        evaluate(model, batches(), build_settings(model, keep_rates=[0.7]), amp=amp)
    assert not read


def test_a_limit_samples_every_class(fashion_tree):
    model, _ = load_shipped("fashion_mnist")
    dataset = folders.open_images(str(fashion_tree), "validation", data_config(model))
    labels = torch.cat([y for _, y in folders.batches(dataset, 100, limit=50)])
    assert len(labels) == 50 and set(labels.tolist()) == set(range(10))


def test_speedup_is_the_median_of_the_per_batch_ratios_by_hand():
    # three batches; the unpruned model (first) stalled on the last one (10 s where it took 1 s),
    # the second setting ran twice as fast on each, the third at half, equal, then twice the speed
    seconds = [[1.0, 1.0, 10.0], [0.5, 0.5, 0.5], [2.0, 1.0, 5.0]]
    assert median_speedups(seconds) == [1.0, 2.0, 1.0]
    # the ratios of total times would read 8.0 and 1.5: one stalled batch would set them
    assert [sum(seconds[0]) / sum(times) for times in seconds] == [1.0, 8.0, 1.5]


def test_evaluate_stops_at_the_limit_rotates_who_goes_first_and_times_each_batch(monkeypatch):
    """Batches of 3 with ``limit=7``: three batches (3, 3 and the first image of the third);
    the first setting on batch ``b`` is setting ``b`` (mod 3); on a clock that reads one
    second more at every call each run takes 1 s, so every setting reads 7 / 3 images/s."""
    model = small_vit(depth=2)
    settings = build_settings(model, keep_rates=[0.9, 0.5])

    def key(m):  # which setting a copy runs: its resolved keep rates (per stage)
        return vitprune.get_config(m).keep_rate if vitprune.is_patched(m) else None

    keys = [key(apply_setting(copy.deepcopy(model), s)) for s in settings]
    assert len(set(keys)) == 3
    order = []
    model.register_forward_hook(lambda m, args, out: order.append(keys.index(key(m))))
    clock = iter(range(10 ** 6))
    monkeypatch.setattr("vitprune.measure.evaluate.time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    data = torch.randn(12, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    batches = [(data[i:i + 3], torch.zeros(3, dtype=torch.long)) for i in range(0, 12, 3)]
    rows = evaluate(model, batches, settings, limit=7)
    assert [(r.images, r.batches) for r in rows] == [(7, 3)] * 3
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert [r.images_per_s for r in rows] == [7 / 3] * 3 and [r.speedup for r in rows] == [1.0] * 3


def test_the_baseline_at_a_keep_rate_is_fitted_to_that_settings_own_flops():
    """``--class-only-last`` forced off: merging is fitted to the FLOPs of the defaults with
    the whole last block, not of those with the class token alone; where the defaults cost the
    unpruned FLOPs or more (keep 1.0 pays for the reduction step), merging merges nothing."""
    model = timm.create_model("deit_tiny_patch16_224").eval()
    settings = {s.label: s for s in build_settings(model, keep_rates=[0.7, 1.0], baseline=True,
                                                   class_only_last=False)}
    target = gflops_of(apply_setting(copy.deepcopy(model), settings["default full last keep 0.7"]))
    merging = gflops_of(apply_setting(copy.deepcopy(model), settings["merging at default keep 0.7"]))
    assert 0.99 * target < merging <= target
    assert settings["merging at default keep 1"].options["config"].keep_rate == (1.0,) * 12


def test_pareto_front_by_hand():
    points = [(1.0, 80.0), (2.0, 85.0), (2.0, 84.0), (3.0, 84.5), (0.5, 70.0), (3.0, 90.0)]
    assert pareto_front(points) == [4, 0, 1, 5]


def test_the_front_against_measured_speedup_is_of_the_fastest_not_of_the_fewest_flops():
    # b costs the fewest FLOPs but ran slower than c, which is more accurate: against FLOPs b is
    # on the front, against speedup it is beaten; a is beaten by c on both axes
    def row(setting, gflops, speedup, top1):
        return {"setting": setting, "method": setting.split()[0], "keep_rate": None, "budget": None,
                "gflops": gflops, "speedup": speedup, "top1": top1}

    rows = [row("unpruned", 1.0, 1.0, 90.0), row("default keep 0.7", 0.7, 1.3, 89.0),
            row("var keep 0.5", 0.5, 1.2, 88.0), row("default keep 0.6", 0.6, 1.5, 89.5)]

    def front(x):
        axis = draw_frontier(rows, "t", x=x).axes[0]
        line = next(line for line in axis.get_lines() if line.get_label() == "Pareto front")
        return list(line.get_xdata()), axis.get_xlabel()

    assert front("gflops") == ([0.5, 0.6, 1.0], "GFLOPs per image")
    assert front("speedup") == ([1.5, 1.0], "speedup over the unpruned model (measured)")
    with pytest.raises(ValueError, match="x must be one of .'gflops', 'speedup'., got 'flops'"):
        draw_frontier(rows, "t", x="flops")
    _, axes = pyplot().subplots(1, 2)
    draw_frontiers(rows, "t", axes)  # one per axis, in the order of AXES
    assert [axis.get_xlabel() for axis in axes] == ["GFLOPs per image", "speedup over the unpruned model (measured)"]
    with pytest.raises(ValueError, match="need 2 axes, one for each of"):
        draw_frontiers(rows, "t", axes[:1])


@pytest.fixture
def bad(tmp_path, fashion_tree):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    broken = tmp_path / "broken" / "a"
    broken.mkdir(parents=True)
    for i in range(25):
        (broken / f"{i}.png").write_text("not a png")
    eleven = tmp_path / "eleven"
    for c in range(11):
        (eleven / str(c)).mkdir(parents=True)
        Image.new("L", (28, 28)).save(eleven / str(c) / "x.png")
    return tmp_path


@pytest.mark.parametrize("arguments, message", [
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(d / "missing")], "no such data folder"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(d / "file.txt")], "no such data folder"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(d / "empty")], "holds no images"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(d / "broken")], "cannot read the images"),
    (lambda d, f: ["--model", "no_such_vit", "--data-dir", str(f)], "unknown timm model 'no_such_vit'"),
    (lambda d, f: ["--model", "deit_tiny_patch16_224", "--checkpoint", ASSET, "--data-dir", str(f)],
     "does not fit deit_tiny_patch16_224"),
    (lambda d, f: ["--checkpoint", str(d / "file.txt"), "--data-dir", str(f)], "cannot load checkpoint"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(d / "eleven")], "11 classes"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(f), "--stages", "99"], "stages"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(f), "--out", "rows.txt"], ".json or .csv"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(f), "--plot", "front.jpg"], ".png"),
    (lambda d, f: ["--data-dir", str(f)], "name a model"),
    (lambda d, f: ["--checkpoint", ASSET, "--pretrained", "--data-dir", str(f)], "--pretrained needs --model"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(f), "--workers", "-1"], "--workers must be >= 0, got -1"),
    # the folder is checked before the model loads
    (lambda d, f: ["--model", "no_such_vit", "--data-dir", str(d / "file.txt")], "no such data folder"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(f), "--keep-rates", "0"],
     "argument --keep-rates: must be in (0, 1], got 0"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(f), "--budgets", "1.5"],
     "argument --budgets: must be in (0, 1], got 1.5"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(f), "--budgets", "most"],
     "argument --budgets: must be a number in (0, 1], got 'most'"),
    (lambda d, f: ["--checkpoint", ASSET, "--data-dir", str(f), "--limit", "0"],
     "argument --limit: must be a positive integer, got 0"),
    (lambda d, f: ["--resnet", "--data-dir", str(f)], "unrecognized arguments"),
])
def test_bad_input_exits_2_with_one_line(bad, fashion_tree, arguments, message, capsys):
    try:
        code = main(["eval", *arguments(bad, fashion_tree), "--no-progress"])
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_keep_rates_given_empty_without_budgets_evaluate_the_unpruned_model_alone(fashion_tree, capsys):
    # 0.7 is the default only when --keep-rates is not given; one row has no speedup to steady
    assert main(["eval", "--checkpoint", ASSET, "--data-dir", str(fashion_tree), "--limit", "20", "--keep-rates",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^unpruned ", out, re.M) and not re.search(r"^default", out, re.M)
    assert "batch timed" not in out and "batches timed" not in out


def test_the_recorded_command_is_quoted_to_run_again_in_a_shell():
    argv = ["eval", "--checkpoint", ASSET, "--data-dir", "my images/val", "--plot", "it's.png"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    assert shlex.split(record([], args, "random weights")["command"]) == ["vitprune", *argv]


def test_a_plot_name_may_end_in_png_in_capitals(fashion_tree):
    args = build_parser().parse_args(["eval", "--checkpoint", ASSET, "--data-dir", str(fashion_tree),
                                      "--plot", "FRONT.PNG"])
    assert problem_with(args) is None


def test_a_model_vitprune_cannot_patch_exits_2(rgb_tree, capsys):
    assert main(["eval", "--model", "resnet18", "--data-dir", str(rgb_tree), "--no-progress"]) == 2
    assert "cannot patch a timm.models.resnet.ResNet" in capsys.readouterr().err


def test_pretrained_weights_without_network_fail_at_once(rgb_tree, monkeypatch, capsys):
    import huggingface_hub.constants as constants

    from vitprune.data import models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)  # restored afterwards
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setenv("HF_HOME", str(rgb_tree / "empty-cache"))
    assert main(["eval", "--model", "deit_tiny_patch16_224", "--pretrained", "--data-dir", str(rgb_tree),
                 "--no-progress"]) == 2
    assert "cannot load pretrained weights for deit_tiny_patch16_224" in capsys.readouterr().err
    assert constants.HF_HUB_OFFLINE is True


def test_class_only_last_applies_to_every_method_and_its_budgets(fashion_tree, tmp_path):
    """``--class-only-last``: each method's fit spends the saving (it keeps more than without
    it at the same budget), the logits equal those of the same keep rate without it, and token
    merging stays the baseline users run."""
    out = tmp_path / "rows.json"
    assert main(["eval", "--checkpoint", ASSET, "--data-dir", str(fashion_tree), "--budgets", "0.6",
                 "--baseline", "merge", "--class-only-last", "--no-progress", "--out", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    model, _ = load_shipped("fashion_mnist")
    plain = {s.label: s for s in build_settings(model, budgets=[0.6], class_only_last=False)}
    only = {s.label: s for s in build_settings(model, budgets=[0.6], baseline=True, class_only_last=True)}
    setting = only["default class-only last 60% FLOPs"]
    assert setting.options["class_only_last"] and setting.keep_rate > plain["default full last 60% FLOPs"].keep_rate
    images, labels = load_test_subset("fashion_mnist")
    # the class token is never merged
    same = vitprune.patch(copy.deepcopy(model), keep_rate=setting.keep_rate, class_only_last=False)
    assert rows[setting.label]["top1"] == pytest.approx(100 * accuracy(same, images, labels), abs=1e-9)
    merging = [s for s in only.values() if s.method == "merging"]
    assert merging and not any(s.options["config"].class_only_last for s in merging)


def test_class_only_last_on_a_model_that_pools_every_token_exits_2(rgb_tree, capsys):
    code = main(["eval", "--model", "vit_base_patch16_gap_224", "--img-size", "32", "--data-dir", str(rgb_tree),
                 "--class-only-last", "--keep-rates", "0.7", "--no-progress"])
    assert code == 2
    assert "class_only_last=True cannot apply" in capsys.readouterr().err


def test_eval_reads_every_named_schedule_and_builds_each_one():
    from vitprune.commands.cli import build_parser
    args = build_parser().parse_args(["eval", "--checkpoint", ASSET, "--data-dir", ".", "--stages",
                                      "spread", "spread2", "spread3", "all", "paper", "1,3"])
    assert args.stages == ["spread", "spread2", "spread3", "all", "paper", (1, 3)]
    model, _ = load_shipped("fashion_mnist")
    settings = build_settings(model, keep_rates=[0.7], stages=["spread2", "spread3", "paper"])
    patched = [vitprune.get_config(vitprune.patch(copy.deepcopy(model), **s.options)).stages for s in settings[1:]]
    paper = vitprune.PruneConfig(stages=None).resolve(6, 49).stages
    assert patched == [(1, 3), (2,), paper]  # six blocks, the last computing the class token alone
    assert paper != vitprune.PruneConfig().resolve(6, 49).stages  # "paper" is not the defaults' own schedule
    assert settings[3].label == "default stages paper keep 0.7"
    # an indicator's own schedule is the paper's: "paper" names the same
    own, named = build_settings(model, methods=["var"], keep_rates=[0.7], stages=[None, "paper"])[1:]
    assert own.options == named.options
