"""Dynamic int8 quantization (``torch.ao.quantization.quantize_dynamic``: every ``Linear``
swapped for one that rounds its input on a scale taken from all of it) with vitprune:
exact with nothing reduced, in either order, and counted as the float model is."""

import copy

import pytest
import timm
import torch

import vitprune
from conftest import FAMILIES, build, images

if not hasattr(torch.ao.quantization, "quantize_dynamic"):  # deprecated since torch 2.10
    pytest.skip("this torch has no torch.ao.quantization.quantize_dynamic", allow_module_level=True)
pytestmark = [pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning")]

#: timm's own forward fails once quantized (it reads ``qkv.weight``, a method there), and
#: before timm 1.0.25 also ParallelScalingBlock's without qkv biases (``in_proj.weight``).
TIMM_FAILS = {"BEiT (relative position bias)", "BEiT, shared table", "Eva02 (rope, SwiGLU, avg pool)"}
if tuple(int(part) for part in timm.__version__.split(".")[:3]) < (1, 0, 25):
    TIMM_FAILS |= {"ParallelScalingBlock, no qkv bias", "ParallelScalingBlock, RmsNorm, qk-norm (xp)"}
RUNS = sorted(set(FAMILIES) - TIMM_FAILS)
#: A family whose last block computes the class token alone by default (separate
#: projections): the one where quantization would change a class-only block's rounding.
SEPARATE_PROJECTIONS = "Sapiens2 (rope, grouped key/value heads)"


def quantized(model):
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def structure(model):
    """Module classes, attribute names and which module and parameter objects the model
    holds (a quantized model's state dict holds packed weights that ``snapshot`` cannot copy)."""
    return ([(name, type(m), id(m), sorted(vars(m))) for name, m in model.named_modules()],
            [(name, id(p)) for name, p in model.named_parameters()])


@pytest.mark.parametrize("name", RUNS)
def test_quantized_then_patched_equals_the_quantized_model_when_nothing_is_reduced(name):
    model = quantized(build(name))
    x = images(model, batch=2)
    with torch.no_grad():
        expected = model(x)
        before = structure(model)
        vitprune.patch(model, keep_rate=1.0)
        assert torch.equal(model(x), expected)
        vitprune.unpatch(model)
        assert structure(model) == before and torch.equal(model(x), expected)


@pytest.mark.parametrize("name", [SEPARATE_PROJECTIONS, "CLIP tower"])
def test_patched_then_quantized_equals_the_quantized_model_when_nothing_is_reduced(name):
    original = build(name)
    x = images(original, batch=2)
    patched = vitprune.patch(copy.deepcopy(original), keep_rate=1.0)
    model = quantized(patched)  # a copy: class_only_last was settled on float layers
    with torch.no_grad():  # the last block finds its quantized layers at the call and runs whole
        assert torch.equal(model(x), quantized(original)(x))


def test_class_only_last_is_off_by_default_and_refused_on_a_quantized_last_block():
    model = quantized(build(SEPARATE_PROJECTIONS))
    assert vitprune.get_config(vitprune.patch(copy.deepcopy(model), keep_rate=0.7)).class_only_last is False
    before = structure(model)
    with pytest.raises(TypeError, match=r"class_only_last=True cannot apply.*attn\.q_proj is a dynamically "
                                         r"quantized Linear.*leave class_only_last=None"):
        vitprune.patch(model, keep_rate=0.7, class_only_last=True)
    assert structure(model) == before and not vitprune.is_patched(model)
    float_model = build(SEPARATE_PROJECTIONS)
    assert vitprune.get_config(vitprune.patch(float_model, keep_rate=0.7)).class_only_last is True


@pytest.mark.parametrize("name", ["ResPostBlock", SEPARATE_PROJECTIONS, "siglip map (attention pool)", "hybrid (ResNet stem)"])
@pytest.mark.parametrize("options", [None, dict(keep_rate=0.7, class_only_last=False)])
def test_analytic_flops_count_quantized_layers_as_the_float_ones(name, options):
    float_model = build(name)
    model = quantized(copy.deepcopy(float_model))
    if options is not None:
        vitprune.patch(float_model, **options)
        vitprune.patch(model, **options)
    assert vitprune.analytic_flops(model) == vitprune.analytic_flops(float_model)
