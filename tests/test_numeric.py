"""One answer, everywhere, to "is this a whole number?" and "is this a real number?":
NumPy scalars are taken as the Python numbers they hold, a bool is refused."""

from fractions import Fraction

import pytest
import torch

import vitprune
from conftest import assert_same, make_model, snapshot
from vitprune.core.numeric import is_real, is_whole, real_or_type_error
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
        with pytest.raises(TypeError, match=r"r must be an int >= 0 or 12 of them"):
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
    for bad in (True, "0.7", None):
        with pytest.raises(TypeError, match=rf"a keep rate must be a number in \(0, 1\], got {type(bad).__name__}"):
            build_settings(tiny, keep_rates=[bad])
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=rf"a keep rate must be in \(0, 1\], got {bad!r}"):
            build_settings(tiny, keep_rates=[bad])
    with pytest.raises(TypeError, match=r"a budget must be a number in \(0, 1\], got str '0.6'"):
        build_settings(tiny, budgets=["0.6"])


def test_default_stages_takes_a_whole_number_of_blocks():
    assert vitprune.default_stages(np.int64(12)) == vitprune.default_stages(12) == (3, 6, 9)
    for bad in (12.0, True, "12"):
        with pytest.raises(TypeError, match=r"depth must be a whole number of blocks \(int\)"):
            vitprune.default_stages(bad)


def test_fit_overlap_names_a_minimum_keep_rate_that_is_no_number(tiny):
    with pytest.raises(TypeError, match=r"min_keep_rate must be a number in \(0, 1\], got str '0.5'"):
        vitprune.fit_overlap(tiny, min_keep_rate="0.5")
    with pytest.raises(TypeError, match=r"min_keep_rate must be a number in \(0, 1\], got bool True"):
        vitprune.fit_overlap(tiny, min_keep_rate=True)
    for bad in (0.0, float("nan")):
        with pytest.raises(ValueError, match=rf"min_keep_rate must be in \(0, 1\], got {bad!r}"):
            vitprune.fit_overlap(tiny, min_keep_rate=bad)


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


def test_real_or_type_error_leaves_the_range_to_its_caller():
    assert real_or_type_error("x", np.float32(0.5), "a number") == 0.5
    assert type(real_or_type_error("x", Fraction(1, 4), "a number")) is float
    assert real_or_type_error("x", float("inf"), "a number") == float("inf")
    assert real_or_type_error("x", float("nan"), "a number") != real_or_type_error("x", float("nan"), "a number")
    for bad, kind in ((True, "bool"), ("1", "str"), (None, "NoneType"), (torch.tensor(1.0), "Tensor")):
        with pytest.raises(TypeError, match=rf"^x must be a number, got {kind} "):
            real_or_type_error("x", bad, "a number")


def _visualize(model, **options):
    pytest.importorskip("matplotlib")
    vitprune.visualize(model, torch.zeros(1, 3, 224, 224), **options)


def _unmerge(model, block):
    vitprune.patch(model, keep_rate=0.7)
    model(torch.zeros(1, 3, 224, 224))
    vitprune.unmerge(model, torch.zeros(1, 197, 192), block)


def _evaluate(model, limit):
    from vitprune.measure.evaluate import evaluate
    evaluate(model, iter(()), build_settings(model, keep_rates=[0.7]), limit=limit)


#: Every number a public function takes, as (call with the value, a value of the right kind out
#: of range). A real number's NaN is out of range; a whole number's float is of the wrong kind.
NUMBERS = {
    "patch keep_rate": (lambda m, v: vitprune.patch(m, keep_rate=v), float("nan")),
    "patch T": (lambda m, v: vitprune.patch(m, indicator="var", selection="top", reduction="fuse", T=v), float("nan")),
    "patch crowding": (lambda m, v: vitprune.patch(m, crowding=v), float("inf")),
    "patch seed": (lambda m, v: vitprune.patch(m, indicator="random", selection="top", seed=v), None),
    "patch overlap_stride": (lambda m, v: vitprune.patch(m, overlap_stride=v), 0),
    "patch stages": (lambda m, v: vitprune.patch(m, stages=(v,)), -1),
    "fit_keep_rate target_gflops": (lambda m, v: vitprune.fit_keep_rate(m, v), float("nan")),
    "fit_merging target_gflops": (lambda m, v: vitprune.fit_merging(m, v), float("nan")),
    "fit_overlap target_gflops": (lambda m, v: vitprune.fit_overlap(m, v), float("nan")),
    "fit_overlap min_keep_rate": (lambda m, v: vitprune.fit_overlap(m, 1.0, min_keep_rate=v), float("nan")),
    "merging_config r": (lambda m, v: vitprune.merging_config(m, v), -1),
    "merging_config r per block": (lambda m, v: vitprune.merging_config(m, [v] * 12), -1),
    "analytic_flops img_size": (lambda m, v: vitprune.analytic_flops(m, img_size=v), 8),
    "default_stages depth": (lambda m, v: vitprune.default_stages(v), 0),
    "keep_count keep_rate": (lambda m, v: vitprune.keep_count(v, 196), float("nan")),
    "keep_count n": (lambda m, v: vitprune.keep_count(0.7, v), 0),
    "unmerge block": (lambda m, v: _unmerge(m, v), 12),
    "build_settings keep_rates": (lambda m, v: build_settings(m, keep_rates=[v]), float("nan")),
    "build_settings budgets": (lambda m, v: build_settings(m, budgets=[v]), float("nan")),
    "evaluate limit": (_evaluate, 0),
    "visualize dim": (lambda m, v: _visualize(m, dim=v), float("nan")),
    "visualize panel_inches": (lambda m, v: _visualize(m, panel_inches=v), float("nan")),
}


@pytest.mark.parametrize("name", NUMBERS)
def test_every_number_argument_raises_type_error_for_the_wrong_kind_and_value_error_out_of_range(tiny, name):
    call, out_of_range = NUMBERS[name]
    for wrong_kind in ("1", True, 0.5j):
        with pytest.raises(TypeError):
            call(tiny, wrong_kind)
    if out_of_range is not None:  # a seed takes every int
        with pytest.raises(ValueError):
            call(tiny, out_of_range)


def test_keep_count_takes_numpy_numbers():
    assert vitprune.keep_count(np.float32(0.7), np.int64(196)) == vitprune.keep_count(0.7, 196) == 138


#: Every argument that takes a sequence of whole numbers, with one it takes (for ``tiny``:
#: 12 blocks at 224 x 224). The same numbers as a byte string iterate as the same ints.
SEQUENCES = {
    "patch stages": (lambda m, v: vitprune.patch(m, stages=v), [3, 6, 9]),
    "analytic_flops img_size": (lambda m, v: vitprune.analytic_flops(m, img_size=v), [224, 224]),
    "merging_config r per block": (lambda m, v: vitprune.merging_config(m, v), [8] * 12),
}


@pytest.mark.parametrize("name", SEQUENCES)
def test_a_byte_string_is_no_sequence_of_whole_numbers(name):
    call, numbers = SEQUENCES[name]
    call(make_model("deit_tiny"), numbers)  # as a list, taken
    model = make_model("deit_tiny")
    before = snapshot(model)
    for text in (bytes(numbers), bytearray(numbers), memoryview(bytes(numbers))):
        with pytest.raises(TypeError, match=r"got (b'|bytearray\(b'|<memory at)"):
            call(model, text)
    assert_same(before, snapshot(model))
