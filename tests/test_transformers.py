"""The same one line for Hugging Face ``transformers`` ViTs, on tiny random configs (no download)."""

import copy
import importlib.util
import inspect
import io
import re
from pathlib import Path

import pytest
import torch

from conftest import HF_SIZES as SIZES, assert_same, assert_training_step_kept, require_transformers, snapshot

transformers = require_transformers()

import vitprune  # noqa: E402
from vitprune.core.config import token_counts  # noqa: E402

T = transformers
PATCHES = (32 // 8) ** 2
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

#: name -> (config, model class, prefix tokens)
MODELS = {
    "ViTModel": (lambda: T.ViTConfig(**SIZES), T.ViTModel, 1),
    "ViTForImageClassification": (lambda: T.ViTConfig(**SIZES, num_labels=3), T.ViTForImageClassification, 1),
    "DeiTModel": (lambda: T.DeiTConfig(**SIZES), T.DeiTModel, 2),
    "DeiTForImageClassification": (lambda: T.DeiTConfig(**SIZES, num_labels=3), T.DeiTForImageClassification, 2),
    "DeiTForImageClassificationWithTeacher": (lambda: T.DeiTConfig(**SIZES, num_labels=3),
                                              T.DeiTForImageClassificationWithTeacher, 2),
    "Dinov2Model": (lambda: T.Dinov2Config(**SIZES), T.Dinov2Model, 1),
    "Dinov2ForImageClassification": (lambda: T.Dinov2Config(**SIZES, num_labels=3), T.Dinov2ForImageClassification, 1),
    "Dinov2WithRegistersModel": (lambda: T.Dinov2WithRegistersConfig(**SIZES, num_register_tokens=2),
                                 T.Dinov2WithRegistersModel, 3),
    "Dinov2WithRegistersForImageClassification": (
        lambda: T.Dinov2WithRegistersConfig(**SIZES, num_register_tokens=2, num_labels=3),
        T.Dinov2WithRegistersForImageClassification, 3),
    "CLIPVisionModel": (lambda: T.CLIPVisionConfig(**SIZES), T.CLIPVisionModel, 1),
    "CLIPVisionModelWithProjection": (lambda: T.CLIPVisionConfig(**SIZES, projection_dim=16),
                                      T.CLIPVisionModelWithProjection, 1),
    "SiglipVisionModel (attention-pool head)": (lambda: T.SiglipVisionConfig(**SIZES), T.SiglipVisionModel, 0),
}


def build(name, attn_implementation="sdpa"):
    make_config, cls, _ = MODELS[name]
    config = make_config()
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return cls(config).eval()


def images(batch=2, seed=1):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def main_output(outputs):
    """The tensor a user reads: logits, projected embeddings, or the pooled output."""
    for key in ("logits", "image_embeds", "pooler_output"):
        if getattr(outputs, key, None) is not None:
            return getattr(outputs, key)
    return outputs.last_hidden_state


class MainOutput(torch.nn.Module):
    """``main_output(model(pixel_values=x))`` as a module (for export, gradients)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return main_output(self.model(pixel_values=x))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_nothing_pruned_equals_the_unpatched_model(name, attn_implementation):
    model, x = build(name, attn_implementation), images()
    with torch.no_grad():
        expected = main_output(model(x))
        vitprune.patch(model, keep_rate=1.0)
        got = main_output(model(x))
    assert vitprune.is_patched(model)
    torch.testing.assert_close(got, expected, **({} if attn_implementation == "sdpa" else dict(rtol=1e-5, atol=1e-6)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_nothing_reduced_rounds_as_transformers_in_every_dtype(name, attn_implementation, dtype):
    """Every layer through vitprune's path, nothing reduced, every token through the last one:
    bit for bit the model's own output, because the path rounds as transformers' code does
    (the scale on the products, not the queries; ViT, DeiT, CLIP and SigLIP's eager softmax in
    float32; SDPA handed the model's scale, which is not SDPA's own at this head width)."""
    model, x = build(name, attn_implementation).to(dtype), images().to(dtype)
    with torch.no_grad():
        expected = main_output(model(pixel_values=x))
        vitprune.patch(model, keep_rate=1.0, stages="all", class_only_last=False)
        got = main_output(model(pixel_values=x))
    assert torch.equal(got, expected), (got - expected).abs().max().item()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_a_training_step_with_dropout_is_transformers_when_nothing_is_reduced(name, attn_implementation):
    """Every dropout the config has (attention, hidden, drop path) at 0.2, the same seed: at keep
    1.0 in every layer (every token through the last) the patch draws the model's masks in its
    order, so the training forward and every gradient are the model's bit for bit (float64)."""
    make_config, cls, _ = MODELS[name]
    config = make_config()
    for key in ("attention_probs_dropout_prob", "hidden_dropout_prob", "attention_dropout", "dropout",
                "drop_path_rate"):
        if hasattr(config, key):
            setattr(config, key, 0.2)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model, x = cls(config).double().train(), images().double()
    assert_training_step_kept(model, lambda model: main_output(model(pixel_values=x)))


@pytest.mark.parametrize("options", [dict(keep_rate=0.7), dict(indicator="var", keep_rate=0.7, stages=(1, 2),
                                                                selection="top", reduction="fuse", size_aware=False)],
                         ids=["defaults", "paper"])
@pytest.mark.parametrize("name", MODELS)
def test_pruning_keeps_the_schedules_token_counts_and_unpatch_restores_everything(name, options):
    model, x = build(name), images()
    with torch.no_grad():
        expected = main_output(model(pixel_values=x, output_hidden_states=True))  # transformers sets its own
        before = snapshot(model)                                                  # attributes on a first call
        vitprune.patch(model, **options)
        outputs = model(pixel_values=x, output_hidden_states=True)
    config = vitprune.get_config(model)
    counts = token_counts(config.keep_rate, config.stages, 4, PATCHES, config.reduction == "fuse")
    assert [p.shape[1] for p in vitprune.kept_positions(model)] == [counts[s] for s in config.stages]
    prefix = MODELS[name][2]
    assert [h.shape[1] - prefix for h in outputs.hidden_states[1:]] == list(counts)
    assert main_output(outputs).shape == expected.shape and torch.isfinite(main_output(outputs)).all()
    vitprune.unpatch(model)
    assert_same(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(main_output(model(x)), expected)


@pytest.mark.parametrize("name", MODELS)
def test_a_patched_models_forward_shows_the_original_signature(name):
    """``Trainer`` keeps the dataset columns that ``forward``'s signature names (``pixel_values``,
    ``labels``): a ``(*args, **kwargs)`` signature would drop them all."""
    model = build(name)
    before = inspect.signature(model.forward)
    vitprune.patch(model, keep_rate=0.7)
    assert inspect.signature(model.forward) == before and "pixel_values" in before.parameters


@pytest.mark.parametrize("options", [dict(keep_rate=0.5), dict(keep_rate=0.3, stages=(1,))],
                         ids=["defaults", "bipartite rounds"])
@pytest.mark.parametrize("name", MODELS)
def test_a_batch_gives_every_image_what_it_gives_alone(name, options):
    """The defaults (one round per block: a batch of one indexes its own rows), and one stage
    removing more than half the tokens (rounds); float64, so no near tie of the matching flips
    between batched and single products."""
    model, x = vitprune.patch(build(name).double(), **options), images(batch=3).double()
    with torch.no_grad():
        together = main_output(model(pixel_values=x))
        alone = torch.cat([main_output(model(pixel_values=image.unsqueeze(0))) for image in x])
    torch.testing.assert_close(together, alone, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["ViTForImageClassification", "Dinov2WithRegistersForImageClassification"])
def test_patched_models_save_load_and_copy(name):
    model, x = vitprune.patch(build(name), keep_rate=0.6), images()
    keys = set(build(name).state_dict())
    assert set(model.state_dict()) == keys
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        expected = main_output(model(x))
        for other in (loaded, copy.deepcopy(model)):
            assert torch.equal(main_output(other(x)), expected)
    fresh = vitprune.patch(build(name), keep_rate=0.6)
    fresh.load_state_dict(model.state_dict())


def test_dinov2_classifier_averages_patch_tokens_by_size():
    model, x = vitprune.patch(build("Dinov2ForImageClassification"), keep_rate=0.5), images()
    seen = {}
    model.dinov2.register_forward_hook(lambda m, args, out: seen.update(tokens=out.last_hidden_state))
    model.classifier.register_forward_pre_hook(lambda m, args: seen.update(inputs=args[0]))
    with torch.no_grad():
        model(x)
    tokens, sizes = seen["tokens"], model.vitprune_state.sizes
    assert (sizes != 1).any()
    weighted = (tokens[:, 1:] * sizes.unsqueeze(-1)).sum(1) / sizes.sum(1, keepdim=True)
    torch.testing.assert_close(seen["inputs"], torch.cat([tokens[:, 0], weighted], dim=1))


def test_auto_classes_resolve_to_supported_models():
    torch.manual_seed(0)
    model = T.AutoModelForImageClassification.from_config(T.ViTConfig(**SIZES, num_labels=3)).eval()
    vitprune.patch(model, keep_rate=0.7)
    with torch.no_grad():
        assert model(images()).logits.shape == (2, 3)


@pytest.mark.parametrize("options, error, match", [
    (dict(keep_rate=2.0), ValueError, r"keep_rate must be in \(0, 1\]"),
    (dict(overlap_stride=4), TypeError, "overlap_stride is supported for VisionTransformer models only"),
    (dict(stages=(9,)), ValueError, "stages"),
    (dict(colour="red"), TypeError, r"unknown option\(s\) \['colour'\]"),
])
def test_bad_options_are_refused_before_the_model_changes(options, error, match):
    model = build("ViTForImageClassification")
    before = snapshot(model)
    with pytest.raises(error, match=match):
        vitprune.patch(model, **options)
    assert_same(before, snapshot(model))


def test_unsupported_transformers_models_are_refused_with_the_reason():
    model = T.CLIPModel(T.CLIPConfig(vision_config=SIZES, text_config=dict(hidden_size=32, num_hidden_layers=1,
                                                                           num_attention_heads=4,
                                                                           intermediate_size=64)))
    before = snapshot(model)
    with pytest.raises(TypeError, match="CLIPModel: patch its vision tower"):
        vitprune.patch(model)
    assert_same(before, snapshot(model))


def test_siglip_head_weights_a_merged_token_as_its_repeated_patches():
    model = vitprune.patch(build("SiglipVisionModel (attention-pool head)"), keep_rate=0.7)
    head = model.head
    tokens = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    model.vitprune_state.records.sizes = torch.tensor([[2.0, 1, 1, 3, 1], [1.0, 1, 1, 1, 1]])
    repeats = [tokens[0].repeat_interleave(torch.tensor([2, 1, 1, 3, 1]), dim=0), tokens[1]]
    with torch.no_grad():
        got = head(tokens)
        model.vitprune_state.records.sizes = None
        expected = [head(r.unsqueeze(0))[0] for r in repeats]
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-5, atol=1e-6)


def test_attention_masks_are_refused_after_pruning_starts():
    model = vitprune.patch(build("ViTModel"), keep_rate=0.5)
    mask = torch.ones(2, PATCHES + 1)
    mask[:, -1] = 0  # an all-ones mask is dropped by transformers itself
    with pytest.raises(ValueError, match="cannot apply attn_mask"):
        model(images(), attention_mask=mask)


def test_a_plain_trainer_fine_tunes_a_patched_model(tmp_path):
    pytest.importorskip("accelerate")
    spec = importlib.util.spec_from_file_location("finetune_transformers", EXAMPLES / "finetune_transformers.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    metrics = example.main(["--steps", "3", "--limit", "160", "--out", str(tmp_path)])
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and torch.isfinite(torch.tensor(metrics["eval_loss"]))


@pytest.mark.parametrize("name", ["ViTForImageClassification", "Dinov2Model", "CLIPVisionModel",
                                  "SiglipVisionModel (attention-pool head)"])
def test_interpolate_pos_encoding_keeps_working(name):
    model = build(name)
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = main_output(model(x, interpolate_pos_encoding=True))
        vitprune.patch(model, keep_rate=1.0)
        torch.testing.assert_close(main_output(model(x, interpolate_pos_encoding=True)), expected)
        vitprune.patch(model, keep_rate=0.5)
        got = main_output(model(pixel_values=x, interpolate_pos_encoding=True))
    assert got.shape == expected.shape and vitprune.kept_positions(model)[0].shape[1] < (48 // 8) ** 2


@pytest.mark.parametrize("name", MODELS)
def test_output_attentions_records_every_layer_at_its_pruned_length(name):
    """Eager attention returns weights: every layer's, of the tokens it saw; at keep 1.0 the
    unpatched model's own; asking for them does not change the output."""
    model, x = build(name, "eager"), images()
    prefix = MODELS[name][2]
    with torch.no_grad():
        expected = model(pixel_values=x, output_attentions=True).attentions
        vitprune.patch(model, keep_rate=1.0)
        same = model(pixel_values=x, output_attentions=True).attentions
        vitprune.patch(model, keep_rate=0.7)
        outputs = model(pixel_values=x, output_attentions=True)
        plain = model(pixel_values=x)
    assert len(same) == len(expected) == 4
    for got, want in zip(same, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    config = vitprune.get_config(model)
    counts = token_counts(config.keep_rate, config.stages, 4, PATCHES, config.reduction == "fuse")
    seen = [PATCHES, *counts[:-1]]
    assert [tuple(a.shape) for a in outputs.attentions] == [(2, 4, prefix + n, prefix + n) for n in seen]
    for weights in outputs.attentions:
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    # A plain call of a ViT or DeiT classifier computes the last layer for the prefix alone
    # (class_only_last): the same sums, blocked differently by the smaller products.
    exact = dict(rtol=1e-5, atol=1e-6) if config.class_only_last else dict(rtol=0, atol=0)
    torch.testing.assert_close(main_output(outputs), main_output(plain), **exact)


@pytest.mark.parametrize("name", ["ViTModel", "Dinov2WithRegistersModel", "CLIPVisionModel",
                                  "SiglipVisionModel (attention-pool head)"])
def test_output_attentions_records_the_weights_with_the_size_bias(name):
    """After a merge, the weights ``transformers`` records are those the layer attended with:
    ``softmax(q k^T * scale + log s)``, every key's logit raised by the log of the patches its
    token holds (prefix tokens hold one), computed here from the layer's own projections."""
    model, x = build(name, "eager"), images()
    vitprune.patch(model, keep_rate=0.5, stages=(1,), class_only_last=False)
    last = [m for m in model.modules() if hasattr(m, "q_proj")][-1]  # the last layer's attention
    seen = {}
    last.register_forward_hook(lambda m, args, kwargs, out: seen.update(x=args[0]), with_kwargs=True)
    with torch.no_grad():
        recorded = model(pixel_values=x, output_attentions=True).attentions[-1]
    sizes, prefix = model.vitprune_state.sizes, MODELS[name][2]
    assert (sizes > 1).any()  # merged tokens: a missing bias changes the weights
    heads = getattr(last, "num_attention_heads", None) or last.num_heads
    q, k = (proj(seen["x"]).unflatten(-1, (heads, -1)).transpose(1, 2) for proj in (last.q_proj, last.k_proj))
    scale = getattr(last, "scaling", None) or last.scale
    log_sizes = torch.cat([torch.zeros(sizes.shape[0], prefix), sizes.log()], dim=1)
    expected = (q @ k.transpose(-2, -1) * scale + log_sizes[:, None, None, :]).softmax(-1)
    torch.testing.assert_close(recorded, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch.ao.quantization, "quantize_dynamic"), reason="no quantize_dynamic in this torch")
@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning")
@pytest.mark.parametrize("name", ["ViTForImageClassification", "DeiTForImageClassification"])
def test_dynamically_quantized_classifiers_are_exact_when_nothing_is_reduced_in_either_order(name):
    """Their quantized layers round on a scale taken from every token they are given, so the
    class token alone in the last layer (``class_only_last``) would round otherwise: off by
    default on a quantized model, and skipped at the call on one quantized after patching."""
    def quantized(model):
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)

    model, x = build(name), images()
    with torch.no_grad():
        expected = quantized(copy.deepcopy(model))(pixel_values=x).logits
        first = vitprune.patch(quantized(copy.deepcopy(model)), keep_rate=1.0)
        assert vitprune.get_config(first).class_only_last is False
        assert torch.equal(first(pixel_values=x).logits, expected)
        after = quantized(vitprune.patch(copy.deepcopy(model), keep_rate=1.0))
        assert vitprune.get_config(after).class_only_last is True
        assert torch.equal(after(pixel_values=x).logits, expected)


def test_a_hook_on_an_attention_module_the_patch_runs_itself_is_named():
    from vitprune.core.registry import blocks_of

    import warnings

    model = build("ViTForImageClassification")
    with torch.no_grad():  # transformers hooks every attention module to record what a call asks for
        model(pixel_values=images(), output_attentions=True, output_hidden_states=True)
    blocks_of(model)[2].attention.register_forward_hook(lambda *a: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vitprune.patch(model, keep_rate=0.7)
    named = [str(w.message) for w in caught if "hooks registered on" in str(w.message)]
    assert len(named) == 1 and re.search(r"will not run while the model is patched: [\w.]+\.2\.attention;", named[0])


def test_a_hook_added_after_patch_to_an_attention_module_the_patch_runs_itself_is_named_once():
    from vitprune.core.registry import blocks_of

    import warnings

    model = vitprune.patch(build("ViTForImageClassification"), keep_rate=0.7)
    with torch.no_grad():  # transformers' own recorders on every attention module are not named
        model(pixel_values=images(), output_attentions=True, output_hidden_states=True)
    blocks_of(model)[1].attention.register_forward_hook(lambda *a: None)

    def named_by_a_call():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                model(pixel_values=images())
        return [str(w.message) for w in caught if "after patch" in str(w.message)]

    first, second = named_by_a_call(), named_by_a_call()
    assert len(first) == 1 and re.search(r"hooks were registered on [\w.]+\.1\.attention after patch;", first[0])
    assert second == []


@pytest.mark.parametrize("name", ["ViTForImageClassification", "Dinov2ForImageClassification",
                                  "CLIPVisionModelWithProjection"])
def test_activation_checkpointing_gives_the_same_gradients(name):
    """``transformers``' checkpointing recomputes each patched layer in the backward pass
    (the classifiers' last layer with the class token alone): the same gradients."""
    from vitprune.core.registry import blocks_of

    x = images(batch=3)
    grads, calls = [], []
    for checkpointed in (False, True):
        model = vitprune.patch(build(name), keep_rate=0.6).train()
        if checkpointed:  # renamed in transformers 5.x; the old name warns
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        ran, last = [], blocks_of(model)[-1]  # its forward, which transformers checkpoints (not its hooks)
        last._vitprune_begin = lambda x, begin=last._vitprune_begin: (ran.append(1), begin(x))[1]
        main_output(model(pixel_values=x)).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        calls.append(len(ran))
    assert calls == [1, 2]  # the checkpointed layer ran again in the backward pass
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=n)
