"""A patched forward computes on its input's device alone: it reads nothing back to the host
and brings no host data in (beyond what the unpatched model does).

On a GPU that is what keeps the host from waiting on the device in every reduction step and
what lets a forward be captured as a CUDA graph (docs/speed.md, "On a GPU"). Checked without
a GPU on the ``meta`` device, where every tensor has a shape and no data: a read of a value
(``.item()``, ``nonzero``, a boolean mask) cannot run there, and a tensor made on the CPU shows
up as a CPU argument of some operator, which :class:`HostWatch` counts.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import vitprune
from conftest import FAMILIES, HF_SIZES, PAPER, available, require_transformers

#: Operators that read a device tensor's values on the host (each waits for the device); a
#: ``repeat_interleave`` by one count (``self_int``) is an expand and reads nothing.
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal", "unique",
              "_unique2", "repeat_interleave"}


def reads_values(func: torch._ops.OpOverload) -> bool:
    return func.overloadpacket.__name__ in HOST_READS and func._overloadname != "self_int"


class HostWatch(TorchDispatchMode):
    """Counts, by operator, the calls that read values on the host (``read:NAME``) and the
    calls given a CPU tensor while the model runs elsewhere (``host:NAME``)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: "collections.Counter[str]" = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if reads_values(func):
            self.found[f"read:{name}"] += 1
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in tree_leaves((args, kwargs))):
            self.found[f"host:{name}"] += 1
        return func(*args, **(kwargs or {}))


def host_traffic(run: Callable[[], Any]) -> "collections.Counter[str]":
    with HostWatch() as watch:
        run()
    return watch.found


def on_meta(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model ``make`` builds, moved to the ``meta`` device (built on the CPU: older timm
    releases read values while they build)."""
    return make().to("meta").eval()


def meta_images(model: torch.nn.Module, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, *model.patch_embed.img_size, device="meta")


def inference(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    def run() -> Any:
        with torch.inference_mode():
            return model(x)
    return run


def assert_no_more_traffic(model: torch.nn.Module, x: torch.Tensor, **options: Any) -> None:
    """Patched with ``options`` (keep 0.7 unless they say), the forward brings no host traffic
    the unpatched model's does not (timm's own rope tables, for one, are built on the host)."""
    unpatched = host_traffic(inference(model, x))
    vitprune.patch(model, **{"keep_rate": 0.7, **options})
    try:
        patched = host_traffic(inference(model, x))
    finally:
        vitprune.unpatch(model)
    assert patched - unpatched == collections.Counter(), (patched, unpatched)


def test_the_watch_sees_a_host_read_and_host_data():
    class Leaky(torch.nn.Module):
        def forward(self, x):
            keep = torch.arange(x.shape[1] - 1)  # made on the CPU, then moved: host data
            x = x.index_select(1, keep.to(x.device))
            return x[:, : int(x.sum() > 0) + 1]  # a value read back: on meta it cannot run

    x = torch.randn(2, 5, device="meta")
    with pytest.raises(Exception), HostWatch() as watch:
        Leaky()(x)
    kinds = collections.Counter(key.split(":")[0] for key in watch.found.elements())
    assert kinds == {"host": 1, "read": 1}, watch.found


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("options", [{}, PAPER], ids=["defaults", "paper"])
def test_every_family_reduces_on_the_device_alone(name, options):
    model_name, arguments = FAMILIES[name]
    model = on_meta(lambda: available(model_name, **arguments))
    assert_no_more_traffic(model, meta_images(model), **options)


OPTIONS: Dict[str, Dict[str, Any]] = {
    "defaults": {},
    "merge rounds (keep 0.3 in one block)": dict(keep_rate=0.3, stages=(2,)),
    "redundant selection": dict(indicator="medad", selection="redundant"),
    "top selection, merge": dict(indicator="cls", selection="top", reduction="merge"),
    "drop": dict(reduction="drop"),
    "crowding": dict(crowding=1.0),
    "no class-token saving": dict(class_only_last=False),
    "overlapping patches": dict(overlap_stride=8),
    "random, torch's generator": dict(indicator="random", selection="top", reduction="fuse"),
}


@pytest.mark.parametrize("batch", [1, 2])  # one image takes a path of its own (merging.bipartite_merge)
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_every_reduction_runs_on_the_device_alone(options, batch):
    model = on_meta(lambda: timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4))
    assert_no_more_traffic(model, meta_images(model, batch), **options)


def test_a_seeded_random_indicator_draws_on_the_host():
    """The one documented exception: ``seed`` makes a CPU generator, so that a seed picks the
    same tokens on every device; its scores are drawn there and copied over at every stage."""
    model = on_meta(lambda: timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4))
    vitprune.patch(model, indicator="random", selection="top", reduction="fuse", keep_rate=0.7, seed=0)
    found = host_traffic(inference(model, meta_images(model)))
    assert all(key.startswith("host:") for key in found), found
    assert sum(found.values()) == len(vitprune.get_config(model).stages)  # one copy a stage


def test_training_forward_and_backward_stay_on_the_device():
    model = on_meta(lambda: timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4)).train()
    vitprune.patch(model, keep_rate=0.7)
    x = meta_images(model)
    found = host_traffic(lambda: model(x).sum().backward())
    assert found == collections.Counter() and model.head.weight.grad is not None


def test_forward_intermediates_stay_on_the_device():
    model = on_meta(lambda: timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4))
    vitprune.patch(model, keep_rate=0.7)
    x = meta_images(model)

    def run() -> Any:
        with torch.inference_mode():
            return model.forward_intermediates(x, output_fmt="NCHW")

    assert host_traffic(run) == collections.Counter()


#: ``transformers`` families, by config and model class names (4 layers of width 32).
HF_FAMILIES = {"ViT": ("ViTConfig", "ViTForImageClassification"), "DINOv2": ("Dinov2Config", "Dinov2Model"),
               "CLIP": ("CLIPVisionConfig", "CLIPVisionModel"), "SigLIP": ("SiglipVisionConfig", "SiglipVisionModel")}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_transformers_models_reduce_on_the_device_alone(family, attention):
    transformers = require_transformers()
    config_name, model_name = HF_FAMILIES[family]
    config = getattr(transformers, config_name)(**HF_SIZES)
    config._attn_implementation = attention
    model = on_meta(lambda: getattr(transformers, model_name)(config))
    assert_no_more_traffic(model, torch.randn(2, 3, 32, 32, device="meta"))
