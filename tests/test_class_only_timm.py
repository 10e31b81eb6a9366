"""``class_only_last`` on timm's ``Eva`` (rope ViTs) and relative-position models
(``VisionTransformerRelPos``, ``Beit``) whose head reads the class token alone: the last block
computes the prefix tokens alone, their keys rotated by the current tokens' own rope rows, or
their queries given their rows of the relative bias among the current tokens. Its logits must
be the unpatched model's when nothing is reduced and the same patch's without it otherwise,
and the FLOPs must be what fvcore counts."""

import copy

import pytest
import torch
from timm.layers import AttentionRope
from timm.models.vision_transformer_relpos import RelPosAttention
from torch.testing import assert_close

import vitprune
from conftest import (PAPER, assert_class_only_exact, assert_hooked_projections_run_as_in_timm, assert_same,
                      available, make_visible, snapshot)
from vitprune.families.relpos import follow_bias
from vitprune.measure.flops import analytic_flops, count_flops, schedule_flops

_SMALL = dict(img_size=64, depth=4)
_TOKEN = dict(_SMALL, class_token=True, global_pool="token")

#: Models with token pooling: Eva, one per attention kind, rope layout, prefix and block layout;
#: relative-position models, one per bias source and block layout.
MODELS = {
    "AttentionRope, fused qkv": ("vit_small_patch16_rope_224", _SMALL),
    "mixed rope (per-head tables)": ("vit_small_patch16_rope_mixed_224", _SMALL),
    "EvaAttention, q/k/v biases, SwiGLU": ("eva02_tiny_patch14_224", dict(img_size=56, depth=4, global_pool="token")),
    "EvaAttention, separate q/k/v": ("eva02_tiny_patch14_224", dict(img_size=56, depth=4, global_pool="token",
                                                                     qkv_fused=False)),
    "grouped key/value heads in the last block": ("vit_base_patch16_sapiens2", dict(_SMALL, num_kv_heads=(12, 6, 6, 6))),
    "registers": ("vit_small_patch16_dinov3", dict(_SMALL, global_pool="token")),
    "EvaBlockPostNorm": ("vit_small_patch16_rope_224", dict(_SMALL, use_post_norm=True)),
    "relpos MLP bias (vit_relpos_*_cls)": ("vit_relpos_medium_patch16_cls_224", _SMALL),
    "ResPostRelPosBlock": ("vit_relpos_small_patch16_rpn_224", _TOKEN),
    "shared relpos bias": ("vit_srelpos_small_patch16_224", _TOKEN),
    "BEiT, own tables, q/v biases, layer scale": ("beit_base_patch16_224", dict(_SMALL, global_pool="token")),
    "BEiT, shared table": ("beit_base_patch16_224", dict(_SMALL, global_pool="token", use_rel_pos_bias=False,
                                                         use_shared_rel_pos_bias=True)),
}

#: Parameters timm starts at or near zero, redrawn so that one left out shows.
_VISIBLE = ("q_bias", "k_bias", "v_bias", "gamma_1", "gamma_2", "ls1.gamma", "ls2.gamma", "relative_position_bias_table")


def build(kind):
    name, arguments = MODELS[kind]
    torch.manual_seed(0)
    return make_visible(available(name, **arguments).eval(), _VISIBLE)


