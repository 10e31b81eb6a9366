"""``class_only_last`` on timm's ``Eva`` (rope ViTs whose head reads the class token alone): the
last block computes the prefix tokens alone, their keys rotated by the current tokens' own
rope rows. Its logits must be the unpatched model's when nothing is reduced and the same
patch's without it otherwise, and the FLOPs must be what fvcore counts."""

import copy

import pytest
import torch
from timm.layers import AttentionRope
from torch.testing import assert_close

import vitprune
from conftest import PAPER, assert_class_only_exact, assert_same, available, snapshot
from vitprune.measure.flops import analytic_flops, count_flops, schedule_flops

_SMALL = dict(img_size=64, depth=4)

#: Eva models with token pooling, one per attention kind, rope layout, prefix and block layout.
MODELS = {
    "AttentionRope, fused qkv": ("vit_small_patch16_rope_224", _SMALL),
    "mixed rope (per-head tables)": ("vit_small_patch16_rope_mixed_224", _SMALL),
    "EvaAttention, q/k/v biases, SwiGLU": ("eva02_tiny_patch14_224", dict(img_size=56, depth=4, global_pool="token")),
    "EvaAttention, separate q/k/v": ("eva02_tiny_patch14_224", dict(img_size=56, depth=4, global_pool="token",
                                                                     qkv_fused=False)),
    "grouped key/value heads in the last block": ("vit_base_patch16_sapiens2", dict(_SMALL, num_kv_heads=(12, 6, 6, 6))),
    "registers": ("vit_small_patch16_dinov3", dict(_SMALL, global_pool="token")),
    "EvaBlockPostNorm": ("vit_small_patch16_rope_224", dict(_SMALL, use_post_norm=True)),
}


def build(kind):
    name, arguments = MODELS[kind]
    torch.manual_seed(0)
    model = available(name, **arguments).eval()
    with torch.no_grad():  # visible attention biases and layer scales, so a misplaced one shows
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith(("q_bias", "k_bias", "v_bias", "gamma_1", "gamma_2")):
                parameter.normal_(0, 0.5)
    return model


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
@pytest.mark.parametrize("options", [{}, dict(keep_rate=0.5), dict(PAPER, indicator="var", keep_rate=0.5)],
                         ids=["defaults", "keep 0.5", "paper"])
def test_reducing_gives_the_logits_of_the_same_patch_without_it(kind, options):
    model = build(kind)
    x = images(model)
    expected = logits(vitprune.patch(copy.deepcopy(model), **{**options, "class_only_last": False}), x)
    vitprune.patch(model, **{**options, "class_only_last": True})
    assert_close(logits(model, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["AttentionRope, fused qkv", "EvaAttention, separate q/k/v",
                                  "grouped key/value heads in the last block"])
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


def test_a_last_attention_of_another_class_is_named_in_the_refusal():
    model = build("AttentionRope, fused qkv")
    last = model.blocks[-1].attn
    replaced = _SubclassedAttentionRope(last.qkv.in_features, num_heads=last.num_heads, qkv_bias=True,
                                        num_prefix_tokens=last.num_prefix_tokens)
    replaced.load_state_dict(last.state_dict())
    model.blocks[-1].attn = replaced.eval()
    before = snapshot(model)
    with pytest.raises(TypeError, match="class_only_last=True cannot apply") as caught:
        vitprune.patch(model, class_only_last=True)
    assert ("the last block's attention must be timm's EvaAttention or AttentionRope with a fused qkv Linear or "
            "separate projections, but it has a _SubclassedAttentionRope") in str(caught.value)
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
