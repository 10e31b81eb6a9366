"""The experiments on the paper's indicators (examples/experiment_offshelf.py,
experiment_finetune.py, experiment_sensitivity.py) run the paper's method, as their recorded
results did: on the shipped models, which have the architecture and the unpruned FLOPs of the
trained models behind those results, every setting a script patches costs the FLOPs its
results file records. (Naming only an indicator, as the scripts once did, runs the library's
schedule and reduction instead, at other FLOPs.)"""

import functools
import json
import math
import sys
from pathlib import Path

import pytest

from vitprune.data.shipped import load_shipped
from vitprune.measure.flops import analytic_flops

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import experiment_finetune  # noqa: E402
import experiment_offshelf  # noqa: E402
import experiment_sensitivity  # noqa: E402


@functools.lru_cache(maxsize=None)
def rows(name):
    """The rows of ``docs/results/NAME.json``, read once."""
    return json.loads((ROOT / "docs" / "results" / f"{name}.json").read_text())["rows"]


def recorded(name, *keys):
    """``(dataset, *keys) -> GFLOPs`` over the results file's pruned rows (one value each)."""
    found = {}
    for row in rows(name):
        if row["indicator"] == "unpruned":
            continue
        key = (row["dataset"], *(row[k] for k in keys))
        assert found.setdefault(key, row["gflops"]) == row["gflops"], key  # every seed's model costs the same
    return found


@pytest.fixture(scope="module")
def shipped():
    models = {dataset: load_shipped(dataset)[0] for dataset in ("fashion_mnist", "cluttered")}
    for name in ("offshelf", "finetune"):  # the stand-ins cost what the recorded models cost unpruned
        for row in rows(name):
            if row["indicator"] == "unpruned":
                assert analytic_flops(models[row["dataset"]]) / 1e9 == pytest.approx(row["gflops"], rel=1e-12)
    return models


def test_offshelf_runs_the_recorded_settings(shipped):
    settings = recorded("offshelf", "indicator", "keep_rate", "fuse")
    assert len(settings) == 64  # 2 datasets x 4 keep rates x (5 indicators with fusion + 3 without)
    for (dataset, indicator, rate, fuse), gflops in settings.items():
        model = experiment_offshelf.patched(shipped[dataset], indicator, rate, fuse, seed=0)
        assert analytic_flops(model) / 1e9 == pytest.approx(gflops, rel=1e-12), (dataset, indicator, rate, fuse)


def test_finetune_runs_the_recorded_settings(shipped):
    settings = recorded("finetune", "indicator", "keep_rate", "overlap_stride")
    for (dataset, indicator, rate, stride), gflops in settings.items():
        if stride is not None:  # the overlap the script fits is the one recorded
            assert (indicator, rate, stride) in set(experiment_finetune.settings(shipped[dataset]))
        model = experiment_finetune.patched(shipped[dataset], indicator, rate, stride, seed=0)
        assert analytic_flops(model) / 1e9 == pytest.approx(gflops, rel=1e-12), (dataset, indicator, rate, stride)
    assert any(stride is not None for _, _, _, stride in settings)


def test_sensitivity_runs_the_recorded_settings(shipped):
    settings = recorded("sensitivity", "indicator", "stages", "T")
    assert {stages for _, _, stages, _ in settings} == {"1,3,4", "0,2,4", "2,3,5", "1", "3"}
    for (dataset, indicator, stages, T), gflops in settings.items():
        blocks = tuple(int(block) for block in stages.split(","))
        model = experiment_sensitivity.patched(shipped[dataset], indicator, blocks, math.inf if T == "inf" else T)
        assert analytic_flops(model) / 1e9 == pytest.approx(gflops, rel=1e-12), (dataset, indicator, stages, T)
