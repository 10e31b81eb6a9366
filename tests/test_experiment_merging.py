"""The accuracy experiment against token merging (examples/experiment_merging.py): what each of
its fitted methods spends."""

import sys
from pathlib import Path

import vitprune
from vitprune.data.shipped import load_shipped
from vitprune.measure.baseline import fit_merging
from vitprune.measure.flops import schedule_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import experiment_merging  # noqa: E402


def test_the_defaults_held_to_merging_flops_spend_no_more_than_merging():
    model, _ = load_shipped("fashion_mnist")
    full = schedule_flops(model, None)
    merging = schedule_flops(model, fit_merging(model, 0.8 * full / 1e9))
    at_budget = experiment_merging.fitted(model, experiment_merging.FINAL[experiment_merging.DEFAULT], 0.8, 0)
    held = experiment_merging.fitted(model, experiment_merging.EXTRA[experiment_merging.AT_MERGING], 0.8, 0)
    # at 80 % of this model's FLOPs the two fits step differently: the defaults spend more than merging
    assert vitprune.analytic_flops(at_budget) > merging
    assert vitprune.analytic_flops(held) <= merging
    config = vitprune.get_config(held)
    assert (config.selection, config.reduction, config.size_aware) == ("bipartite", "merge", True)
    plain = dict(class_only_last=False)  # the harness's methods run the whole last block (PINNED)
    rate = vitprune.fit_keep_rate(model, merging / 1e9, **plain)
    assert config == vitprune.get_config(vitprune.patch(model, keep_rate=rate, **plain))


def test_the_class_only_methods_spend_no_more_than_their_targets():
    model, _ = load_shipped("fashion_mnist")
    full = schedule_flops(model, None)
    merging = schedule_flops(model, fit_merging(model, 0.6 * full / 1e9))
    extra = experiment_merging.EXTRA
    at_budget = experiment_merging.fitted(model, extra[experiment_merging.CLASS_ONLY], 0.6, 0)
    held = experiment_merging.fitted(model, extra[experiment_merging.CLASS_ONLY_AT_MERGING], 0.6, 0)
    given = experiment_merging.fitted(model, extra[experiment_merging.MERGING_CLASS_ONLY], 0.6, 0)
    assert vitprune.analytic_flops(at_budget) <= 0.6 * full
    assert vitprune.analytic_flops(held) <= merging
    assert vitprune.analytic_flops(given) <= 0.6 * full
    for patched in (at_budget, held, given):
        assert vitprune.get_config(patched).class_only_last
    # the saving buys tokens: more of them reach the last block than without it
    plain = experiment_merging.fitted(model, experiment_merging.EXTRA[experiment_merging.AT_MERGING], 0.6, 0)
    assert vitprune.get_config(held).keep_rate[0] > vitprune.get_config(plain).keep_rate[0]


def test_every_s_blocks_with_the_class_token_alone_leave_the_last_block_out_and_fit_the_budget():
    model, _ = load_shipped("fashion_mnist")  # 6 blocks: every 2nd is (1, 3) and the last, 5, computes the class token
    full = schedule_flops(model, None)
    for step, stages in ((2, (1, 3)), (3, (2,))):
        patched = experiment_merging.fitted(model, experiment_merging.EXTRA[experiment_merging.EVERY_CLASS_ONLY[step]],
                                            0.7, 0)
        config = vitprune.get_config(patched)
        assert config.stages == stages and config.class_only_last
        assert vitprune.analytic_flops(patched) <= 0.7 * full
        plain = vitprune.get_config(experiment_merging.fitted(
            model, experiment_merging.EXTRA[experiment_merging.EVERY[step]], 0.7, 0))
        assert plain.stages == stages + (5,) and not plain.class_only_last
