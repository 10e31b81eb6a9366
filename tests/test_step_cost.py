"""The step-cost benchmark (examples/step_cost.py): its stand-in step leaves the tokens the real one does,
and its sparser schedules (every S-th block) fit the defaults' method to the budget."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import vitprune
import vitprune.core.state as state_module
from conftest import images, small_vit
from vitprune.measure.flops import schedule_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import step_cost  # noqa: E402


def block_token_counts(model, x, call=None):
    """The tokens each of ``model``'s blocks hands on, and the output of ``call`` (default:
    ``model``) on ``x``."""
    counts = []
    hooks = [block.register_forward_hook(lambda module, args, out: counts.append(out.shape[1]))
             for block in model.blocks]
    try:
        with torch.inference_mode():
            out = (call or model)(x)
    finally:
        for hook in hooks:
            hook.remove()
    return counts, out


def test_the_free_step_leaves_the_same_token_counts_as_the_real_one():
    model = vitprune.patch(small_vit(), keep_rate=0.5)
    x = images(model, batch=2)
    real, real_out = block_token_counts(model, x)
    with step_cost.free_step():
        free, free_out = block_token_counts(model, x)
    assert free == real
    assert real[-1] < real[0]  # the real step did reduce
    assert not torch.allclose(free_out, real_out)  # and the free one stood in for it


def test_the_free_step_is_confined_to_its_block():
    real = state_module.bipartite_merge
    with pytest.raises(RuntimeError, match="inside"):
        with step_cost.free_step():
            assert state_module.bipartite_merge is step_cost.free_merge
            raise RuntimeError("inside")
    assert state_module.bipartite_merge is real


@pytest.mark.parametrize("step", [2, 3])
def test_every_fits_the_defaults_method_to_the_budget_in_every_step_th_block(step):
    model = small_vit()
    budget = 0.8 * schedule_flops(model, None) / 1e9
    config = step_cost.every(model, step, budget)
    assert config.stages == tuple(range(step - 1, len(model.blocks), step))
    assert (config.selection, config.reduction, config.size_aware) == ("bipartite", "merge", True)
    assert config.keep_rate < 1 and schedule_flops(model, config) / 1e9 <= budget


@pytest.mark.parametrize("step, stages", [(2, (1, 3, 5, 7, 9)), (3, (2, 5, 8))])
def test_every_with_the_class_token_alone_leaves_the_last_block_out_and_spends_its_saving(step, stages):
    model = small_vit()
    budget = 0.8 * schedule_flops(model, None) / 1e9
    config = step_cost.every(model, step, budget, class_only_last=True)
    assert config.stages == stages and config.class_only_last is True
    cost = schedule_flops(model, config) / 1e9
    assert cost <= budget
    plain = step_cost.every(model, step, budget)
    assert config.keep_rate >= plain.keep_rate  # the last block's saving buys tokens elsewhere
    # with the last block's stage gone, the same keep rate as the plain schedule costs less
    assert schedule_flops(model, dataclasses.replace(config, keep_rate=plain.keep_rate)) < schedule_flops(model, plain)


def test_every_stages_are_every_step_th_block_counted_back_from_the_last():
    from experiments_common import every_stages

    assert every_stages(12, 2) == (1, 3, 5, 7, 9, 11)
    assert every_stages(12, 3) == (2, 5, 8, 11)
    assert every_stages(6, 4) == (1, 5)
    assert every_stages(8, 3) == (1, 4, 7)
    assert every_stages(8, 3, class_only_last=True) == (1, 4)
    assert every_stages(6, 1) == (0, 1, 2, 3, 4, 5)
    assert every_stages(12, 2, class_only_last=True) == (1, 3, 5, 7, 9)  # the last block: the class token alone
    assert every_stages(12, 3, class_only_last=True) == (2, 5, 8)
    assert every_stages(12, 4, class_only_last=True) == (3, 7)
    with pytest.raises(ValueError, match="positive"):
        every_stages(6, 0)
