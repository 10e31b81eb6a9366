"""The family registry: a family is one record, registered by its own module."""

import copy

import pytest
import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer

import vitprune
from conftest import assert_same, snapshot
from vitprune.core import registry
from vitprune.families.pooling import PrunedModel
from vitprune.families.vit import PruneBlock


class MyViT(VisionTransformer):
    """A model class vitprune has never heard of."""


class PruneMyViT(PrunedModel, MyViT):
    pass


@pytest.fixture
def clean_registry(monkeypatch):
    for name in ("_FAMILIES", "_PATCHED", "_PRUNING_BLOCKS"):
        monkeypatch.setattr(registry, name, dict(getattr(registry, name)))


def test_a_new_family_is_one_registration(clean_registry):
    torch.manual_seed(0)
    model = MyViT(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2, num_classes=3).eval()
    with pytest.raises(TypeError, match="cannot patch a .*MyViT"):
        vitprune.patch(model)
    registry.register(registry.Family(model=MyViT, patched=PruneMyViT, blocks={Block: PruneBlock},
                                      attention=(Attention,), examples="my_vit_*"))
    x = torch.randn(2, 3, 32, 32)
    before = snapshot(model)
    with torch.no_grad():
        expected = model(x)
        vitprune.patch(model, keep_rate=1.0)
        assert type(model) is PruneMyViT and torch.equal(model(x), expected)
        vitprune.patch(model, keep_rate=0.5)
        assert model(x).shape == expected.shape and len(vitprune.kept_positions(model)) == 4
    vitprune.unpatch(model)
    assert type(model) is MyViT
    assert_same(before, snapshot(model))
    assert MyViT in vitprune.supported_models()


class Patchify(torch.nn.Module):
    """A patch embedding's projection that is not a ``Conv2d`` (the same convolution, by hand)."""

    def __init__(self, conv):
        super().__init__()
        self.weight, self.bias, self.stride = conv.weight, conv.bias, conv.stride

    def forward(self, x):
        return torch.nn.functional.conv2d(x, self.weight, self.bias, self.stride)


def test_without_a_patch_convolution_the_schedule_counts_the_embeddings_own_patches():
    """No convolution to follow: the spread schedule is worked out from the patch
    embedding's ``num_patches``, the same as for the model with its ``Conv2d``."""
    torch.manual_seed(0)
    plain = VisionTransformer(img_size=64, patch_size=16, embed_dim=32, depth=6, num_heads=2).eval()
    custom = copy.deepcopy(plain)
    custom.patch_embed.proj = Patchify(custom.patch_embed.proj)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(custom(x), plain(x))
        for model in (plain, custom):
            vitprune.patch(model, keep_rate=0.4)
        assert torch.equal(custom(x), plain(x))
    assert vitprune.get_config(custom) == vitprune.get_config(plain)


def test_unsupported_messages_come_from_the_registry():
    with pytest.raises(TypeError) as refused:
        vitprune.patch(torch.nn.Linear(2, 2))
    message = str(refused.value)
    for family in registry.families():
        assert family.model.__name__ in message and family.examples in message
