"""Overlapping patch embeddings: grid, position embeddings, exact undo, errors."""

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import vitprune
from vitprune.measure.budget import fit_overlap, overlap_options
from vitprune.measure.flops import analytic_flops, count_flops
from vitprune.core.overlap import overlapped_grid, resample_grid_embed
from conftest import assert_same, image_batch, make_model, snapshot


def tokens_entering_first_block(model, x):
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        model(x)
    hook.remove()
    return seen[0]


def test_deit_small_stride_12_gives_an_18_by_18_grid():
    torch.manual_seed(0)
    model = timm.create_model("deit_small_patch16_224").eval()
    vitprune.patch(model, keep_rate=0.6, overlap_stride=12)
    assert tokens_entering_first_block(model, torch.randn(1, 3, 224, 224)) == 1 + 18 * 18
    assert model.pos_embed.shape == (1, 1 + 324, 384)
    assert overlapped_grid((224, 224), (16, 16), 12) == (18, 18)


def test_a_non_square_patch_and_image_give_each_side_its_own_grid():
    # by hand: (64 - 16) // 4 + 1 = 13 rows, (48 - 8) // 4 + 1 = 11 columns
    assert overlapped_grid((64, 48), (16, 8), 4) == (13, 11)
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=(64, 48), patch_size=(16, 8), depth=2).eval()
    vitprune.patch(model, keep_rate=0.6, overlap_stride=4)
    assert model.patch_embed.grid_size == (13, 11) and model.patch_embed.num_patches == 13 * 11
    assert model.pos_embed.shape[1] == 1 + 13 * 11
    assert tokens_entering_first_block(model, torch.randn(1, 3, 64, 48)) == 1 + 13 * 11
    with pytest.raises(ValueError, match=r"overlap_stride must be in \[1, 8\] \(at most the patch size \(16, 8\)\)"):
        vitprune.patch(model, keep_rate=0.6, overlap_stride=12)  # past the narrower side


@pytest.mark.parametrize("name", ["deit_tiny", "deit3_small (LayerScale)", "deit_tiny_distilled (2 prefix)"])
def test_stride_equal_to_the_patch_size_changes_nothing(name):
    model = make_model(name)
    x = image_batch(model)
    with torch.no_grad():
        vitprune.patch(model, keep_rate=0.7)
        expected = model(x)
        vitprune.patch(model, keep_rate=0.7, overlap_stride=16)
        actual = model(x)
    assert torch.equal(actual, expected)


def test_resampling_is_torch_bicubic_and_keeps_prefix_entries():
    pos = torch.randn(1, 2 + 4 * 5, 8)
    out = resample_grid_embed(pos, 2, (4, 5), (7, 9))
    grid = pos[:, 2:].reshape(1, 4, 5, 8).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(7, 9), mode="bicubic", align_corners=False)
    assert torch.equal(out[:, :2], pos[:, :2])
    assert_close(out[:, 2:], expected.permute(0, 2, 3, 1).reshape(1, 63, 8))


def test_resampling_a_bfloat16_embedding_interpolates_in_float32():
    pos = torch.randn(1, 1 + 4 * 4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = resample_grid_embed(pos, 1, (4, 4), (7, 7))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, resample_grid_embed(pos.float(), 1, (4, 4), (7, 7)).to(torch.bfloat16))


def test_resampling_an_unchanged_grid_is_the_identity():
    pos = torch.randn(1, 1 + 9, 4)
    assert torch.equal(resample_grid_embed(pos, 1, (3, 3), (3, 3)), pos)


@pytest.mark.parametrize("name, prefix_in_embed", [("deit_tiny", 1), ("deit3_small (LayerScale)", 0)])
def test_patched_position_embedding_is_the_resampled_original(name, prefix_in_embed):
    model = make_model(name)
    original = model.pos_embed.detach().clone()
    old_grid = model.patch_embed.grid_size
    vitprune.patch(model, keep_rate=0.6, overlap_stride=12)
    new_grid = overlapped_grid(model.patch_embed.img_size, (16, 16), 12)
    assert torch.equal(model.pos_embed.detach(), resample_grid_embed(original, prefix_in_embed, old_grid, new_grid))


