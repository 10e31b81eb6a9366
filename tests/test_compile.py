"""torch.compile sees one graph and gives the eager outputs (a small model keeps this quick)."""

import pytest
import timm
import torch
from torch.testing import assert_close

import vitprune


@pytest.mark.slow
def test_compiled_patched_model_matches_eager_without_graph_breaks():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4, embed_dim=64, num_heads=4).eval()
    vitprune.patch(model, indicator="medad", keep_rate=0.6, stages=(1, 2))
    x = torch.randn(3, 3, 64, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break raises
    with torch.no_grad():
        expected = model(x)
        eager_kept = vitprune.kept_positions(model)
        actual = compiled(x)
    assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    for a, b in zip(vitprune.kept_positions(model), eager_kept):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_compiled_model_does_not_recompile_across_batches_of_one_shape():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4, embed_dim=64, num_heads=4).eval()
    vitprune.patch(model, indicator="var", keep_rate=0.6, stages=(1, 2))
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for seed in range(3):  # new values each time, same shape: one graph serves them all
            x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
            assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
