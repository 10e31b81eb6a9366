"""torch.compile sees one graph and gives the eager outputs (a small model keeps this quick).

The defaults and the paper's method go through inductor, the compiler users get; the other
modes through ``aot_eager``: the same graph capture (dynamo, so ``fullgraph`` still fails on
any graph break) and AOTAutograd's functionalised graph, without inductor's C++ build, which
is most of a cold test's minute on 2 cores."""

import pytest
import timm
import torch
from torch.testing import assert_close

import vitprune
from conftest import assert_same_per_stage, paper


#: The paper's fusion token and the defaults (bipartite merge, size-aware) through inductor;
#: bipartite keeping fewer than half (evenly spaced destinations), score-guided merging and
#: dropping in every block, crowding in matching rounds (keeping under half) and the defaults with
#: the class token alone in the last block through aot_eager.
MODES = [(paper(stages=(1, 2)), "inductor"), ({}, "inductor"), (dict(keep_rate=0.3), "aot_eager"),
         (dict(selection="redundant", stages=(1, 2)), "aot_eager"),
         (dict(selection="top", reduction="drop", stages="all", keep_rate=0.9), "aot_eager"),
         (dict(indicator=None, crowding=0.5, keep_rate=0.4, stages="all"), "aot_eager"),
         (dict(indicator=None, class_only_last=True), "aot_eager")]


@pytest.mark.slow
@pytest.mark.parametrize("options, backend", MODES, ids=str)
def test_compiled_patched_model_matches_eager_without_graph_breaks(options, backend):
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4, embed_dim=64, num_heads=4).eval()
    vitprune.patch(model, **{"indicator": "medad", "keep_rate": 0.6, **options})
    x = torch.randn(3, 3, 64, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    with torch.no_grad():
        expected = model(x)
        eager_kept = vitprune.kept_positions(model)
        actual = compiled(x)
    assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    assert_same_per_stage(vitprune.kept_positions(model), eager_kept, len(vitprune.get_config(model).stages))


@pytest.mark.slow
def test_compiled_model_does_not_recompile_across_batches_of_one_shape():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4, embed_dim=64, num_heads=4).eval()
    vitprune.patch(model, indicator="var", keep_rate=0.6, stages=(1, 2))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")  # guards and recompiles are dynamo's
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for seed in range(3):  # new values each time, same shape: one graph serves them all
            x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
            assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_under_autocast_the_matching_stays_float32_in_one_graph():
    """``merging.cosines`` turns autocast off around its product: dynamo traces that in the graph."""
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4, embed_dim=64, num_heads=4).eval()
    vitprune.patch(model, keep_rate=0.6)
    x = torch.randn(3, 3, 64, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        eager_kept = vitprune.kept_positions(model)
        actual = compiled(x)
    assert_close(actual, expected, rtol=1e-2, atol=1e-2)  # bfloat16's resolution
    assert_same_per_stage(vitprune.kept_positions(model), eager_kept, len(vitprune.get_config(model).stages))
