"""``class_only_last``: in ``forward`` the last block computes only the prefix tokens, which
is all a ``global_pool="token"`` head reads. The logits must be those of the same patch without
it (and of the unpatched model when nothing is reduced), ``forward_features`` must still return
every token, the FLOPs must be what the formula says, and the default (``None``) must turn it
on exactly where it applies."""

import copy
import threading

import pytest
import timm
import torch
from timm.layers import Attention
from timm.models.vision_transformer import ParallelScalingBlock, ResPostBlock
from torch.testing import assert_close

import vitprune
from conftest import (PAPER, assert_class_only_exact, assert_hooked_projections_run_as_in_timm, assert_same,
                      make_visible, snapshot, trained_logits, training_step)
from vitprune.measure.baseline import fit_merging
from vitprune.measure.flops import analytic_flops, count_flops, schedule_flops

#: Small timm ViTs whose head reads the prefix tokens alone, one per kind of prefix and block.
MODELS = {
    "class token": dict(),
    "distilled (2 prefix)": dict(name="deit_tiny_distilled_patch16_224"),
    "registers (5 prefix)": dict(reg_tokens=4, no_embed_class=True),
    "ResPostBlock": dict(block_fn=ResPostBlock),
    "qk-norm, no qkv bias": dict(qk_norm=True, qkv_bias=False),
    "LayerScale": dict(init_values=0.5),
}


def build(kind, depth=4, **extra):
    options = dict(MODELS[kind])
    name = options.pop("name", "deit_tiny_patch16_224")
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, patch_size=8, depth=depth, embed_dim=48, num_heads=3,
                              **options, **extra).eval()
    return make_visible(model, ("qkv.bias",))  # timm starts them at zero: a query bias left out shows


def images(batch=3, seed=1):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_nothing_reduced_gives_the_unpatched_logits(kind, fused):
    assert_class_only_exact(build(kind), images(), fused, atol=1e-6)


