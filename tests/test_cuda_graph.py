"""examples/gpu_cuda_graph.py: its settings are at equal cost, and (with a GPU) a patched model
replayed from a CUDA graph gives what it gives eagerly."""

import sys
from pathlib import Path

import pytest
import torch

import vitprune
from conftest import images, small_vit
from test_step_cost import block_token_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpu_cuda_graph  # noqa: E402


def test_the_settings_are_the_unpruned_model_and_reductions_at_the_defaults_cost():
    model = small_vit(depth=6)
    models = gpu_cuda_graph.settings(model)
    assert models["unpruned"] is model and not vitprune.is_patched(model)
    flops = {label: vitprune.analytic_flops(getattr(m, "model", m)) for label, m in models.items()}
    assert 0.9 * flops["defaults"] < flops["token merging"] <= flops["defaults"] < flops["unpruned"]
    assert vitprune.get_config(models["paper (var)"]).selection == "top"
    assert not vitprune.get_config(models["defaults, no size bias"]).size_aware
    assert flops["defaults, no size bias"] <= flops["defaults"] == flops["defaults, free step"]


def test_the_free_step_row_is_the_defaults_schedule_with_a_slice_for_its_step():
    """Same token counts in every block as the defaults, other tokens, and the real merge
    back in place once the call returns."""
    models = gpu_cuda_graph.settings(small_vit(depth=6))
    x = images(models["unpruned"], batch=2)
    real, real_out = block_token_counts(models["defaults"], x)
    free = models["defaults, free step"]
    free_counts, free_out = block_token_counts(free.model, x, call=free)
    assert free_counts == real and real[-1] < real[0]
    assert not torch.allclose(free_out, real_out)
    assert torch.equal(block_token_counts(free.model, x)[1], real_out)  # the real step is back


def test_eager_forward_is_the_model_in_inference_mode():
    model = small_vit(depth=2)
    x = images(model, batch=2)
    with torch.inference_mode():
        expected = model(x)
    assert torch.equal(gpu_cuda_graph.eager(model)(x), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batch", [1, 3])
def test_a_replayed_graph_gives_the_eager_output_on_new_images(batch):
    model = vitprune.patch(small_vit().cuda(), keep_rate=0.7)
    x = images(model, batch=batch).cuda()
    replay = gpu_cuda_graph.graphed(model, x)
    fresh = torch.randn_like(x)
    torch.testing.assert_close(replay(fresh), gpu_cuda_graph.eager(model)(fresh))


def test_deterministic_restores_the_setting_it_found():
    assert not torch.are_deterministic_algorithms_enabled()
    with gpu_cuda_graph.deterministic():
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(KeyError), gpu_cuda_graph.deterministic():
        raise KeyError("an error inside the block")
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_under_deterministic_algorithms_a_bf16_replay_is_the_eager_forward_bit_for_bit():
    model = vitprune.patch(small_vit().cuda().to(torch.bfloat16), keep_rate=0.7)
    x = images(model, batch=16).cuda().to(torch.bfloat16)
    assert gpu_cuda_graph.replay_difference(model, x) == 0.0