def test_unpatch_restores_every_parameter_and_attribute_exactly(tiny):
    x = image_batch(tiny)
    parameter = tiny.pos_embed
    before = snapshot(tiny)
    embed_state = (tiny.patch_embed.proj.stride, tiny.patch_embed.grid_size, tiny.patch_embed.num_patches)
    with torch.no_grad():
        expected = tiny(x)
        vitprune.patch(tiny, keep_rate=0.6, overlap_stride=10)
        tiny(x)
        vitprune.unpatch(tiny)
        actual = tiny(x)
    assert tiny.pos_embed is parameter
    assert (tiny.patch_embed.proj.stride, tiny.patch_embed.grid_size, tiny.patch_embed.num_patches) == embed_state
    assert_same(before, snapshot(tiny))
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("stride", [12, 16])
def test_unpatch_after_training_restores_the_original_position_embedding_at_any_stride(tiny, stride):
    """The record keeps its own copy, also where the grid does not change (stride = patch size):
    an optimizer step changes the position embedding in place, and unpatch puts back the original."""
    original = tiny.pos_embed.detach().clone()
    vitprune.patch(tiny, keep_rate=0.6, overlap_stride=stride)
    with torch.no_grad():
        tiny.pos_embed.add_(1.0)  # in place, as an optimizer step
    vitprune.unpatch(tiny)
    assert torch.equal(tiny.pos_embed.detach(), original)


def test_patching_an_overlapped_model_again_replaces_the_overlap(tiny):
    original = tiny.pos_embed.detach().clone()
    vitprune.patch(tiny, keep_rate=0.6, overlap_stride=12)
    vitprune.patch(tiny, keep_rate=0.6, overlap_stride=8)
    assert tiny.patch_embed.proj.stride == (8, 8) and tiny.patch_embed.grid_size == (27, 27)
    vitprune.patch(tiny, keep_rate=0.6)
    assert tiny.patch_embed.proj.stride == (16, 16) and torch.equal(tiny.pos_embed.detach(), original)
    vitprune.patch(tiny, keep_rate=0.6, overlap_stride=12)
    vitprune.unpatch(tiny)
    assert tiny.patch_embed.grid_size == (14, 14) and torch.equal(tiny.pos_embed.detach(), original)


def test_dtype_device_and_requires_grad_are_kept(tiny):
    tiny.to(torch.bfloat16)
    tiny.pos_embed.requires_grad_(False)
    vitprune.patch(tiny, keep_rate=0.6, overlap_stride=12)
    assert tiny.pos_embed.dtype == torch.bfloat16 and not tiny.pos_embed.requires_grad
    assert tiny.pos_embed.device == tiny.cls_token.device


def test_overlap_state_dict_round_trip(tiny):
    x = image_batch(tiny)
    vitprune.patch(tiny, keep_rate=0.6, overlap_stride=12)
    state = tiny.state_dict()
    other = vitprune.patch(make_model("deit_tiny", seed=3), keep_rate=0.6, overlap_stride=12)
    other.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(other(x), tiny(x))


def test_dynamic_img_size_with_overlap():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", dynamic_img_size=True).eval()
    vitprune.patch(model, keep_rate=1.0, overlap_stride=12)
    # (160 - 16) // 12 + 1 = 13 rows, (96 - 16) // 12 + 1 = 7 columns
    assert tokens_entering_first_block(model, torch.randn(1, 3, 160, 96)) == 1 + 13 * 7


def test_dynamic_img_pad_with_overlap_pads_to_whole_patches_first():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", dynamic_img_size=True, dynamic_img_pad=True).eval()
    vitprune.patch(model, keep_rate=1.0, overlap_stride=12)
    # 150 x 90 padded to 160 x 96 as PatchEmbed pads: (160 - 16) // 12 + 1 = 13 rows, (96 - 16) // 12 + 1 = 7 columns
    x = torch.randn(1, 3, 150, 90)
    assert tokens_entering_first_block(model, x) == 1 + 13 * 7
    with torch.no_grad():  # the maps' grid is the patch embedding's dynamic_feat_size
        maps = model.forward_intermediates(x, indices=[0, 11], intermediates_only=True)
    assert [tuple(m.shape) for m in maps] == [(1, 192, 13, 7)] * 2


