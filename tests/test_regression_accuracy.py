"""Accuracy regression on the shipped trained models and their shipped real test images.

The paper's method (one fusion token, ``PAPER`` options):

Margins, in accuracy points on the 2,000-image subsets, were set from the measured
values (README, "Evidence") with room for float differences between machines:
- var and medad at keep 0.7 stay within ``WITHIN`` of the unpruned model;
- and beat the falsifier (lowvar: keep the patches the heads agree on) and random
  scores by at least the given leads. On Fashion-MNIST, var and medad do NOT beat
  random scores off the shelf (85.7 and 84.4 against 85.7 % here, README "Evidence"),
  so no lead over random is required there; on the cluttered set they do.
The last test shows the check fails when the indicator is the paper's Eq. 6 as printed.
"""

from functools import lru_cache

import pytest

import vitprune
from conftest import PAPER
from vitprune.core import indicators
from vitprune.data.accuracy import accuracy
from vitprune.data.shipped import load_shipped, load_test_subset
from vitprune.measure.flops import schedule_flops

pytestmark = pytest.mark.slow  # runs the shipped models over their test subsets

KEEP = 0.7
# dataset: {indicator: allowed drop from unpruned}, minimum lead over lowvar, over random
# measured on the subsets at keep 0.7 (unpruned / var / medad / random / lowvar):
# cluttered 75.35 / 74.65 / 73.70 / 65.40 / 33.75; fashion_mnist 91.20 / 85.70 / 84.35 / 85.65 / 69.35
MARGINS = {
    "cluttered": ({"var": 0.02, "medad": 0.03}, 0.20, 0.05),
    "fashion_mnist": ({"var": 0.07, "medad": 0.085}, 0.10, None),
}


@lru_cache(maxsize=None)
def measured(dataset: str, indicator: str) -> float:
    model, _ = load_shipped(dataset)
    if indicator != "unpruned":
        vitprune.patch(model, indicator=indicator, keep_rate=KEEP, **PAPER,
                       **({"seed": 0} if indicator == "random" else {}))
    return accuracy(model, *load_test_subset(dataset))


def check(dataset: str, indicator: str, score: float) -> None:
    within, above_lowvar, above_random = MARGINS[dataset]
    assert score >= measured(dataset, "unpruned") - within[indicator]
    assert score >= measured(dataset, "lowvar") + above_lowvar
    if above_random is not None:
        assert score >= measured(dataset, "random") + above_random


@pytest.mark.parametrize("dataset", sorted(MARGINS))
@pytest.mark.parametrize("indicator", ["var", "medad"])
def test_pruning_keeps_accuracy_and_beats_the_falsifier_and_random(dataset, indicator):
    check(dataset, indicator, measured(dataset, indicator))


def test_the_check_catches_the_papers_printed_eq6(monkeypatch):
    # Eq. 6 as printed: mean_h (a_h - mean_h a_h), zero up to rounding for every patch
    monkeypatch.setitem(indicators.SCORES, "var", lambda a: (a.float() - a.float().mean(1, keepdim=True)).mean(1))
    dataset = "cluttered"
    model, _ = load_shipped(dataset)
    vitprune.patch(model, indicator="var", keep_rate=KEEP, **PAPER)
    with pytest.raises(AssertionError):
        check(dataset, "var", accuracy(model, *load_test_subset(dataset)))


# The defaults against the paper's method and the token-merging baseline, each fitted to the
# same share of the unpruned analytic FLOPs, on the shipped subsets. Measured (2,000 images;
# the defaults with the class token alone in the last block, in brackets without it):
#   fashion_mnist 0.7: defaults 90.90 (90.35), paper 87.40, merging 90.75; 0.5: 89.00 (88.45), 76.85, 87.65
#   cluttered     0.7: defaults 75.35 (75.30), paper 74.70, merging 75.30; 0.5: 75.45 (74.50), 73.80, 74.45
# dataset, share: (lead over the paper's method, lead over merging; negative = may trail by)
DEFAULT_MARGINS = {
    ("fashion_mnist", 0.7): (0.02, 0.0),
    ("fashion_mnist", 0.5): (0.08, 0.01),
    ("cluttered", 0.7): (0.002, -0.001),
    ("cluttered", 0.5): (0.002, 0.005),
}


@lru_cache(maxsize=None)
def at_share(dataset: str, share: float, method: str) -> float:
    model, _ = load_shipped(dataset)
    target = share * schedule_flops(model, None) / 1e9
    if method == "defaults":
        vitprune.patch(model, keep_rate=vitprune.fit_keep_rate(model, target))
        assert vitprune.get_config(model).class_only_last  # the measured best on these class-token heads
    elif method == "paper":
        vitprune.patch(model, indicator="var", keep_rate=vitprune.fit_keep_rate(model, target, **PAPER), **PAPER)
    else:
        vitprune.patch(model, vitprune.fit_merging(model, target))
    return accuracy(model, *load_test_subset(dataset))


@pytest.mark.parametrize("dataset, share", sorted(DEFAULT_MARGINS))
def test_defaults_beat_the_papers_fusion_token_and_keep_up_with_merging(dataset, share):
    over_paper, over_merging = DEFAULT_MARGINS[(dataset, share)]
    defaults = at_share(dataset, share, "defaults")
    assert defaults >= at_share(dataset, share, "paper") + over_paper  # fails if the default falls back to fusion
    assert defaults >= at_share(dataset, share, "merging") + over_merging
