"""Hybrid ViTs (a CNN stem before the patch projection): their token grid, the schedule and
the FLOPs worked out from it, and the one blank image the stem runs for them."""

import pytest
import timm
import torch
from torch import nn

import vitprune
from conftest import available
from vitprune.core.grid import num_patches
from vitprune.core.modes import evaluating
from vitprune.core.stem import run_stem
from vitprune.measure.flops import analytic_flops, count_flops, schedule_flops

#: A ResNetV2 stem with an 8x8 projection, a features_only ResNet with a 1x1 one, a conv stem
#: whose feature map is the grid (no projection, newer timm only).
HYBRIDS = ["vit_tiny_r_s16_p8_224", "vit_small_resnet26d_224", "vit_base_mci_224"]


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_grid_is_what_the_stem_hands_the_projection(name):
    model = available(name, img_size=64, depth=1).eval()
    assert num_patches(model) == model.patch_embed.num_patches
    for size in ((96, 64), (100, 130)):  # a stem that pads rounds up where the image is no multiple
        with torch.no_grad():
            tokens = model.patch_embed(torch.zeros(1, 3, *size)).shape[1]
        assert num_patches(model, size) == tokens, size


def test_a_hybrid_takes_no_stride():
    model = timm.create_model("vit_tiny_r_s16_p8_224", img_size=64, depth=1)
    with pytest.raises(TypeError, match="not to this VisionTransformer's CNN stem"):
        num_patches(model, None, 4)


def test_the_spread_schedule_is_worked_out_for_the_stems_tokens():
    # 49 tokens from the stem's 56x56 map; the projection over the 224x224 image would say 784
    model = timm.create_model("vit_tiny_r_s16_p8_224", depth=4)
    vitprune.patch(model, keep_rate=0.7)
    config = vitprune.get_config(model)
    assert config.class_only_last  # the defaults' last block computes the class token only
    spread = vitprune.PruneConfig(keep_rate=0.7, class_only_last=True)
    assert config.keep_rate == spread.resolve(4, 49).keep_rate != spread.resolve(4, 784).keep_rate


def test_a_budget_fit_on_a_hybrid_meets_it_to_the_traced_count():
    model = timm.create_model("vit_small_resnet26d_224", img_size=128, depth=4).eval()
    unpruned = analytic_flops(model)
    target = 0.95 * unpruned / 1e9  # the stem is most of a hybrid's cost: a fit can only trim the blocks
    rate = vitprune.fit_keep_rate(model, target)
    assert schedule_flops(model, vitprune.PruneConfig(keep_rate=rate)) <= target * 1e9 < unpruned
    vitprune.patch(model, keep_rate=rate)
    assert abs(count_flops(model, products_only=True) / analytic_flops(model) - 1) < 0.002


def test_the_stem_pass_counts_by_hand_and_changes_nothing():
    stem = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 8, 1, groups=2),
                         nn.Flatten(2), nn.Linear(16, 5), nn.Unflatten(2, (1, 5)))
    stem.train()
    stem[1].eval()  # a frozen norm inside a training stem
    before = {k: v.clone() for k, v in stem.state_dict().items()}
    passed = run_stem(stem, (8, 8))
    # conv 4x4x4 outputs of 3x3x3 products, grouped 1x1 conv 8x4x4 outputs of 2, Linear 8 rows of 16x5
    assert passed.flops == 64 * 27 + 128 * 2 + 8 * 16 * 5
    assert passed.size == (1, 5)
    assert [m.training for m in stem] == [True, False, True, True, True, True]
    assert all(torch.equal(before[k], v) for k, v in stem.state_dict().items())


def test_evaluating_gives_every_module_its_own_mode_back_even_after_an_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model.train()
    model[1].eval()
    with pytest.raises(RuntimeError, match="boom"):
        with evaluating(model):
            assert not any(m.training for m in model.modules())
            raise RuntimeError("boom")
    assert [m.training for m in model.modules()] == [True, True, False]


def test_counting_flops_keeps_a_frozen_norm_frozen():
    model = timm.create_model("vit_small_resnet26d_224", img_size=64, depth=1)
    model.train()
    frozen = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)][:3]
    for norm in frozen:
        norm.eval()
    modes = [m.training for m in model.modules()]
    count_flops(model)
    analytic_flops(model)
    assert [m.training for m in model.modules()] == modes
