"""The block-cost benchmark (examples/block_cost.py): its fit of ``a + b N`` and its repeat count."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import block_cost  # noqa: E402


def test_the_fit_recovers_a_fixed_and_a_per_token_cost_by_hand():
    tokens = [40, 99, 138, 197]
    seconds = [0.002 + 3e-5 * n for n in tokens]  # 2 ms fixed, 30 us per token
    a, b = block_cost.fit(tokens, seconds)
    assert a == pytest.approx(0.002, rel=1e-9) and b == pytest.approx(3e-5, rel=1e-9)
    assert block_cost.predicted([a, b], 197) == pytest.approx(0.002 + 197 * 3e-5, rel=1e-9)


def test_the_fit_is_least_squares_for_noisy_times():
    # t = 1 + N exactly at N = 0 and 2, one point 1 too high at N = 1: the line moves by a third
    a, b = block_cost.fit([0, 1, 2], [1.0, 3.0, 3.0])
    assert (a, b) == (pytest.approx(4 / 3), pytest.approx(1.0))


def test_short_calls_are_repeated_to_last_about_the_asked_time():
    calls = []
    assert block_cost.repeat_for(lambda: calls.append(1), 0.0) == 1  # at least once
    assert block_cost.repeat_for(lambda: None, 1e-3) > 1


def test_distinct_times_every_block_and_the_first_alike(tmp_path, monkeypatch):
    out = tmp_path / "cost.json"
    monkeypatch.setattr(sys, "argv", ["block_cost.py", "--model", "deit_tiny_patch16_224", "--rounds", "1",
                                      "--warmup", "0", "--distinct", "--json", str(out)])
    block_cost.main()
    found = json.loads(out.read_text())
    assert set(found["modes"]) == {"one block", "every block"}
    for mode in found["modes"].values():
        assert [row["tokens"] for row in mode["rows"]] == [1 + max(1, round(s * 196)) for s in block_cost.SHARES]
        assert all(row["ms"] > 0 for row in mode["rows"]) and mode["rows"][0]["time_share"] == 1.0
        assert mode["defaults_flop_ratio"] > 1


def test_multiple_residuals_average_the_distance_from_the_line_by_hand():
    rows = [{"tokens": 8, "ms": 1.0, "fit_ms": 1.25}, {"tokens": 9, "ms": 1.5, "fit_ms": 1.0},
            {"tokens": 16, "ms": 2.0, "fit_ms": 2.75}, {"tokens": 17, "ms": 2.0, "fit_ms": 2.5}]
    assert block_cost.multiple_residuals(rows, 8) == pytest.approx((-0.5, 0.0))
    assert block_cost.multiple_residuals(rows, 16) == pytest.approx((-0.75, (-0.25 + 0.5 - 0.5) / 3))
