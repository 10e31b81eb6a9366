"""One answer, everywhere, to "is this a whole number?" and "is this a real number?":
NumPy scalars are taken as the Python numbers they hold, a bool is refused."""

from fractions import Fraction

import pytest
import torch

import vitprune
from vitprune.core.numeric import is_real, is_whole
from vitprune.measure.evaluate import build_settings

np = pytest.importorskip("numpy")


@pytest.mark.parametrize("value, whole, real", [
    (3, True, True),
    (-2, True, True),
    (np.int64(3), True, True),
    (np.uint8(3), True, True),
    (0.7, False, True),
    (3.0, False, True),  # a float is not a whole number, even when it holds one
    (np.float32(0.7), False, True),
    (Fraction(7, 10), False, True),
    (float("nan"), False, True),  # the range is each caller's to check
    (True, False, False),
    (np.bool_(False), False, False),
    ("3", False, False),
    (None, False, False),
    (1j, False, False),
    (torch.tensor(3), False, False),  # a tensor is not a number: .item() it
])
def test_the_two_predicates(value, whole, real):
    assert is_whole(value) is whole
    assert is_real(value) is real


def test_merging_takes_numpy_counts_as_the_ints_they_hold(tiny):
    assert vitprune.merging_config(tiny, np.int64(8)) == vitprune.merging_config(tiny, 8)
    per_block = vitprune.merging_config(tiny, list(np.full(12, 8)))
    assert per_block == vitprune.merging_config(tiny, [8] * 12)
    assert all(type(rate) is float for rate in per_block.keep_rate)
    for bad in ([True] * 12, [np.float64(8)] * 12):
        with pytest.raises(ValueError, match=r"r must be an int >= 0 or 12 of them"):
            vitprune.merging_config(tiny, bad)


def test_settings_take_numpy_rates_and_budgets(tiny):
    """A float32 keep rate of 0.7 was refused as 'must be in (0, 1], got 0.7'."""
    rate, budget = np.float32(0.7), np.float32(0.6)
    from_numpy = build_settings(tiny, keep_rates=[rate], budgets=[budget])
    from_python = build_settings(tiny, keep_rates=[float(rate)], budgets=[float(budget)])
    assert [s.label for s in from_numpy] == [s.label for s in from_python]
    assert [s.options for s in from_numpy] == [s.options for s in from_python]
    assert all(type(s.keep_rate) is float and type(s.options["keep_rate"]) is float for s in from_numpy[1:])
    assert type(from_numpy[-1].budget) is float  # for the results JSON
    for bad in (True, "0.7", 0.0, float("nan")):
        with pytest.raises(ValueError, match=r"a keep rate must be in \(0, 1\]"):
            build_settings(tiny, keep_rates=[bad])


def test_default_stages_takes_a_whole_number_of_blocks():
    assert vitprune.default_stages(np.int64(12)) == vitprune.default_stages(12) == (3, 6, 9)
    for bad in (12.0, True, "12"):
        with pytest.raises(TypeError, match=r"depth must be a whole number of blocks \(int\)"):
            vitprune.default_stages(bad)


def test_fit_overlap_names_a_minimum_keep_rate_that_is_no_number(tiny):
    with pytest.raises(ValueError, match=r"min_keep_rate must be in \(0, 1\], got '0.5'"):
        vitprune.fit_overlap(tiny, min_keep_rate="0.5")
    with pytest.raises(ValueError, match=r"min_keep_rate must be in \(0, 1\], got True"):
        vitprune.fit_overlap(tiny, min_keep_rate=True)


@pytest.mark.parametrize("target, error, match", [
    ("1", TypeError, "target_gflops must be a number of GFLOPs, got str '1'"),  # was Python's '>' not supported
    (True, TypeError, "target_gflops must be a number of GFLOPs, got bool True"),  # was read as 1 GFLOP
    (float("inf"), ValueError, "target_gflops must be > 0 and finite"),
    (0, ValueError, "target_gflops must be > 0 and finite"),
])
def test_fit_merging_checks_its_budget_as_fit_keep_rate_does(tiny, target, error, match):
    with pytest.raises(error, match=match):
        vitprune.fit_merging(tiny, target)
    with pytest.raises(error, match=match):
        vitprune.fit_keep_rate(tiny, target)


def test_fit_merging_takes_a_numpy_budget(tiny):
    target = 0.8 * vitprune.analytic_flops(tiny) / 1e9
    assert vitprune.fit_merging(tiny, np.float32(target)) == vitprune.fit_merging(tiny, float(np.float32(target)))