def images(model, batch=2, seed=1):
    return torch.randn(batch, 3, *model.patch_embed.img_size, generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_nothing_reduced_gives_the_unpatched_logits(kind, fused):
    model = build(kind)
    assert_class_only_exact(model, images(model), fused, atol=1e-5)


@pytest.mark.parametrize("kind", list(MODELS))
def test_hooks_on_the_last_projections_run_as_in_timm(kind):
    """A fused ``qkv`` that timm calls is called on every token where it is hooked (BEiT's and
    Eva's with q/v biases are not called by timm either); separate projections always run."""
    model = build(kind)
    assert_hooked_projections_run_as_in_timm(model, images(model), atol=1e-5)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("options", [{}, dict(keep_rate=0.5), dict(PAPER, indicator="var", keep_rate=0.5)],
                         ids=["defaults", "keep 0.5", "paper"])
def test_reducing_gives_the_logits_of_the_same_patch_without_it(kind, options):
    model = build(kind)
    x = images(model)
    expected = logits(vitprune.patch(copy.deepcopy(model), **{**options, "class_only_last": False}), x)
    vitprune.patch(model, **{**options, "class_only_last": True})
    assert_close(logits(model, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["AttentionRope, fused qkv", "EvaAttention, separate q/k/v",
                                  "grouped key/value heads in the last block", "relpos MLP bias (vit_relpos_*_cls)",
                                  "BEiT, own tables, q/v biases, layer scale"])
def test_the_default_turns_it_on_and_fvcore_counts_what_the_formula_says(kind):
    model = vitprune.patch(build(kind), keep_rate=0.5)
    assert vitprune.get_config(model).class_only_last
    traced, analytic = count_flops(model), analytic_flops(model)
    assert abs(traced - analytic) / analytic < 0.02
    assert analytic < schedule_flops(model, vitprune.PruneConfig(keep_rate=0.5, class_only_last=False))


def test_a_pooling_changed_after_patching_runs_the_whole_last_block():
    model = build("AttentionRope, fused qkv")
    x = images(model)
    vitprune.patch(model, keep_rate=0.5, class_only_last=True)
    only = analytic_flops(model)
    model.reset_classifier(10, global_pool="avg")
    reference = vitprune.patch(copy.deepcopy(model), vitprune.get_config(model), class_only_last=False)
    assert_close(logits(model, x), logits(reference, x), rtol=0, atol=0)
    assert analytic_flops(model) == analytic_flops(reference) > only


class _SubclassedAttentionRope(AttentionRope):
    """timm's AttentionRope under another name: its forward could differ, so it is refused."""


class _SubclassedRelPosAttention(RelPosAttention):
    """timm's RelPosAttention under another name, likewise."""


@pytest.mark.parametrize("kind, subclass, accepted", [
    ("AttentionRope, fused qkv", _SubclassedAttentionRope,
     "timm's EvaAttention or AttentionRope with a fused qkv Linear or separate projections"),
    ("relpos MLP bias (vit_relpos_*_cls)", _SubclassedRelPosAttention,
     "BEiT's Attention or timm's RelPosAttention with a fused qkv Linear"),
])
def test_a_last_attention_of_another_class_is_named_in_the_refusal(kind, subclass, accepted):
    model = build(kind)
    model.blocks[-1].attn.__class__ = subclass  # the same module and weights, another class
    before = snapshot(model)
    with pytest.raises(TypeError, match="class_only_last=True cannot apply") as caught:
        vitprune.patch(model, class_only_last=True)
    assert (f"the last block's attention must be {accepted}, but it has a {subclass.__name__}"
            in str(caught.value))
    assert_same(before, snapshot(model))


class _ScaledLinear(torch.nn.Module):
    """A Linear with something added to its forward (as an adapter wraps one): a weight that is
    not the whole of what it computes."""

    def __init__(self, linear):
        super().__init__()
        self.linear, self.weight, self.bias = linear, linear.weight, linear.bias

    def forward(self, x):
        return 2 * self.linear(x)


def test_a_fused_qkv_that_is_not_a_linear_keeps_the_whole_last_block():
    model = build("AttentionRope, fused qkv")
    model.blocks[-1].attn.qkv = _ScaledLinear(model.blocks[-1].attn.qkv)
    x = images(model)
    with pytest.raises(TypeError, match="but it has a AttentionRope"):
        vitprune.patch(copy.deepcopy(model), class_only_last=True)
    expected = logits(vitprune.patch(copy.deepcopy(model), keep_rate=0.5, class_only_last=False), x)
    vitprune.patch(model, keep_rate=0.5)  # the default: off here
    assert not vitprune.get_config(model).class_only_last
    assert_close(logits(model, x), expected, rtol=0, atol=0)


def test_the_prefix_rows_of_the_followed_bias_are_the_first_rows_of_the_whole():
    bias = torch.arange(2 * 5 * 5, dtype=torch.float32).reshape(1, 2, 5, 5)
    tokens = torch.tensor([[0, 3, 5, 1], [0, 2, 4, 5]])  # 5: a fusion token
    whole = follow_bias(bias, tokens)
    assert_close(follow_bias(bias, tokens, queries=1), whole[:, :, :1], rtol=0, atol=0)
    # by hand: image 0, head 1, the class token's row over tokens 0, 3, fusion, 1
    assert follow_bias(bias, tokens, queries=1)[0, 1, 0].tolist() == [25.0, 28.0, 0.0, 26.0]


@pytest.mark.parametrize("name", ["vit_relpos_base_patch16_clsgap_224", "beit_base_patch16_224"])
def test_a_head_that_averages_the_patches_keeps_the_whole_last_block(name):
    torch.manual_seed(0)
    model = available(name, **_SMALL).eval()
    vitprune.patch(model, keep_rate=0.5)
    assert not vitprune.get_config(model).class_only_last
    with pytest.raises(TypeError, match="global_pool='avg'"):
        vitprune.patch(vitprune.unpatch(model), class_only_last=True)
