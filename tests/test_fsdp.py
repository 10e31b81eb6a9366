"""PyTorch's ``fully_shard`` (FSDP2) gives every module it shards a class of its own, a
subclass of the module's class (``FSDP<class>``). A model patched and then sharded runs and
trains as the same patch unsharded; ``unpatch`` and ``patch`` after sharding are refused
with a message naming the order, and change nothing (one process, gloo)."""

import contextlib
import copy

import pytest
import timm
import torch
import torch.distributed as dist

import vitprune
from conftest import assert_same, snapshot, trained_logits

fully_shard = getattr(getattr(dist, "fsdp", None), "fully_shard", None)
if not dist.is_available() or fully_shard is None:  # public from torch 2.6
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def build():
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, embed_dim=48,
                             num_heads=3, num_classes=4)


def shard(model, inner=(), whole=True):
    """Shard the blocks, first each block's modules named in ``inner``, and then the model
    unless ``whole`` is false."""
    for block in model.blocks:
        for name in inner:
            fully_shard(block.get_submodule(name))
        fully_shard(block)
    if whole:
        fully_shard(model)
    return model


def last_block_rows(model, x):
    """Rows the last block returns in a forward (a global hook: a hook on the block itself
    would be the model's own business)."""
    rows = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: rows.append(out.shape[1]) if module is model.blocks[-1] else None)
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return rows


#: torch's own warning wherever a sharded Linear or attention returns a view (timm's too, unpatched).
TORCH_VIEW_WARNING = "ignore:FSDP2-wrapped module .* returned a view tensor"


@pytest.mark.filterwarnings(TORCH_VIEW_WARNING)
@pytest.mark.parametrize("inner", [(), ("attn.qkv",)], ids=["blocks", "blocks and qkv"])
def test_a_model_patched_then_sharded_runs_and_trains_as_the_same_patch_unsharded(inner):
    """With ``qkv`` sharded too, the class-only last block must call it (its hooks gather the
    weight), not slice its weight."""
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2])
    expected = trained_logits(vitprune.patch(build(), keep_rate=0.6), x, labels)
    model = shard(vitprune.patch(build(), keep_rate=0.6), inner)
    assert vitprune.is_patched(model) and vitprune.get_config(model).class_only_last
    # trained before any other call: the optimizer must hold the sharded parameters
    torch.testing.assert_close(trained_logits(model, x, labels), expected, rtol=1e-5, atol=1e-6)
    assert last_block_rows(model, x) == [1]  # the class token alone, as unsharded


@pytest.mark.filterwarnings(TORCH_VIEW_WARNING)
def test_an_attention_module_sharded_after_patch_is_named_at_the_first_call():
    """A swapped block runs its attention's layers itself, so ``fully_shard``'s hooks on the
    attention module would not gather its parameters: the first call names it."""
    model = shard(vitprune.patch(build(), keep_rate=0.6, stages=(1,)), ("attn",))
    with pytest.warns(UserWarning, match=r"hooks were registered on blocks\.1\.attn after patch"):
        with contextlib.suppress(RuntimeError):  # the parameters stay sharded: torch refuses them
            model(torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("sharded", ["model and blocks", "blocks"])
def test_unpatch_after_sharding_is_refused_and_changes_nothing(sharded):
    # with the blocks alone, the model keeps its patched class: the blocks must be seen
    model = shard(vitprune.patch(build(), keep_rate=0.6), whole=sharded == "model and blocks")
    before = snapshot(model)
    with pytest.raises(TypeError, match="before fully_shard"):
        vitprune.unpatch(model)
    assert_same(before, snapshot(model))
    assert vitprune.is_patched(model)


@pytest.mark.parametrize("sharded", ["model and blocks", "blocks"])
def test_patch_after_sharding_is_refused_and_changes_nothing(sharded):
    model = shard(build(), whole=sharded == "model and blocks")
    before = snapshot(model)
    with pytest.raises(TypeError, match="call vitprune.patch .* before fully_shard"):
        vitprune.patch(model, keep_rate=0.6)
    assert_same(before, snapshot(model))
    assert not vitprune.is_patched(model)


def test_a_patched_model_sharded_again_is_refused_a_new_patch():
    model = shard(vitprune.patch(build(), keep_rate=0.6))
    config = copy.deepcopy(vitprune.get_config(model))
    with pytest.raises(TypeError, match="call vitprune.patch .* before fully_shard"):
        vitprune.patch(model, keep_rate=0.3)
    assert vitprune.get_config(model) == config
