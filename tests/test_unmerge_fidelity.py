"""The dense-feature comparison (examples/unmerge_fidelity.py): its measures by hand, and its
three methods held to the budget with every token through the last block."""

import sys
from pathlib import Path

import pytest
import torch

import vitprune
from vitprune.data.shipped import load_shipped
from vitprune.measure.evaluate import apply_setting

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import unmerge_fidelity  # noqa: E402


def test_the_measures_by_hand():
    reference = torch.tensor([[[9.0, 9.0], [1.0, 0.0], [0.0, 2.0]]])  # one image: a prefix token, two patches
    same = unmerge_fidelity.compare(reference, reference.clone(), prefix=1)
    assert same == {"cosine": pytest.approx(1.0), "relative_error": pytest.approx(0.0)}
    turned = torch.tensor([[[0.0, 0.0], [0.0, 1.0], [0.0, 2.0]]])  # patch 1 at right angles, patch 2 the same
    measures = unmerge_fidelity.compare(reference, turned, prefix=1)
    # cosines 0 and 1; |(-1, 1), (0, 0)| / |(1, 0), (0, 2)| = sqrt(2) / sqrt(5)
    assert measures == {"cosine": pytest.approx(0.5), "relative_error": pytest.approx((2 / 5) ** 0.5)}


def test_every_method_fits_its_budget_with_every_token_through_the_last_block():
    model, _ = load_shipped("fashion_mnist")
    unpruned = vitprune.analytic_flops(model)
    settings = unmerge_fidelity.settings(model)
    assert sorted((s.budget, unmerge_fidelity.NAMES[s.method]) for s in settings) == sorted(
        (b, name) for b in unmerge_fidelity.BUDGETS for name in ("defaults", "paper (var)", "token merging"))
    for setting in settings:
        patched = apply_setting(model, setting)
        assert vitprune.get_config(patched).class_only_last is False
        assert vitprune.analytic_flops(patched) <= setting.budget * unpruned
        vitprune.unpatch(model)
