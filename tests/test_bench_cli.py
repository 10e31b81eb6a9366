"""``vitprune bench`` end to end on a tiny model, and its errors."""

import copy
import json
import subprocess
import sys

import pytest
import timm
import torch
from timm.layers import ConvMlp

import vitprune
from vitprune import PruneConfig
from vitprune.commands.bench import merging_settings
from vitprune.commands.cli import main
from vitprune.core.config import PAPER_OPTIONS
from vitprune.measure.flops import count_flops

TINY = ["--model", "deit_tiny_patch16_224", "--img-size", "64", "--batch", "2", "--rounds", "2",
        "--warmup", "1", "--no-progress"]


def test_bench_writes_json_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", *TINY, "--no-memory", "--keep-rates", "1.0", "0.5", "--indicators", "var",
                 "--out", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [r["setting"] for r in rows] == ["unpruned", "var keep 1", "var keep 0.5"]
    assert rows[0]["speedup"] == 1.0
    assert rows[2]["gflops"] < rows[1]["gflops"]
    assert rows[2]["ideal_speedup"] == pytest.approx(rows[0]["gflops"] / rows[2]["gflops"])
    assert all(r["images_per_s"] > 0 and r["peak_memory_mb"] is None for r in rows)
    table = capsys.readouterr().out
    assert "var keep 0.5" in table and "ach/ideal" in table


def test_bench_runs_the_named_schedules_beside_block_lists(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--no-memory", "--keep-rates", "0.7", "--indicators", "default", "var",
                 "--stages", "spread", "spread2", "spread3", "paper", "1,3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    schedules = ("spread", "spread2", "spread3", "paper", "1,3")
    assert [(r["setting"], r["stages"]) for r in rows] == [("unpruned", None)] + [
        (f"{method} keep 0.7 @{stages}", [1, 3] if stages == "1,3" else stages)
        for method in ("default", "var") for stages in schedules]
    assert all(r["gflops"] < rows[0]["gflops"] for r in rows[1:])  # each one reduces
    # "paper": the paper's three stages scaled to the depth (stages=None), for the defaults' method too
    gflops = {r["setting"]: r["gflops"] for r in rows}
    model = timm.create_model("deit_tiny_patch16_224", img_size=64)
    for method, options in (("default", {}), ("var", {**PAPER_OPTIONS, "indicator": "var"})):
        patched = vitprune.patch(copy.deepcopy(model), PruneConfig(**{**options, "keep_rate": 0.7, "stages": None}))
        assert gflops[f"{method} keep 0.7 @paper"] == pytest.approx(count_flops(patched, (64, 64)) / 1e9)
    assert gflops["default keep 0.7 @paper"] != gflops["default keep 0.7 @spread"]


@pytest.mark.slow
def test_bench_times_eager_and_compiled_side_by_side(tmp_path, monkeypatch):
    # the rows' plumbing is what is tested here (inductor itself: test_compile.py): aot_eager
    # captures the same graphs without inductor's C++ build, most of a cold minute on 2 cores
    compiled_models, compile_ = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: compiled_models.append(model) or compile_(
        model, backend="aot_eager"))
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--no-memory", "--keep-rates", "0.5", "--indicators", "var",
                 "--compile", "both", "--out", str(out)]) == 0
    assert len(compiled_models) == 2  # the unpruned and the pruned model, once each
    rows = json.loads(out.read_text())
    assert [(r["setting"], r["compiled"]) for r in rows] == [
        ("unpruned", False), ("var keep 0.5", False), ("unpruned, compiled", True), ("var keep 0.5, compiled", True)]
    assert rows[0]["speedup"] == 1.0 and rows[2]["speedup"] != 1.0  # compiled is timed against eager
    assert rows[3]["gflops"] == rows[1]["gflops"]


@pytest.mark.slow
def test_bench_training_step_with_memory_and_csv(tmp_path):
    out = tmp_path / "bench.csv"
    code = main(["bench", *TINY, "--mode", "train", "--indicators", "medad", "--keep-rates", "0.5",
                 "--stages", "1,2", "--out", str(out)])
    assert code == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("model,setting,indicator") and len(lines) == 3
    assert "medad keep 0.5 @1,2" in lines[2]


def test_bench_bf16_weights_times_bfloat16_models_without_autocast(tmp_path, monkeypatch):
    import vitprune.commands.bench as bench

    timed, make_step = [], bench.make_step

    def recording(model, x, mode, dtype, compiled=False):
        timed.append((next(model.parameters()).dtype, x.dtype, dtype))
        return make_step(model, x, mode, dtype, compiled)

    monkeypatch.setattr(bench, "make_step", recording)
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--no-memory", "--keep-rates", "0.5", "--indicators", "default", "var",
                 "--baseline", "merge", "--dtype", "bf16-weights", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["dtype"] for r in rows] == ["bf16-weights"] * 4
    # every model and its images in bfloat16, and no autocast (float32 turns it off in make_step)
    assert timed == [(torch.bfloat16, torch.bfloat16, torch.float32)] * 4
    assert all(r["images_per_s"] > 0 and r["gflops"] > 0 for r in rows)


