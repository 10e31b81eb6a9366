"""PruneConfig validation and resolution."""

import math

import pytest
import torch

from vitprune import PruneConfig, default_stages
from vitprune.core.config import PAPER_OPTIONS, method_options, spread_blocks


@pytest.mark.parametrize("depth, expected", [(12, (3, 6, 9)), (24, (6, 12, 18)), (6, (1, 3, 4)), (2, (0, 1)), (1, (0,))])
def test_default_stages_scale_with_depth(depth, expected):
    assert default_stages(depth) == expected


def test_resolve_fills_stages_and_per_stage_rates():
    cfg = PruneConfig(keep_rate=0.6, stages=None).resolve(12)
    assert cfg.stages == (3, 6, 9) and cfg.keep_rate == (0.6, 0.6, 0.6)
    cfg = PruneConfig(keep_rate=[0.9, 0.8], stages=[2, 5]).resolve(8)
    assert cfg.stages == (2, 5) and cfg.keep_rate == (0.9, 0.8)


def test_schedule_gives_the_blocks_and_their_rates_as_tuples():
    resolved = PruneConfig(keep_rate=0.7, class_only_last=True).resolve(12, 196)
    assert resolved.schedule() == (tuple(range(11)), (0.924,) * 11)  # "spread", the last block computing the class
    assert PruneConfig(keep_rate=0.5, stages=[3, 6]).schedule() == ((3, 6), (0.5, 0.5))  # one rate, repeated
    assert PruneConfig(keep_rate=[0.9, 0.8], stages=(2, 5)).schedule() == ((2, 5), (0.9, 0.8))
    assert PruneConfig(keep_rate=[], stages=()).schedule() == ((), ())
    for stages in ("spread", "spread2", "spread3", "all", None):
        with pytest.raises(ValueError, match=f"stages={stages!r} name no blocks until resolved for a model"):
            PruneConfig(keep_rate=0.5, stages=stages).schedule()


def test_config_is_frozen():
    with pytest.raises(Exception):
        PruneConfig().T = 2.0


@pytest.mark.parametrize("options, error, match", [
    ({"indicator": "variance"}, ValueError, "accepted: 'var', 'medad', 'cls', 'random'"),
    ({"keep_rate": 0.0}, ValueError, r"keep_rate must be in \(0, 1\]"),
    ({"keep_rate": 1.5}, ValueError, r"keep_rate must be in \(0, 1\]"),
    ({"keep_rate": -0.2}, ValueError, r"keep_rate must be in \(0, 1\]"),
    ({"keep_rate": math.nan}, ValueError, r"keep_rate must be in \(0, 1\], got nan"),
    ({"keep_rate": "0.7"}, TypeError, "keep_rate"),
    ({"keep_rate": True}, TypeError, "keep_rate"),
    ({"keep_rate": ()}, ValueError, "non-empty"),
    ({"keep_rate": (0.7, 0.5), "stages": (3, 6, 9)}, ValueError, "one keep_rate per stage"),
    ({"stages": (3, 3)}, ValueError, "repeat"),
    ({"stages": (6, 3)}, ValueError, "increasing"),
    ({"stages": (-1,)}, ValueError, "negative"),
    ({"stages": (1.5,)}, TypeError, "block indices"),
    ({"stages": 3}, TypeError, "sequence"),
    ({"stages": {3: 0.9, 6: 0.7}}, TypeError, r"got a dict; for a keep rate per stage pass keep_rate=\(...\)"),
    ({"stages": {3, 6}}, TypeError, "sequence of block indices, in order, got a set {3, 6}"),
    ({"stages": b"\x03\x06"}, TypeError, r"sequence of block indices, got b'\\x03\\x06'"),  # bytes iterate as ints
    ({"stages": bytearray(b"\x03\x06")}, TypeError, r"sequence of block indices, got bytearray\(b'\\x03\\x06'\)"),
    ({"stages": memoryview(b"\x03\x06")}, TypeError, "sequence of block indices, got <memory at"),
    ({"stages": "spread4"}, ValueError, "unknown stages 'spread4'; accepted: 'spread', 'spread2', 'spread3', 'all', None"),
    ({"T": 0.0}, ValueError, "T must be > 0"),
    ({"T": -1.0}, ValueError, "T must be > 0"),
    ({"T": "hot"}, TypeError, "T must be"),
    ({"fuse": 1}, TypeError, "fuse"),
    ({"seed": 3}, ValueError, "seed only applies"),
    ({"indicator": "random", "seed": 1.5}, TypeError, "seed"),
])
def test_bad_values_raise_clearly(options, error, match):
    with pytest.raises(error, match=match):
        PruneConfig(**options)


