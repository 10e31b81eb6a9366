"""Every bad call raises a clear error before the model is touched."""

import pytest
import timm
import torch
from timm.models import vision_transformer
from timm.models.vision_transformer_sam import VisionTransformerSAM
from torch import nn

import vitprune
from conftest import assert_same, snapshot

BAD_OPTIONS = [
    ({"indicator": "entropy"}, ValueError, "accepted: 'var', 'medad', 'cls', 'random'"),
    ({"keep_rate": 0.0}, ValueError, r"\(0, 1\]"),
    ({"keep_rate": 1.2}, ValueError, r"\(0, 1\]"),
    ({"stages": (3, 12)}, ValueError, "out of range: the model has 12 blocks"),
    ({"stages": (3, 3)}, ValueError, "repeat"),
    ({"keep_rate": (0.7, 0.5), "stages": (3, 6, 9)}, ValueError, "one keep_rate per stage"),
    ({"keep_rate": (0.7, 0.5)}, ValueError, "pass stages explicitly"),
    ({"T": 0}, ValueError, "T must be > 0"),
    ({"T": 0.5}, ValueError, "T is the fusion token's temperature: it only applies to reduction='fuse'"),
    ({"T": 0.5, "indicator": "var", "reduction": "drop"}, ValueError, "only applies to reduction='fuse'.*not 'drop'"),
    ({"indicator": "var", "selection": "bipartite"}, ValueError,
     "indicator='var' plays no part with selection='bipartite' and reduction='merge'"),
    ({"keep": 0.7}, TypeError, "unknown option.*accepted: indicator, keep_rate"),
    ({"generator": torch.Generator()}, ValueError, "generator only applies"),
    ({"generator": 3, "indicator": "random"}, TypeError, "torch.Generator"),
    ({"seed": 1, "indicator": "random", "generator": torch.Generator()}, ValueError, "not both"),
]


@pytest.mark.parametrize("options, error, match", BAD_OPTIONS)
def test_bad_options_raise_and_leave_the_model_untouched(tiny, options, error, match):
    before = snapshot(tiny)
    with pytest.raises(error, match=match):
        vitprune.patch(tiny, **options)
    assert_same(before, snapshot(tiny))
    assert not vitprune.is_patched(tiny)


@pytest.mark.parametrize("options, error, match", BAD_OPTIONS[:4])
def test_a_failed_repatch_keeps_the_previous_patch(tiny, options, error, match):
    vitprune.patch(tiny, indicator="medad", keep_rate=0.5, stages=(2,))
    config, before = vitprune.get_config(tiny), snapshot(tiny)
    with pytest.raises(error, match=match):
        vitprune.patch(tiny, **options)
    assert vitprune.get_config(tiny) == config
    assert_same(before, snapshot(tiny))


def newer_block(name):
    """A timm block class that older timm versions lack (the test skips there)."""
    block = getattr(vision_transformer, name, None)
    if block is None:
        pytest.skip(f"timm {timm.__version__} has no {name}")
    return block


def map_pool_with_position_embedding():
    """A map-pooled ViT whose attention pool adds a position embedding to a full grid."""
    from timm.layers import AttentionPoolLatent

    model = timm.create_model("deit_tiny_patch16_224", img_size=64, global_pool="map", class_token=False)
    model.attn_pool = AttentionPoolLatent(model.embed_dim, num_heads=3, pos_embed="abs",
                                          feat_size=model.patch_embed.num_patches)
    return model


class TalkingAttention(vision_transformer.Attention):
    """A subclass of timm's ``Attention`` with a forward of its own, which vitprune would not run."""

    def forward(self, x, *args, **kwargs):
        return 2 * super().forward(x, *args, **kwargs)


def with_a_subclassed_attention():
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=2)
    model.blocks[1].attn.__class__ = TalkingAttention
    return model


@pytest.mark.parametrize("make, match", [
    (lambda: nn.Linear(3, 3), "supported: timm VisionTransformer"),
    (with_a_subclassed_attention, r"block 1 uses attention TalkingAttention \(attn\); .* with timm's Attention"),
    (map_pool_with_position_embedding, "AttentionPoolLatent without a position embedding .*: its input must stay"),
    (lambda: timm.create_model("resnet10t"), "cannot patch a .*ResNet"),
    (lambda: "deit_small_patch16_224", "torch.nn.Module"),
    (lambda: timm.create_model("deit_tiny_patch16_224", global_pool="prr"), "got .prr.: this pooling"),
    (lambda: timm.create_model("deit_tiny_patch16_224", depth=0, img_size=32), "no transformer blocks .depth 0."),
    (lambda: timm.create_model("eva02_tiny_patch14_224", depth=0, img_size=28), "this Eva has no transformer blocks"),
    (lambda: timm.create_model("deit_tiny_patch16_224", block_fn=newer_block("DiffParallelScalingBlock")),
     "block 0 is a DiffParallelScalingBlock; vitprune can prune in: Block, ResPostBlock"),
    (lambda: timm.create_model("deit_tiny_patch16_224", attn_layer="diff"), "attention DiffAttention"),
    (lambda: timm.create_model("naflexvit_base_patch16_gap", depth=2), "NaFlexVit: it packs"),
    (lambda: timm.create_model("hiera_tiny_224"), "Hiera: it is hierarchical"),
    (lambda: timm.create_model("xcit_nano_12_p16_224"), "Xcit: its cross-covariance attention"),
    (lambda: timm.create_model("cait_xxs24_224", depth=2), "Cait: its talking-heads attention mixes the heads"),
    (lambda: VisionTransformerSAM(img_size=64, embed_dim=32, depth=2, num_heads=2, window_size=2,
                                  global_attn_indexes=(1,)), "VisionTransformerSAM: its windowed"),
])
def test_unsupported_models_raise_type_error_and_stay_untouched(make, match):
    try:
        model = make()
    except (RuntimeError, TypeError, AssertionError) as error:  # a model or option this timm version lacks
        pytest.skip(f"timm {timm.__version__}: {error}")
    before = snapshot(model) if isinstance(model, nn.Module) else None
    with pytest.raises(TypeError, match=match):
        vitprune.patch(model, keep_rate=0.7)
    if before is not None:
        assert_same(before, snapshot(model))


def test_bad_config_object_is_refused(tiny):
    with pytest.raises(TypeError, match="vitprune.PruneConfig"):
        vitprune.patch(tiny, {"keep_rate": 0.7})
