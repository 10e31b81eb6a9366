"""What a patched model prunes: token counts, which patches, gradients, randomness."""

import math

import pytest
import timm
import torch

import vitprune
from vitprune.measure.flops import token_schedule
from vitprune.core.indicators import head_medad, head_variance
from conftest import assert_same_per_stage, image_batch, make_model, paper


def tokens_after_each_block(model, x):
    counts = []
    hooks = [b.register_forward_hook(lambda m, i, o: counts.append(o.shape[1])) for b in model.blocks]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return counts


@pytest.mark.parametrize("batch", [1, 8])
def test_deit_small_token_counts_follow_the_rule(batch):
    torch.manual_seed(0)
    model = timm.create_model("deit_small_patch16_224").eval()
    vitprune.patch(model, indicator="var", keep_rate=0.7, **paper(stages=(3, 6, 9)))
    x = torch.randn(batch, 3, 224, 224)
    # 196 patches: ceil(0.7*196)=138 kept + 1 fused; ceil(0.7*139)=98 + 1; ceil(0.7*99)=70 + 1
    expected = [197] * 3 + [1 + 138 + 1] * 3 + [1 + 98 + 1] * 3 + [1 + 70 + 1] * 3
    assert tokens_after_each_block(model, x) == expected
    assert [p.shape for p in vitprune.kept_positions(model)] == [(batch, 139), (batch, 99), (batch, 71)]
    assert [t.mlp for t in token_schedule(vitprune.get_config(model), 12, 1, 196)] == expected


def test_without_fusion_the_pruned_tokens_are_dropped(tiny):
    vitprune.patch(tiny, keep_rate=0.5, stages=(2, 8), fuse=False)
    counts = tokens_after_each_block(tiny, image_batch(tiny))
    # the last block returns the class token alone (class_only_last, on by default here)
    assert counts == [197] * 2 + [1 + 98] * 6 + [1 + 49] * 3 + [1]


def test_distilled_model_keeps_both_prefix_tokens():
    model = make_model("deit_tiny_distilled (2 prefix)")
    x = image_batch(model)
    with torch.no_grad():
        tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        reference = model.blocks[0](tokens)
        vitprune.patch(model, keep_rate=0.5, **paper(stages=(0,)))
        pruned = model.blocks[0](tokens)
    assert pruned.shape[1] == 2 + 98 + 1
    # class and distillation tokens pass through the same attention and MLP as unpruned
    torch.testing.assert_close(pruned[:, :2], reference[:, :2])


def reference_scores(model, x, block_index, score):
    """Scores at ``block_index`` of the *unpatched* model, from the full attention matrix."""
    with torch.no_grad():
        h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for block in model.blocks[:block_index]:
            h = block(h)
        attn = model.blocks[block_index].attn
        B, L, C = h.shape
        qkv = attn.qkv(model.blocks[block_index].norm1(h)).reshape(B, L, 3, attn.num_heads, -1)
        q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
        full = torch.softmax(q @ k.transpose(-2, -1) * attn.head_dim ** -0.5, dim=-1)  # (B, H, L, L)
        return score(full[:, :, 0, model.num_prefix_tokens:])


@pytest.mark.parametrize("indicator, score", [
    ("var", head_variance), ("medad", head_medad), ("lowvar", lambda a: -head_variance(a)),
])
def test_first_stage_keeps_the_top_scoring_patches(tiny, indicator, score):
    x = image_batch(tiny, batch=3)
    expected = reference_scores(tiny, x, 4, score).topk(math.ceil(0.6 * 196), dim=1).indices
    vitprune.patch(tiny, indicator=indicator, keep_rate=0.6, **paper(stages=(4, 8)))
    with torch.no_grad():
        tiny(x)
    kept = vitprune.kept_positions(tiny)[0]
    assert (kept[:, -1] == -1).all()  # the fusion token comes last
    for image in range(3):
        assert set(kept[image, :-1].tolist()) == set(expected[image].tolist())


def test_later_stages_track_original_positions(tiny):
    vitprune.patch(tiny, keep_rate=0.5, stages=(1, 3, 5))
    with torch.no_grad():
        tiny(image_batch(tiny, batch=4))
    first, second, third = vitprune.kept_positions(tiny)
    for image in range(4):
        survivors = set(first[image].tolist())
        assert set(second[image].tolist()) <= survivors
        assert set(third[image].tolist()) <= set(second[image].tolist())
        kept = [p for p in third[image].tolist() if p >= 0]
        assert len(kept) == len(set(kept)) and all(0 <= p < 196 for p in kept)


def test_backward_reaches_every_parameter_the_unpruned_model_reaches(tiny):
    x = image_batch(tiny)

    def params_with_grad(model):
        model.train().zero_grad(set_to_none=True)
        model(x).logsumexp(dim=-1).sum().backward()
        return {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}

    unpruned = params_with_grad(tiny)
    vitprune.patch(tiny, keep_rate=0.5)
    assert params_with_grad(tiny) == unpruned
    assert len(unpruned) == len(list(tiny.parameters()))


def test_train_mode_with_dropout_and_drop_path_runs():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", drop_path_rate=0.1, attn_drop_rate=0.1, drop_rate=0.1)
    vitprune.patch(model, keep_rate=0.7).train()
    out = model(torch.randn(2, 3, 224, 224))
    out.sum().backward()
    assert torch.isfinite(out).all() and out.shape == (2, 1000)


def test_random_indicator_is_reproducible_from_a_seed_or_generator(tiny):
    x = image_batch(tiny)

    def kept_with(**options):
        vitprune.patch(tiny, indicator="random", keep_rate=0.5, **options)
        with torch.no_grad():
            tiny(x)
        return vitprune.kept_positions(tiny)

    a, b, c = kept_with(seed=3), kept_with(seed=3), kept_with(seed=4)
    stages = len(vitprune.get_config(tiny).stages)
    assert_same_per_stage(b, a, stages)
    assert len(c) == stages and not all(torch.equal(u, v) for u, v in zip(a, c))
    assert_same_per_stage(kept_with(generator=torch.Generator().manual_seed(3)), a, stages)


def test_indicators_choose_differently(tiny):
    x = image_batch(tiny)
    chosen = {}
    for indicator in ("var", "medad", "cls"):
        vitprune.patch(tiny, indicator=indicator, keep_rate=0.5, stages=(6,))
        with torch.no_grad():
            tiny(x)
        chosen[indicator] = vitprune.kept_positions(tiny)[0]
    assert not torch.equal(chosen["var"], chosen["cls"])
    assert not torch.equal(chosen["var"], chosen["medad"])


def test_attention_masks_are_refused_in_pruning_blocks(tiny):
    vitprune.patch(tiny, keep_rate=0.7)
    mask = torch.ones(197, 197, dtype=torch.bool)
    with pytest.raises(ValueError, match="attn_mask"):
        tiny(image_batch(tiny), attn_mask=mask)
