"""The experiment scripts' statistics (examples/reporting.py), on hand-computed rows."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from reporting import paired, unique_runs  # noqa: E402

MATCH = ("seed", "repeat", "budget")


def run(method, seed, repeat, budget, accuracy):
    return {"method": method, "seed": seed, "repeat": repeat, "budget": budget, "accuracy": accuracy}


def test_paired_differences_are_run_for_run():
    rows = [run("base", 0, 0, 0.6, 0.80), run("base", 0, 1, 0.6, 0.70), run("base", 1, 0, 0.6, 0.90),
            run("ours", 0, 0, 0.6, 0.85), run("ours", 0, 1, 0.6, 0.60), run("ours", 1, 0, 0.6, 0.90),
            run("ours", 2, 0, 0.6, 0.99)]  # seed 2 has no baseline run: left out
    (cell,) = paired(rows, "base", MATCH, ["method", "budget"])
    # differences +0.05, -0.10, 0.00: mean -0.05 / 3, sample variance of the three
    mean = (0.05 - 0.10 + 0.0) / 3
    variance = sum((d - mean) ** 2 for d in (0.05, -0.10, 0.0)) / 2
    assert cell["method"] == "ours" and cell["n"] == 3 and cell["ahead"] == 1
    assert cell["mean"] == pytest.approx(mean)
    assert cell["std"] == pytest.approx(variance ** 0.5)


def test_paired_groups_by_budget_and_skips_the_reference():
    rows = [run("base", 0, 0, b, 0.5) for b in (0.6, 0.8)] + [run("ours", 0, 0, 0.6, 0.7),
                                                               run("ours", 0, 0, 0.8, 0.4)]
    cells = {c["budget"]: c for c in paired(rows, "base", MATCH, ["method", "budget"])}
    assert set(cells) == {0.6, 0.8}
    assert cells[0.6]["mean"] == pytest.approx(0.2) and cells[0.6]["ahead"] == 1
    assert cells[0.8]["mean"] == pytest.approx(-0.1) and cells[0.8]["ahead"] == 0
    assert cells[0.8]["std"] == 0.0 and cells[0.8]["n"] == 1


def test_unique_runs_counts_a_run_recorded_twice_once():
    a, b = run("unpruned", 0, 0, 1.0, 0.8), run("unpruned", 0, 1, 1.0, 0.7)
    assert unique_runs([a, b, dict(a)], ["method", "seed", "repeat", "budget"]) == [a, b]


def test_unique_runs_keeps_rows_that_differ_in_an_absent_key():
    a, b = run("x", 0, 0, 0.6, 0.8), {**run("x", 0, 0, 0.6, 0.8), "steps": 10}
    assert len(unique_runs([a, b], ["method", "seed", "repeat", "budget", "steps"])) == 2


def test_unique_runs_refuses_two_records_of_one_run_that_disagree():
    with pytest.raises(ValueError, match="disagree"):
        unique_runs([run("x", 0, 0, 0.6, 0.8), run("x", 0, 0, 0.6, 0.81)], MATCH + ("method",))
