"""``class_only_last`` on ``transformers`` classifiers whose head reads the class token alone
(ViT; DeiT, with the distillation token): the last layer computes the prefix tokens alone in
a call that records nothing, and only there."""

import pytest
import torch

from conftest import HF_SIZES as SIZES, assert_same, require_transformers, snapshot

transformers = require_transformers()

import vitprune  # noqa: E402
from vitprune.measure.flops import schedule_flops  # noqa: E402

T = transformers
PATCHES = (32 // 8) ** 2

#: name -> (model, prefix tokens)
CLASSIFIERS = {
    "ViTForImageClassification": (lambda: T.ViTForImageClassification(T.ViTConfig(**SIZES, num_labels=3)), 1),
    "DeiTForImageClassification": (lambda: T.DeiTForImageClassification(T.DeiTConfig(**SIZES, num_labels=3)), 2),
    "DeiTForImageClassificationWithTeacher": (
        lambda: T.DeiTForImageClassificationWithTeacher(T.DeiTConfig(**SIZES, num_labels=3)), 2),
}

#: Models whose output reads more than the class token of the last layer.
OTHERS = {
    "ViTModel": lambda: T.ViTModel(T.ViTConfig(**SIZES)),
    "Dinov2ForImageClassification": lambda: T.Dinov2ForImageClassification(T.Dinov2Config(**SIZES, num_labels=3)),
    "CLIPVisionModelWithProjection": lambda: T.CLIPVisionModelWithProjection(
        T.CLIPVisionConfig(**SIZES, projection_dim=16)),
}

TIGHT = dict(rtol=1e-5, atol=1e-6)  # the same sums, blocked differently by the smaller products


def build(name, attn_implementation="sdpa"):
    torch.manual_seed(0)
    model = (CLASSIFIERS[name][0] if name in CLASSIFIERS else OTHERS[name])()
    model.config._attn_implementation = attn_implementation
    return model.eval()


def images(batch=2, seed=1):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def last_layer(model):
    """The last ViT or DeiT layer of ``model``."""
    layers = (T.models.vit.modeling_vit.ViTLayer, T.models.deit.modeling_deit.DeiTLayer)
    return [m for m in model.modules() if isinstance(m, layers)][-1]


def last_layer_tokens(model, call):
    """What the last layer returns during ``call()``: its output's token count."""
    seen = {}
    handle = last_layer(model).register_forward_hook(lambda m, args, out: seen.update(tokens=out.shape[1]))
    try:
        result = call()
    finally:
        handle.remove()
    return result, seen["tokens"]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("keep_rate", [1.0, 0.5])
@pytest.mark.parametrize("name", CLASSIFIERS)
def test_the_default_computes_the_prefix_alone_with_the_logits_of_the_whole_layer(name, keep_rate,
                                                                                 attn_implementation):
    model, x = build(name, attn_implementation), images()
    prefix = CLASSIFIERS[name][1]
    with torch.no_grad():
        unpatched = model(x).logits
        vitprune.patch(model, keep_rate=keep_rate, class_only_last=False)
        whole, tokens = last_layer_tokens(model, lambda: model(x).logits)
        vitprune.patch(model, keep_rate=keep_rate)
        assert vitprune.get_config(model).class_only_last is True
        got, prefix_tokens = last_layer_tokens(model, lambda: model(x).logits)
    assert prefix_tokens == prefix and tokens > prefix
    torch.testing.assert_close(got, whole, **TIGHT)
    if keep_rate == 1.0:
        torch.testing.assert_close(got, unpatched, **TIGHT)


@pytest.mark.parametrize("ask", ["output_hidden_states", "output_attentions"])
def test_a_call_that_records_the_layers_runs_the_whole_last_layer(ask):
    model, x = build("ViTForImageClassification", "eager"), images()
    vitprune.patch(model, keep_rate=0.5)
    with torch.no_grad():
        plain = model(x).logits
        outputs, tokens = last_layer_tokens(model, lambda: model(pixel_values=x, **{ask: True}))
        model.config.__setattr__(ask, True)  # the config's default counts as asking too
        _, from_config = last_layer_tokens(model, lambda: model(x))
    assert tokens == from_config > 1
    torch.testing.assert_close(outputs.logits, plain, **TIGHT)
    if ask == "output_hidden_states":
        assert outputs.hidden_states[-1].shape[1] == tokens


def test_the_backbone_called_directly_returns_every_token():
    model, x = build("DeiTForImageClassificationWithTeacher"), images()
    vitprune.patch(model, keep_rate=0.5)
    with torch.no_grad():
        expected = model.deit(x).last_hidden_state
        model(x)  # marks the calling thread for the classifier's last layer
        direct = model.deit(x).last_hidden_state
    assert direct.shape == expected.shape and direct.shape[1] > 2
    torch.testing.assert_close(direct, expected, rtol=0, atol=0)


def test_flops_by_hand():
    """Width C = 32, MLP 64, L = 17 tokens (1 + 16 patches), nothing merged: the class token
    alone saves, per other token, its query and output projections (2 C^2), its MLP (2 C 64)
    and its row of both attention products (2 L C)."""
    model = build("ViTForImageClassification")
    C, hidden, L, P = 32, 64, 17, 1
    whole = vitprune.PruneConfig(keep_rate=1.0, stages=(1,), class_only_last=False)
    only = vitprune.PruneConfig(keep_rate=1.0, stages=(1,), class_only_last=True)
    saved = (L - P) * (2 * C * C + 2 * C * hidden) + 2 * (L - P) * L * C
    assert schedule_flops(model, whole) - schedule_flops(model, only) == saved
    vitprune.patch(model, keep_rate=1.0, stages=(1,))
    assert vitprune.analytic_flops(model) == schedule_flops(model, only)


@pytest.mark.parametrize("keep_rate", [1.0, 0.6])
@pytest.mark.parametrize("name", CLASSIFIERS)
def test_fvcore_and_the_analytic_count_agree(name, keep_rate):
    """fvcore traces ``forward``, which takes the shortcut; the two differ by the norms fvcore counts."""
    model = vitprune.patch(build(name), keep_rate=keep_rate)
    full = vitprune.patch(build(name), keep_rate=keep_rate, class_only_last=False)
    traced, analytic = vitprune.count_flops(model), vitprune.analytic_flops(model)
    assert 0 < traced - analytic < 0.05 * analytic
    assert analytic < vitprune.analytic_flops(full) and traced < vitprune.count_flops(full)


@pytest.mark.parametrize("name", OTHERS)
def test_the_default_leaves_it_off_and_true_is_refused_untouched(name):
    model = build(name)
    before = snapshot(model)
    with pytest.raises(TypeError, match="class_only_last=True cannot apply"):
        vitprune.patch(model, keep_rate=0.5, class_only_last=True)
    assert_same(before, snapshot(model))
    vitprune.patch(model, keep_rate=0.5)
    assert vitprune.get_config(model).class_only_last is False


def test_training_and_gradient_checkpointing_give_the_gradients_of_the_whole_layer():
    x, labels = images(4), torch.tensor([0, 1, 2, 0])

    def gradients(class_only, checkpointing):
        model = build("ViTForImageClassification").train()
        model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        if checkpointing:
            model.activation_checkpointing_enable(dict(use_reentrant=False))
        vitprune.patch(model, keep_rate=0.5, class_only_last=class_only)
        model(pixel_values=x, labels=labels).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    expected = gradients(False, False)
    for checkpointing in (False, True):
        got = gradients(True, checkpointing)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_the_prefix_alone_passes_through_the_layers_dropout(name):
    """Training, the last layer's dropout at 1.0 (both its branches zeroed): that layer passes
    its input through, so the prefix alone gives the logits of the whole layer exactly; a
    shortcut that skipped the layer's dropout would add the branches."""
    x = images()

    def logits(class_only):
        model = build(name).train()
        last_layer(model).dropout.p = 1.0
        vitprune.patch(model, keep_rate=0.5, class_only_last=class_only)
        with torch.no_grad():
            out, tokens = last_layer_tokens(model, lambda: model(x).logits)
        assert (tokens == CLASSIFIERS[name][1]) is class_only
        return out

    torch.testing.assert_close(logits(True), logits(False), rtol=0, atol=0)


def test_unpatch_restores_the_class_and_everything():
    model, x = build("DeiTForImageClassification"), images()
    with torch.no_grad():
        expected = model(x).logits
    before = snapshot(model)
    vitprune.patch(model, keep_rate=0.5)
    assert type(model) is not T.DeiTForImageClassification and isinstance(model, T.DeiTForImageClassification)
    vitprune.unpatch(model)
    assert type(model) is T.DeiTForImageClassification
    assert_same(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)


@pytest.mark.parametrize("name", ["ViTForImageClassification", "Dinov2ForImageClassification"])
def test_a_saved_patched_classifier_names_its_own_architecture_and_loads_unpatched(name, tmp_path):
    """``save_pretrained`` writes the class name as the checkpoint's architecture: the
    original's, so the folder loads as the model it is (both classifiers vitprune subclasses
    while patched)."""
    original = type(build(name))
    model = vitprune.patch(build(name), keep_rate=0.5)
    model.save_pretrained(tmp_path)
    assert T.AutoConfig.from_pretrained(tmp_path).architectures == [original.__name__]
    loaded = T.AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is original
    with torch.no_grad():
        expected = vitprune.patch(loaded, keep_rate=0.5)(images()).logits
        torch.testing.assert_close(model(images()).logits, expected, rtol=0, atol=0)


@pytest.mark.slow
def test_an_exported_classifier_takes_the_shortcut():
    """torch.export traces ``forward``: the last layer's projections after the keys and values
    run on the class token alone."""
    model, x = vitprune.patch(build("ViTForImageClassification"), keep_rate=0.7), images()
    exported = torch.export.export(model, (x,))
    linears = [tuple(node.meta["val"].shape) for node in exported.graph.nodes
               if node.op == "call_function" and "linear" in str(node.target)]
    assert linears[-4:] == [(2, 1, 32), (2, 1, 64), (2, 1, 32), (2, 3)]  # output projection, MLP, classifier
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x).logits, model(x).logits, **TIGHT)