@pytest.mark.parametrize("kind", ["class token", "ResPostBlock"])
def test_a_hook_added_after_patch_to_the_last_attention_is_named_at_the_first_call(kind):
    """The last block computes the prefix tokens alone through its attention's layers, so a
    hook registered on that attention after ``patch`` does not run: the first call names it."""
    import warnings

    model = vitprune.patch(build(kind), keep_rate=0.5)
    assert vitprune.get_config(model).class_only_last
    ran = []
    model.blocks[-1].attn.register_forward_hook(lambda *a: ran.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits(model, images())
    named = [str(w.message) for w in caught if "after patch" in str(w.message)]
    assert len(named) == 1 and "hooks were registered on blocks.3.attn after patch" in named[0]
    assert ran == []


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_hook_on_the_last_qkv_runs_on_every_token_as_in_timm(kind):
    """The prefix tokens' queries come from a slice of ``qkv``'s weight, so its hooks would not
    run: a hooked ``qkv`` is called as timm calls it, and a hook that changes its output
    changes the logits as it does in timm."""
    model = build(kind)
    assert_hooked_projections_run_as_in_timm(model, images(), atol=1e-6)


def test_torch_pruning_of_the_last_qkv_trains_as_on_the_unpatched_model():
    """``torch.nn.utils.prune`` recomputes ``qkv.weight`` in a forward pre-hook; read without
    calling ``qkv``, the weight was the one computed at pruning, whose graph the first
    backward freed (the second training step failed)."""
    from torch.nn.utils import prune

    x, labels = images(), torch.tensor([0, 1, 2])

    def trained(model):
        prune.l1_unstructured(model.blocks[-1].attn.qkv, "weight", amount=0.5)
        return trained_logits(model, x, labels)

    expected = trained(build("class token"))
    model = vitprune.patch(build("class token"), keep_rate=1.0)
    assert model.blocks[-1].vitprune_class_only
    assert_close(trained(model), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["class token", "distilled (2 prefix)", "ResPostBlock"])
def test_a_training_forward_draws_drop_path_and_head_dropout_as_timm(kind):
    """In training the prefix rows alone meet the last block's attention and projection
    dropout, whose masks then differ from timm's (docs/method.md §10); drop path (one draw
    per image) and the dropout before the head are drawn as in timm, so with those alone a
    training step at keep 1.0 is timm's up to the smaller products' rounding."""
    x = images().double()

    def logits(model):
        out = model(x)
        return out[0] if isinstance(out, tuple) else out  # the distilled DeiT trains on two heads

    def step(model):
        return training_step(model.double().train(), logits)

    dropping = dict(drop_path_rate=0.3, drop_rate=0.3)
    expected, expected_grads = step(build(kind, **dropping))
    model = vitprune.patch(build(kind, **dropping), keep_rate=1.0)
    assert model.blocks[-1].vitprune_class_only
    got, grads = step(model)
    assert not torch.equal(step(build(kind, **dropping))[0], step(build(kind))[0])  # the masks are drawn
    assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert_close(grads[name], expected_grads[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["class token", "distilled (2 prefix)", "ResPostBlock"])
@pytest.mark.parametrize("options", [{}, dict(keep_rate=0.4), PAPER, dict(indicator="var", keep_rate=0.5)], ids=str)
def test_reducing_gives_the_logits_of_the_same_patch_without_it(kind, options):
    model, x = build(kind), images()
    expected = logits(vitprune.patch(copy.deepcopy(model), **{**options, "class_only_last": False}), x)
    vitprune.patch(model, **{**options, "class_only_last": True})
    assert_close(logits(model, x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("keep", [0.9, 0.5])
def test_the_default_schedule_of_a_shallow_model_gives_the_logits_it_gives_without_it(depth, keep):
    # at depths 2 to 4 the paper's stages, whose token count sets the rate of "spread", include
    # the last block: counted on one side only, it gave the option a rate of its own
    model, x = build("class token", depth=depth), images()
    expected = logits(vitprune.patch(copy.deepcopy(model), keep_rate=keep, class_only_last=False), x)
    vitprune.patch(model, keep_rate=keep, class_only_last=True)
    assert_close(logits(model, x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["class token", "distilled (2 prefix)", "ResPostBlock"])
@pytest.mark.parametrize("options", [{}, PAPER, dict(reduction="drop", selection="top", indicator="cls")], ids=str)
def test_a_stage_at_the_last_block_changes_no_logit_so_the_option_replaces_it(kind, options):
    # the last block's reduction follows its attention and never touches the prefix tokens, so
    # the logits of a schedule with a stage there are those of the same schedule without it
    # and with the class token alone there, which costs fewer FLOPs (why the latency recipes
    # in README leave the last block out of their stages)
    model, x = build(kind), images()
    with_stage = vitprune.patch(copy.deepcopy(model), **{**options, "keep_rate": 0.6, "stages": (1, 3),
                                                         "class_only_last": False})
    alone = vitprune.patch(model, **{**options, "keep_rate": 0.6, "stages": (1,), "class_only_last": True})
    assert_close(logits(alone, x), logits(with_stage, x), rtol=1e-5, atol=1e-6)
    assert schedule_flops(alone, vitprune.get_config(alone)) < schedule_flops(with_stage, vitprune.get_config(with_stage))


def test_the_last_block_leaves_spread_and_all_and_an_explicit_stage_there_is_refused():
    model = build("class token")
    spread = vitprune.get_config(vitprune.patch(copy.deepcopy(model), class_only_last=True))
    plain = vitprune.get_config(vitprune.patch(copy.deepcopy(model), class_only_last=False))
    assert plain.stages == (0, 1, 2, 3) and spread.stages == (0, 1, 2)
    assert spread.keep_rate == plain.keep_rate[:3]  # the other blocks keep what they kept
    every = vitprune.get_config(vitprune.patch(copy.deepcopy(model), stages="all", class_only_last=True))
    assert every.stages == (0, 1, 2)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"stages include the last block \(3\)"):
        vitprune.patch(model, stages=(1, 3), class_only_last=True)
    assert_same(before, snapshot(model))
    # left at its default, an explicit stage at the last block turns it off instead
    assert not vitprune.get_config(vitprune.patch(model, stages=(1, 3))).class_only_last


def test_flops_by_hand():
    """One block of width C = 48 (MLP 4C) with L = 17 tokens (1 + 16 patches), stages elsewhere:
    the class token alone saves, per other token, its query (C^2), projection (C^2), MLP
    (8 C^2) and its row of both attention products (2 L C)."""
    model = build("class token")
    C, L, P = 48, 17, 1
    config = vitprune.PruneConfig(keep_rate=1.0, stages=(1,), class_only_last=False)
    saved = (L - P) * (C * C + C * C + 8 * C * C) + 2 * (L - P) * L * C
    only = vitprune.PruneConfig(keep_rate=1.0, stages=(1,), class_only_last=True)
    assert schedule_flops(model, config) - schedule_flops(model, only) == saved


@pytest.mark.parametrize("kind", ["class token", "registers (5 prefix)", "ResPostBlock"])
@pytest.mark.parametrize("options", [dict(keep_rate=1.0), dict(keep_rate=0.5)], ids=str)
def test_analytic_count_agrees_with_fvcore(kind, options):
    model = vitprune.patch(build(kind), **options, class_only_last=True)
    traced, analytic = count_flops(model), analytic_flops(model)
    assert abs(traced - analytic) / analytic < 0.02
    assert analytic < schedule_flops(model, vitprune.PruneConfig(**options, class_only_last=False))


def test_budget_fit_counts_the_saving():
    model = build("class token")
    target = 0.6 * analytic_flops(model) / 1e9
    with_it = vitprune.fit_keep_rate(model, target, class_only_last=True)
    without = vitprune.fit_keep_rate(model, target, class_only_last=False)
    assert vitprune.fit_keep_rate(model, target) == with_it  # the default counts it where it applies
    assert with_it > without  # the saving buys tokens elsewhere
    config = vitprune.PruneConfig(keep_rate=with_it, class_only_last=True)
    assert schedule_flops(model, config) <= target * 1e9


@pytest.mark.parametrize("model", [
    lambda: timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, global_pool="avg"),
    lambda: timm.create_model("vit_base_patch16_siglip_224", img_size=32, patch_size=8, depth=2, embed_dim=48,
                              num_heads=3),
    lambda: timm.create_model("eva02_tiny_patch14_224", img_size=28, depth=2),
], ids=["avg pool", "attention pool", "EVA"])
def test_models_whose_head_reads_more_are_refused_untouched(model):
    model = model().eval()
    before = snapshot(model)
    with pytest.raises(TypeError, match="class_only_last=True cannot apply"):
        vitprune.patch(model, class_only_last=True)
    assert_same(before, snapshot(model))


def test_an_attention_pool_left_under_global_pool_token_is_refused_and_named():
    """timm's ``pool`` runs ``attn_pool`` whenever there is one, whatever ``global_pool`` says,
    so a head that reads every token is refused however the attribute was set; the default
    leaves the last block whole, with the unpruned model's logits when nothing is reduced."""
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_siglip_224", img_size=32, patch_size=8, depth=2, embed_dim=48,
                              num_heads=3).eval()
    model.global_pool = "token"  # set by hand: timm's reset_classifier would drop attn_pool
    before, x = snapshot(model), images()
    expected = logits(model, x)
    with pytest.raises(TypeError, match="class_only_last=True cannot apply") as caught:
        vitprune.patch(model, class_only_last=True)
    assert "pools with an attention pool (AttentionPoolLatent)" in str(caught.value)
    assert_same(before, snapshot(model))
    vitprune.patch(model, keep_rate=1.0)
    assert vitprune.get_config(model).class_only_last is False
    assert_close(logits(model, x), expected, rtol=0, atol=1e-6)


class _SubclassedAttention(Attention):
    """timm's Attention under another name: class_only_last computes timm's own attention
    itself, so it takes the exact class only."""


def _with_last_attention(attn_class):
    model = build("class token")
    last = model.blocks[-1].attn
    replaced = attn_class(last.qkv.in_features, num_heads=last.num_heads, qkv_bias=True)
    replaced.load_state_dict(last.state_dict())
    model.blocks[-1].attn = replaced.eval()
    return model


@pytest.mark.parametrize("make, reason", [
    (lambda: build("class token", block_fn=ParallelScalingBlock),
     "the last block must be a timm Block or ResPostBlock, but it is a ParallelScalingBlock"),
    (lambda: _with_last_attention(_SubclassedAttention),
     "the last block's attention must be timm's Attention with a fused qkv Linear, but it has a _SubclassedAttention"),
], ids=["ParallelScalingBlock", "another attention class"])
def test_a_last_block_it_cannot_take_is_named_in_the_refusal(make, reason):
    model = make()
    before = snapshot(model)
    with pytest.raises(TypeError, match="class_only_last=True cannot apply") as caught:
        vitprune.patch(model, class_only_last=True)
    assert reason in str(caught.value)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_a_non_bool_is_refused(value):
    with pytest.raises(TypeError, match="class_only_last must be True, False or None"):
        vitprune.PruneConfig(class_only_last=value)


@pytest.mark.parametrize("kind", ["class token", "distilled (2 prefix)", "registers (5 prefix)"])
def test_the_default_turns_it_on_for_a_token_pooled_head(kind):
    model, x = build(kind), images()
    assert vitprune.PruneConfig().class_only_last is None
    config = vitprune.get_config(vitprune.patch(model, keep_rate=0.5))
    assert config.class_only_last is True and config.stages == (0, 1, 2)
    shapes = []
    hook = model.blocks[-1].register_forward_hook(lambda module, args, out: shapes.append(out.shape[1]))
    logits(model, x)
    hook.remove()
    assert shapes == [model.num_prefix_tokens]


@pytest.mark.parametrize("model", [
    lambda: timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, global_pool="avg"),
    lambda: timm.create_model("eva02_tiny_patch14_224", img_size=28, depth=2),
], ids=["avg pool", "EVA"])
def test_the_default_leaves_it_off_where_it_does_not_apply(model):
    model = model().eval()
    config = vitprune.get_config(vitprune.patch(model, keep_rate=0.5))
    assert config.class_only_last is False and config.stages[-1] == len(model.blocks) - 1


def test_a_pooling_changed_after_patching_runs_the_whole_last_block():
    """The option is checked at every forward: a head that now reads every token gets them,
    with exactly the logits of the same stages without the option, and the FLOP count follows."""
    model, x = build("class token"), images()
    vitprune.patch(model, keep_rate=0.5, class_only_last=True)
    only = vitprune.analytic_flops(model)
    model.reset_classifier(10, global_pool="avg")
    resolved = vitprune.get_config(model)
    reference = vitprune.patch(copy.deepcopy(model), resolved, class_only_last=False)
    assert_close(logits(model, x), logits(reference, x), rtol=0, atol=0)
    assert vitprune.analytic_flops(model) == vitprune.analytic_flops(reference) > only


def test_forward_features_and_intermediates_return_every_token():
    """Called directly (not from ``forward``), the last block computes every token; the
    logits of ``forward_head`` on them equal the model's own."""
    model, x = vitprune.patch(build("class token"), keep_rate=0.5), images()
    with torch.no_grad():
        out = model(x)
        features = model.forward_features(x)
        again = model(x)
        final, maps = model.forward_intermediates(x, indices=[3], output_fmt="NLC")
    kept = vitprune.kept_positions(model)[-1].shape[1]
    assert features.shape == (3, 1 + kept, 48) and final.shape == features.shape
    assert maps[0].shape == (3, kept, 48)  # timm leaves the prefix tokens out of intermediates
    assert_close(model.forward_head(features), out, rtol=1e-5, atol=1e-6)
    assert_close(again, out, rtol=0, atol=0)
    unpruned = vitprune.patch(build("class token"), keep_rate=1.0)
    _, grids = unpruned.forward_intermediates(x, indices=[3], output_fmt="NCHW")
    assert grids[0].shape == (3, 48, 4, 4)  # nothing pruned: the last block's output is a grid


def test_another_threads_forward_features_is_not_cut_short():
    """Which calls compute the class token alone is per thread: a ``forward_features`` on
    another thread while this thread's ``forward`` is half way neither stops short nor ends
    this forward's shortcut."""
    model, x = vitprune.patch(build("class token"), keep_rate=0.5), images()
    with torch.no_grad():
        expected = model(x)
    here, reached, done, shapes = threading.current_thread(), threading.Event(), threading.Event(), []

    def pause(module, args, out):
        if threading.current_thread() is here:
            reached.set()
            done.wait(timeout=60)

    def features():
        with torch.no_grad():
            model(x)  # this thread's own forward first: its shortcut on, to be cleared
            reached.wait(timeout=60)
            shapes.append(model.forward_features(x).shape[1])
        done.set()

    last = []
    hooks = [model.blocks[1].register_forward_hook(pause), model.blocks[-1].register_forward_hook(
        lambda module, args, out: last.append(out.shape[1]) if threading.current_thread() is here else None)]
    worker = threading.Thread(target=features)
    worker.start()
    with torch.no_grad():
        out = model(x)
    worker.join()
    for hook in hooks:
        hook.remove()
    assert shapes == [1 + vitprune.kept_positions(model)[-1].shape[1]]
    assert last == [1]  # this thread's forward kept its shortcut
    assert_close(out, expected, rtol=0, atol=0)


def test_gradient_checkpointing_recomputes_the_same_block():
    model, x = build("class token"), images()
    reference = vitprune.patch(copy.deepcopy(model), keep_rate=0.5).train()
    vitprune.patch(model, keep_rate=0.5).train()
    model.set_grad_checkpointing(True)
    for net in (model, reference):
        net.zero_grad()
        net(x).square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_unpatch_restores_the_model_and_a_copy_keeps_the_option():
    model, x = build("class token"), images()
    before, expected = snapshot(model), logits(model, x)
    vitprune.patch(model, keep_rate=0.5, class_only_last=True)
    reduced = logits(model, x)
    copied = copy.deepcopy(model)
    assert_close(logits(copied, x), reduced)
    assert vitprune.get_config(copied).class_only_last and copied.blocks[-1].vitprune_class_only
    vitprune.unpatch(model)
    assert_same(before, snapshot(model))
    assert_close(logits(model, x), expected)


def test_training_gives_the_gradients_of_the_patch_without_it():
    """The loss reads the class token alone, so no parameter's gradient may change."""
    model, x = build("class token"), images()
    reference = vitprune.patch(copy.deepcopy(model), keep_rate=0.5, class_only_last=False).train()
    vitprune.patch(model, keep_rate=0.5, class_only_last=True).train()
    for net in (model, reference):
        net.zero_grad()
        net(x).square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, name
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_merging_given_the_saving_fits_its_budget_and_merges_nothing_in_the_last_block():
    model = build("class token")
    target = 0.7 * analytic_flops(model) / 1e9
    config = fit_merging(model, target, class_only_last=True)
    patched = vitprune.patch(copy.deepcopy(model), config)
    resolved = vitprune.get_config(patched)
    assert resolved.class_only_last and resolved.stages == (0, 1, 2)
    assert analytic_flops(patched) <= target * 1e9
    plain = fit_merging(model, target)  # the saving lets the first block merge no more than without it
    assert resolved.keep_rate[0] >= plain.keep_rate[0]