def test_flop_counts_see_the_new_token_count(tiny):
    unpruned = analytic_flops(tiny)
    vitprune.patch(tiny, keep_rate=0.6, overlap_stride=12)
    traced, analytic = count_flops(tiny), analytic_flops(tiny)
    assert abs(traced - analytic) / analytic < 0.02
    assert analytic > 0.9 * unpruned  # 324 tokens at keep 0.6 cost about what 196 do


@pytest.mark.parametrize("stride, error, match", [
    (0, ValueError, "positive int"),
    (-4, ValueError, "positive int"),
    (17, ValueError, r"overlap_stride must be in \[1, 16\]"),
    (12.0, TypeError, "positive int or None"),
    ("12", TypeError, "positive int or None"),
    (True, TypeError, "positive int or None"),
])
def test_bad_strides_raise_and_leave_the_model_untouched(tiny, stride, error, match):
    before = snapshot(tiny)
    with pytest.raises(error, match=match):
        vitprune.patch(tiny, keep_rate=0.6, overlap_stride=stride)
    assert_same(before, snapshot(tiny))
    assert not vitprune.is_patched(tiny)


def test_a_patch_embedding_that_already_overlaps_is_refused_untouched(tiny):
    tiny.patch_embed.proj.stride = (8, 8)  # overlapping already, not by vitprune
    before = snapshot(tiny)
    with pytest.raises(TypeError, match=r"the patch embedding already has stride \(8, 8\) for patch size \(16, 16\)"):
        vitprune.patch(tiny, keep_rate=0.6, overlap_stride=12)
    assert_same(before, snapshot(tiny))
    assert tiny.patch_embed.proj.stride == (8, 8) and not vitprune.is_patched(tiny)


def test_a_hybrid_cnn_stem_cannot_overlap():
    model = timm.create_model("vit_tiny_r_s16_p8_224")
    with pytest.raises(TypeError, match="PatchEmbed"):
        vitprune.patch(model, keep_rate=0.6, overlap_stride=4)


def test_fit_overlap_matches_the_unpruned_budget(tiny):
    budget = analytic_flops(tiny) / 1e9
    option = fit_overlap(tiny, min_keep_rate=0.6)
    assert option.keep_rate >= 0.6 and option.gflops <= budget
    smaller = [o for o in overlap_options(tiny) if o.stride < option.stride]
    assert all(o.keep_rate < 0.6 for o in smaller)
    vitprune.patch(tiny, keep_rate=option.keep_rate, overlap_stride=option.stride)
    assert analytic_flops(tiny) / 1e9 == pytest.approx(option.gflops)
    with pytest.raises(ValueError, match="no stride keeps at least 0.99"):
        fit_overlap(tiny, 0.5, min_keep_rate=0.99)


def test_fit_overlap_takes_a_keep_rate_equal_to_its_bound(tiny):
    """``min_keep_rate`` is inclusive: set to an option's own keep rate, that option is the
    smallest stride allowed."""
    options = overlap_options(tiny)
    bound = options[2]
    assert all(o.keep_rate < bound.keep_rate for o in options[3:])
    assert fit_overlap(tiny, min_keep_rate=bound.keep_rate) == bound


def test_overlap_options_run_from_no_overlap_down_to_the_last_stride_that_fits(tiny):
    budget = analytic_flops(tiny) / 1e9
    options = overlap_options(tiny)
    assert [o.stride for o in options] == list(range(16, 16 - len(options), -1))  # the patch size first
    assert options[0].keep_rate == 1.0  # without overlap the unpruned budget needs no pruning
    assert [o.tokens for o in options[:4]] == [196, 196, 225, 289]  # 14 x 14 at strides 16 and 15, 15 x 15, 17 x 17
    for option in options[2:4] + options[-1:]:
        assert option.keep_rate == vitprune.fit_keep_rate(tiny, budget, overlap_stride=option.stride)
        assert option.gflops <= budget
    with pytest.raises(ValueError, match="no keep rate meets"):  # the next stride down: out of reach
        vitprune.fit_keep_rate(tiny, budget, overlap_stride=options[-1].stride - 1)


