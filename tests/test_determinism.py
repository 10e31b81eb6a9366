"""Every reduction runs under ``torch.use_deterministic_algorithms`` (forward and a training
backward) and repeats bit for bit there: the way to reproducible outputs on CUDA, where the
merge's ``index_add_`` otherwise adds atomically in no fixed order (examples/gpu_checks.py
measures that spread on a GPU). On CPU, and on CUDA where one is present."""

import sys
from pathlib import Path

import pytest
import timm
import torch

import vitprune
from test_device_only import OPTIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpu_cuda_graph  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def deterministic():
    with gpu_cuda_graph.deterministic():
        yield


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_every_reduction_repeats_bit_for_bit_under_deterministic_algorithms(options, device, deterministic):
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4).to(device)
    vitprune.patch(model, **{"keep_rate": 0.7, **options})
    x = torch.randn(3, 3, 64, 64, device=device)
    outputs = []
    for _ in range(2):
        torch.manual_seed(1)  # the random indicator draws from torch's generator
        model.zero_grad()
        model.train()
        model(x).square().mean().backward()
        model.eval()
        with torch.no_grad():
            outputs.append((model(x), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (first, first_grads), (second, second_grads) = outputs
    assert torch.equal(first, second)
    assert len(first_grads) == len(second_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(first_grads, second_grads))


def test_the_checks_time_the_deterministic_mode_and_leave_it_as_they_found_it():
    import gpu_checks

    model = vitprune.patch(timm.create_model("deit_tiny_patch16_224", img_size=64, depth=2).eval(), keep_rate=0.7)
    ratio = gpu_checks.deterministic_cost(model, torch.randn(2, 3, 64, 64), rounds=1)
    assert 0 < ratio < float("inf")
    assert not torch.are_deterministic_algorithms_enabled()
