"""With nothing pruned, a patched model is the unpatched model (fp32, eval, random weights)."""

import pytest
import timm
import torch
from torch.testing import assert_close

import vitprune
from conftest import FAMILIES, MODEL_FACTORIES, assert_same_per_stage, build, image_batch, images, make_model, paper


@pytest.mark.parametrize("name", list(MODEL_FACTORIES))
@pytest.mark.parametrize("options", [
    {"keep_rate": 1.0},
    {"keep_rate": 1.0, "indicator": "medad", "stages": (0, 5, 11)},
    {"keep_rate": 0.5, "stages": ()},
], ids=["keep1.0", "keep1.0-medad-stages0,5,11", "no-stages"])
def test_nothing_pruned_equals_unpatched(name, options):
    model = make_model(name)
    x = image_batch(model)
    with torch.no_grad():
        expected = model(x)
        vitprune.patch(model, **options)
        actual = model(x)
    assert_close(actual, expected)


def test_explicit_attention_path_equals_unpatched(tiny):
    # TIMM_FUSED_ATTN=0 or an old torch: timm computes the attention matrix itself.
    for block in tiny.blocks:
        block.attn.fused_attn = False
    x = image_batch(tiny)
    with torch.no_grad():
        expected = tiny(x)
        vitprune.patch(tiny, keep_rate=1.0)
        assert_close(tiny(x), expected)


def test_fused_and_explicit_paths_keep_the_same_patches(tiny):
    x = image_batch(tiny)
    vitprune.patch(tiny, keep_rate=0.6)
    with torch.no_grad():
        fused_out = tiny(x)
        fused = vitprune.kept_positions(tiny)
        for block in tiny.blocks:
            block.attn.fused_attn = False
        explicit_out = tiny(x)
    assert_same_per_stage(vitprune.kept_positions(tiny), fused, len(vitprune.get_config(tiny).stages))
    assert_close(explicit_out, fused_out, rtol=1e-4, atol=1e-5)


def test_dynamic_img_size_equivalence_and_pruning():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", dynamic_img_size=True).eval()
    x = torch.randn(2, 3, 160, 96)  # a 10 x 6 grid: 60 patches
    with torch.no_grad():
        expected = model(x)
        vitprune.patch(model, keep_rate=1.0)
        assert_close(model(x), expected)
        vitprune.patch(model, keep_rate=0.5, **paper(stages=(2,)))
        assert model.forward_features(x).shape == (2, 1 + 30 + 1, model.embed_dim)


#: Reductions beside the defaults' one round per block (where a batch of one indexes its own
#: rows and a batch the flattened rows): bipartite rounds (one stage removing more than half
#: the tokens), the paper's fusion token, redundancy merging, dropping.
PER_IMAGE = {
    "bipartite rounds": {"keep_rate": 0.3, "stages": (1,)},
    "paper": paper(indicator="var", stages=(1, 2), keep_rate=0.6),
    "redundant, merge": {"selection": "redundant", "keep_rate": 0.5},
    "top, drop": {"selection": "top", "reduction": "drop", "indicator": "medad", "keep_rate": 0.5},
}
#: The defaults on every family; the other reductions on a class token with registers, a
#: pooled head with registers, and a relative position bias.
BATCH_CASES = [pytest.param(name, {"keep_rate": 0.7}, id=f"{name}-defaults") for name in FAMILIES] + [
    pytest.param(name, options, id=f"{name}-{label}")
    for name in ("DINOv3 (rope, registers)", "registers, no class token", "BEiT (relative position bias)")
    for label, options in PER_IMAGE.items()]


@pytest.mark.parametrize("name, options", BATCH_CASES)
def test_a_batch_gives_every_image_what_it_gives_alone(name, options):
    """Tokens are chosen and merged per image: an image's output does not depend on the
    others in its batch. In float64, so no near tie of the matching flips between the
    batched and the single-image products."""
    model = vitprune.patch(build(name).double(), **options)
    x = images(model).double()
    with torch.no_grad():
        together = model(x)
        alone = torch.cat([model(image.unsqueeze(0)) for image in x])
    assert_close(together, alone, rtol=1e-9, atol=1e-10)