@pytest.mark.parametrize("options, message", [
    (["--model", "no_such_model"], "unknown timm model 'no_such_model'"),
    (["--keep-rates", "1.5"], "keep_rate must be in (0, 1]"),
    pytest.param(["--device", "cuda"], "no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")),
    (["--out", "table.txt"], "must end in .json or .csv"),
    (["--stages", "3,x"], "comma-separated block indices"),
    (["--stages", "3,,9"], "comma-separated block indices like 3,6,9, got '3,,9'"),  # not (3, 9)
    (["--stages", "3,6,"], "comma-separated block indices like 3,6,9, got '3,6,'"),
    (["--stages", "spread4"], "one of spread, spread2, spread3, all, paper or comma-separated block indices"),
    (["--indicators", "entropy"], "invalid choice"),
    (["--batch", "0"], "positive integer"),
    (["--overlap-strides", "0"], "argument --overlap-strides: must be a positive integer, got 0"),
    (["--model", "xcit_nano_12_p16_224"], "its cross-covariance attention mixes channels"),
    (["--dtype", "bf16-weights", "--mode", "train"], "--dtype bf16-weights times inference only"),
])
def test_bad_options_exit_non_zero_with_a_message(options, message, capsys):
    try:
        code = main(["bench", *TINY, "--no-memory", *options])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_console_entry_reports_errors_with_exit_status_2():
    result = subprocess.run([sys.executable, "-m", "vitprune", "bench", "--model", "no_such_model"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "unknown timm model" in result.stderr


def test_bench_times_the_merging_baseline_at_the_defaults_flops(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--keep-rates", "1.0", "0.7", "--indicators", "default", "--baseline", "merge",
                 "--out", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["unpruned", "default keep 1", "default keep 0.7", "merging @ default keep 0.7"]
    merging, default = rows["merging @ default keep 0.7"], rows["default keep 0.7"]
    assert merging["indicator"] == "merging" and merging["peak_memory_mb"] > 0  # rebuilt in the memory child
    # fitted to the defaults' cost: at most it, and within the last merged token of it
    assert 0.9 * default["gflops"] < merging["gflops"] <= default["gflops"]


@pytest.mark.parametrize("flag, expected", [([], True), (["--class-only-last", "off"], False),
                                            (["--class-only-last"], True)], ids=["auto", "off", "on"])
def test_bench_class_only_last_reaches_every_method_and_the_rows(tmp_path, flag, expected):
    """``auto``: each method's own (the defaults on for a class-token head, the paper off);
    ``off``/``on``: every method; the rows record what the patched model ran."""
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--no-memory", "--keep-rates", "0.5", "--indicators", "default", "var",
                 *flag, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["class_only_last"] for r in rows] == [None, expected, expected if flag else False]
    suffix = {(): "", ("--class-only-last", "off"): " full last", ("--class-only-last",): " class-only last"}
    assert rows[1]["setting"] == "default keep 0.5" + suffix[tuple(flag)]
    if not flag:  # the saving: fewer FLOPs than the paper's three stages at the same keep rate
        assert rows[1]["gflops"] < rows[2]["gflops"]


def test_the_merging_baseline_runs_on_a_hybrid(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "vit_tiny_r_s16_p8_224", "--batch", "1", "--rounds", "1", "--warmup", "0",
                 "--no-memory", "--no-progress", "--keep-rates", "0.7", "--indicators", "default",
                 "--baseline", "merge", "--out", str(out)]) == 0  # 49 tokens from the stem's 56x56 map
    rows = {row["setting"].split()[0]: row for row in json.loads(out.read_text())}
    assert rows["merging"]["gflops"] <= rows["default"]["gflops"] < rows["unpruned"]["gflops"]


def test_the_merging_baseline_needs_analytic_flops():
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1, mlp_layer=ConvMlp)
    with pytest.raises(TypeError, match="--baseline merge fits token merging to the analytic FLOPs, which refuse "
                                        "this model: .*has convolutions inside its blocks"):
        merging_settings(model, [0.7], (32, 32))


def test_bench_measures_the_library_defaults_unless_told_otherwise(tmp_path):
    # with no --indicators, the first method timed is what patch(model, keep_rate=...) does
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--no-memory", "--keep-rates", "0.7", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["setting"] for r in rows] == ["unpruned", "default keep 0.7", "var keep 0.7"]
    model = timm.create_model("deit_tiny_patch16_224", img_size=64)
    patched = vitprune.patch(copy.deepcopy(model), keep_rate=0.7)
    assert rows[1]["gflops"] == pytest.approx(count_flops(patched, (64, 64)) / 1e9)