def test_a_temperature_or_indicator_is_taken_where_the_reduction_reads_it():
    # the fusion token weighs by the scores at temperature T, whatever chose the tokens
    assert PruneConfig(T=0.5, reduction="fuse").T == 0.5
    assert PruneConfig(indicator="medad", selection="bipartite", reduction="fuse").indicator == "medad"
    assert PruneConfig(indicator="var", selection="redundant", reduction="drop").selection == "redundant"
    assert PruneConfig(T=1.0).reduction == "merge"  # the default temperature is no request


def test_numpy_values_are_taken_as_the_python_numbers_they_hold():
    """Sweeps often come from NumPy (``np.linspace``, ``np.arange``): its floats, integers and
    integer arrays are taken as Python floats and ints (an array of stages failed on its
    element-wise ``!=``, and a NumPy seed inside torch's generator)."""
    np = pytest.importorskip("numpy")
    config = PruneConfig(indicator="random", keep_rate=np.float32(0.5), stages=np.arange(2, 5), seed=np.int64(3),
                         T=np.float64(2.0), reduction="fuse")
    assert config.stages == (2, 3, 4) and all(type(s) is int for s in config.stages)
    assert config.seed == 3 and type(config.seed) is int and config.keep_rate == 0.5
    torch.Generator().manual_seed(config.seed)  # what patch does with it


def test_resolve_rejects_stages_beyond_the_model():
    with pytest.raises(ValueError, match=r"out of range: the model has 12 blocks \(valid indices 0..11\)"):
        PruneConfig(stages=(3, 12)).resolve(12)


def test_resolve_rejects_rates_that_do_not_fit_the_default_stages():
    # each message says what the rates stand for under that schedule, and how many it takes
    with pytest.raises(ValueError, match=r"the paper's stages for 12 blocks \(stages=None\) are \(3, 6, 9\); "
                                         "give 3 values or a single float, or pass stages explicitly"):
        PruneConfig(keep_rate=(0.7, 0.7), stages=None).resolve(12)
    for spread in ("spread", "spread2", "spread3"):  # matched to the cost of the paper's stages
        with pytest.raises(ValueError, match=rf"with stages='{spread}' they are the rates of the paper's stages "
                                             r"for 12 blocks, \(3, 6, 9\), whose cost the schedule matches; give 3"):
            PruneConfig(keep_rate=(0.7, 0.7), stages=spread).resolve(12, 196)
    with pytest.raises(ValueError, match="stages='all' is all 12 blocks of this model; give 12 values"):
        PruneConfig(keep_rate=(0.7, 0.7), stages="all").resolve(12)
    with pytest.raises(ValueError, match="pass num_patches"):
        PruneConfig(keep_rate=0.7).resolve(12)


def tokens_summed(rates, stages, depth, n, fuse=False):
    """By hand: tokens through every block's attention and MLP."""
    total = 0
    for index in range(depth):
        total += n
        if index in stages:
            k = math.ceil(round(rates[stages.index(index)] * n, 9))
            n = k + 1 if fuse and k < n else k
        total += n
    return total


def assert_largest_within(rate, stages, depth, n, budget):
    """By hand: ``rate`` in every block of ``stages`` stays within ``budget`` tokens, and the
    next rate that keeps one more token somewhere goes over it."""
    reached = tokens_summed([rate] * len(stages), stages, depth, n)
    assert reached <= budget
    step = next(r for r in (rate + i * 1e-4 for i in range(1, 10000))
                if tokens_summed([r] * len(stages), stages, depth, n) != reached)
    assert tokens_summed([step] * len(stages), stages, depth, n) > budget


@pytest.mark.parametrize("keep, depth, n", [(0.7, 12, 196), (0.5, 12, 196), (0.9, 6, 49), (0.3, 24, 256)])
def test_spread_reduces_in_every_block_within_the_papers_token_count(keep, depth, n):
    cfg = PruneConfig(keep_rate=keep).resolve(depth, n)
    rate = cfg.keep_rate[0]
    assert cfg.stages == tuple(range(depth)) and cfg.keep_rate == (rate,) * depth
    paper = PruneConfig(keep_rate=keep, stages=None).resolve(depth)
    budget = tokens_summed(paper.keep_rate, paper.stages, depth, n)
    assert_largest_within(rate, list(range(depth)), depth, n, budget)