@pytest.mark.parametrize("arguments, error, match", [
    ({"target_gflops": 0}, ValueError, "target_gflops must be > 0 and finite, got 0"),
    ({"target_gflops": float("nan")}, ValueError, "target_gflops must be > 0 and finite, got nan"),
    ({"stages": (3, 99)}, ValueError, r"stages \[99\] out of range: the model has 12 blocks"),
    ({"indicator": "entropy"}, ValueError, "unknown indicator 'entropy'; accepted: 'var'"),
    ({"overlap_stride": 4}, TypeError, "overlap_options tries every stride itself: leave overlap_stride out"),
])
def test_overlap_options_pass_on_what_fit_keep_rate_refuses(tiny, arguments, error, match):
    """Each of these gave an empty list (a bad option read as 'no stride fits'), and fit_overlap
    then said that no stride keeps 0.5 of the tokens; overlap_stride was Python's own
    'multiple values for keyword argument'."""
    for fit in (overlap_options, fit_overlap):
        with pytest.raises(error, match=match):
            fit(tiny, **arguments)


def test_a_budget_no_stride_meets_is_an_empty_list_and_named_by_fit_overlap(tiny):
    assert overlap_options(tiny, 0.001) == []
    with pytest.raises(ValueError, match="no keep rate meets the budget even without overlap"):
        fit_overlap(tiny, 0.001)


def small_dynamic_and_static():
    """deit_tiny at 64 x 64 (random weights), built with and without ``dynamic_img_size``."""
    torch.manual_seed(0)
    dynamic = timm.create_model("deit_tiny_patch16_224", img_size=64, dynamic_img_size=True).eval()
    static = timm.create_model("deit_tiny_patch16_224", img_size=64).eval()
    static.load_state_dict(dynamic.state_dict())
    return dynamic, static


@pytest.mark.parametrize("keep_rate", [1.0, 0.7])
def test_set_input_size_on_an_overlapped_model_is_its_forward_at_that_size(keep_rate):
    dynamic, static = small_dynamic_and_static()
    for model in dynamic, static:
        vitprune.patch(model, keep_rate=keep_rate, overlap_stride=8)
    static.set_input_size(img_size=96)  # timm resamples the overlapped embedding to the new grid
    assert static.patch_embed.grid_size == overlapped_grid((96, 96), (16, 16), 8) == (11, 11)
    assert static.patch_embed.num_patches == 121 and static.pos_embed.shape == (1, 1 + 121, 192)
    assert abs(count_flops(static, products_only=True) / analytic_flops(static) - 1) < 0.01  # counted at 96 x 96
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the dynamic model resamples the same embedding the same way, per forward
        assert torch.equal(static(x), dynamic(x))


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit3_small_patch16_224"])  # deit3: no class entry
def test_unpatch_after_set_input_size_leaves_what_the_call_leaves_on_the_unpatched_model(name):
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=64).eval()
    expected = copy.deepcopy(model)
    expected.set_input_size(img_size=96)
    vitprune.patch(model, keep_rate=0.7, overlap_stride=8)
    model.set_input_size(img_size=96)
    vitprune.unpatch(model)
    embed, other = model.patch_embed, expected.patch_embed
    assert type(embed) is type(other) and embed.proj.stride == other.proj.stride == (16, 16)
    assert (embed.img_size, embed.grid_size, embed.num_patches) == (other.img_size, other.grid_size, other.num_patches)
    assert model.state_dict().keys() == expected.state_dict().keys()
    assert all(torch.equal(value, expected.state_dict()[key]) for key, value in model.state_dict().items())
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), expected(x))


def test_a_new_patch_size_is_refused_while_overlapped_and_changes_nothing():
    _, model = small_dynamic_and_static()
    vitprune.patch(model, keep_rate=0.7, overlap_stride=8)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"cannot change the patch size \(\(16, 16\) to \(8, 8\)\).*unpatch"):
        model.set_input_size(img_size=96, patch_size=8)
    assert_same(before, snapshot(model))
    model.set_input_size(patch_size=16)  # the patch size it has: allowed


@pytest.mark.parametrize("size", [dict(img_size=96), dict(patch_size=8), dict(img_size=80, patch_size=8)])
def test_set_input_size_on_a_model_patched_without_overlap_is_timms(size):
    _, model = small_dynamic_and_static()
    expected = copy.deepcopy(model)
    vitprune.patch(model, keep_rate=1.0, class_only_last=False)
    for each in model, expected:
        each.set_input_size(**size)
    x = torch.randn(2, 3, *expected.patch_embed.img_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), expected(x))
