"""With nothing pruned, a patched model is the unpatched model (fp32, eval, random weights)."""

import pytest
import timm
import torch
from torch.testing import assert_close

import vitprune
from conftest import MODEL_FACTORIES, image_batch, make_model, paper


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
    for a, b in zip(fused, vitprune.kept_positions(tiny)):
        assert torch.equal(a, b)
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