@pytest.mark.parametrize("depth", range(1, 9))
def test_the_class_token_alone_leaves_the_spread_rate_of_the_other_blocks_as_it_was(depth):
    """``"spread"`` is fitted with every block counted on both sides: with ``class_only_last``
    it loses its last block's stage and the other blocks keep their rate. At depths 2 to 4
    the paper's stages include the last block; its stage was once left out on the paper's
    side only, so the rate with the option came out higher (0.56 for 0.5 at depth 2, 16
    patches), and so did the FLOPs and the logits."""
    for n in (4, 16, 49, 196):
        for keep in (0.9, 0.7, 0.5, 0.3):
            on = PruneConfig(keep_rate=keep, class_only_last=True).resolve(depth, n)
            off = PruneConfig(keep_rate=keep, class_only_last=False).resolve(depth, n)
            assert off.stages == tuple(range(depth)), (n, keep)
            assert (on.stages, on.keep_rate) == (off.stages[:-1], off.keep_rate[:-1]), (n, keep)


@pytest.mark.parametrize("stages", ["spread", "spread2", "spread3"])
@pytest.mark.parametrize("depth, n", [(12, 196), (6, 49), (4, 16)])
def test_every_spread_schedule_at_keep_rate_one_keeps_rate_one(stages, depth, n):
    for class_only in (True, False):
        cfg = PruneConfig(keep_rate=1.0, stages=stages, class_only_last=class_only).resolve(depth, n)
        assert cfg.stages and cfg.keep_rate == (1.0,) * len(cfg.stages)


@pytest.mark.parametrize("depth, step, expected", [
    (12, 2, (1, 3, 5, 7, 9, 11)), (12, 3, (2, 5, 8, 11)), (12, 1, tuple(range(12))),
    (6, 2, (1, 3, 5)), (6, 3, (2, 5)), (8, 3, (1, 4, 7)), (1, 3, (0,)), (2, 3, (1,)),
])
def test_the_sparser_spread_schedules_count_their_blocks_back_from_the_last(depth, step, expected):
    assert spread_blocks(depth, step) == expected


@pytest.mark.parametrize("keep, depth, n, stages, class_only, blocks", [
    (0.7, 12, 196, "spread2", True, (1, 3, 5, 7, 9)),
    (0.7, 12, 196, "spread3", True, (2, 5, 8)),
    (0.5, 12, 196, "spread2", False, (1, 3, 5, 7, 9, 11)),
    (0.9, 6, 49, "spread3", True, (2,)),
    (0.3, 24, 256, "spread3", False, (2, 5, 8, 11, 14, 17, 20, 23)),
    (0.6, 8, 49, "spread2", True, (1, 3, 5)),
])
def test_spread2_and_spread3_keep_the_most_tokens_within_spread_as_it_runs(keep, depth, n, stages, class_only, blocks):
    spread = PruneConfig(keep_rate=keep, class_only_last=class_only).resolve(depth, n)
    budget = tokens_summed(spread.keep_rate, spread.stages, depth, n)
    cfg = PruneConfig(keep_rate=keep, stages=stages, class_only_last=class_only).resolve(depth, n)
    rate = cfg.keep_rate[0]
    assert cfg.stages == blocks and cfg.keep_rate == (rate,) * len(blocks) and rate < 1
    assert_largest_within(rate, list(blocks), depth, n, budget)
    # the fusion token counts: the paper's reduction resolves to a schedule of its own
    fused = PruneConfig(keep_rate=keep, stages=stages, class_only_last=class_only, reduction="fuse")
    assert fused.resolve(depth, n).stages == blocks


def test_method_options_name_the_defaults_or_the_papers_method_with_an_indicator():
    assert method_options("default") == {}
    assert method_options("var") == {"indicator": "var", **PAPER_OPTIONS}
    assert method_options("default", "paper") == {"stages": None}  # the paper's stages for the defaults' method
    assert method_options("medad", "paper") == method_options("medad")  # an indicator's own schedule
    assert method_options("cls", "spread2") == {"indicator": "cls", **PAPER_OPTIONS, "stages": "spread2"}
    assert method_options("default", (1, 3)) == {"stages": (1, 3)}
    with pytest.raises(ValueError, match="unknown method 'merging'; accepted: default, var"):
        method_options("merging")
