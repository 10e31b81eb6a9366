"""Rope models: every kept token carries its own rotary embedding through pruning."""

import inspect

import pytest
import timm
import torch
from timm.models.eva import Eva, EvaBlock

import vitprune
from vitprune.families.eva import follow_rope
from conftest import available


def test_follow_rope_gathers_rows_and_gives_the_fusion_token_no_rotation():
    rope = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)  # 4 patches, sin|cos of width 3
    positions = torch.tensor([[2, 0, -1], [3, 1, -1]])
    got = follow_rope(rope, positions)
    assert got.shape == (2, 1, 3, 6)
    torch.testing.assert_close(got[0, 0, :2], rope[[2, 0]])
    torch.testing.assert_close(got[1, 0, :2], rope[[3, 1]])
    torch.testing.assert_close(got[:, 0, 2], torch.tensor([[0.0, 0, 0, 1, 1, 1]] * 2))


def test_follow_rope_per_head_and_per_image_tables():
    per_head = torch.randn(3, 4, 6)  # (heads, N, E), as mixed rope hands each block
    positions = torch.tensor([[1, 3], [0, 2]])
    got = follow_rope(per_head, positions)
    assert got.shape == (2, 3, 2, 6)
    torch.testing.assert_close(got[1], per_head[:, [0, 2]])
    per_image = torch.randn(2, 1, 4, 6)  # (B, 1, N, E), after patch dropout
    got = follow_rope(per_image, positions)
    torch.testing.assert_close(got[0, 0], per_image[0, 0, [1, 3]])
    torch.testing.assert_close(got[1, 0], per_image[1, 0, [0, 2]])


@pytest.mark.parametrize("name, kwargs", [
    ("eva02_tiny_patch14_224", {}),
    ("vit_small_patch16_rope_mixed_224", {}),
    ("vit_base_patch16_sapiens2", {"num_kv_heads": (12, 6, 6, 12)}),  # block 2: 6 key/value heads for 12 queries
])
@pytest.mark.parametrize("grid", [None, (5, 7)], ids=["own size", "dynamic 5x7"])
def test_a_block_after_pruning_sees_each_kept_token_with_its_own_rope(name, kwargs, grid):
    torch.manual_seed(0)
    patch = 14 if "eva02" in name else 16
    model = available(name, img_size=4 * patch, depth=4, dynamic_img_size=grid is not None, **kwargs).eval()
    grid = grid or (4, 4)  # at 5x7, a table of rows and columns swapped fails on Eva02 and Sapiens2
    vitprune.patch(model, keep_rate=0.5, stages=(1,), fuse=False)
    seen = {}
    model.blocks[2].register_forward_hook(lambda m, args, kwargs, out: seen.update(x=args[0], out=out),
                                          with_kwargs=True)
    with torch.no_grad():
        model(torch.randn(2, 3, grid[0] * patch, grid[1] * patch))
        rope = model.rope.get_embed(shape=list(grid))  # cached or not (dynamic size)
        if getattr(model, "rope_mixed", False):  # per-head tables (timm >= 1.0.17)
            rope = rope[2]
        kept = vitprune.kept_positions(model)[0]
        for b in range(2):  # timm's own block on one image's kept tokens and their own rope rows
            rows = rope[..., kept[b], :]
            expected = EvaBlock.forward(model.blocks[2], seen["x"][b:b + 1], rope=rows)
            torch.testing.assert_close(seen["out"][b:b + 1], expected)
            shuffled = EvaBlock.forward(model.blocks[2], seen["x"][b:b + 1], rope=rope[..., :kept.shape[1], :])
            assert not torch.allclose(shuffled, expected)  # the test can tell a rope that did not follow


def test_eva_refuses_overlap_and_unpatch_restores_every_block():
    torch.manual_seed(0)
    model = timm.create_model("eva02_tiny_patch14_224", img_size=56, depth=4)
    with pytest.raises(TypeError, match="overlap_stride is supported for VisionTransformer models only"):
        vitprune.patch(model, overlap_stride=7)
    assert not vitprune.is_patched(model)
    vitprune.patch(model, keep_rate=0.5, stages=None)  # stages (1, 2, 3): blocks 1-3 swapped, block 0 not
    assert [type(b).__name__ for b in model.blocks] == ["EvaBlock"] + ["PruneEvaBlock"] * 3
    assert [b.vitprune_follow for b in model.blocks[1:]] == [None, 0, 1]
    vitprune.unpatch(model)
    assert all(type(b) is EvaBlock and "vitprune_follow" not in vars(b) for b in model.blocks)


def test_blocks_after_pruning_refuse_attention_masks():
    torch.manual_seed(0)
    model = vitprune.patch(timm.create_model("eva02_tiny_patch14_224", img_size=56, depth=4), keep_rate=0.5)
    if "is_causal" not in inspect.signature(Eva.forward_features).parameters:
        pytest.skip(f"timm {timm.__version__}'s Eva takes no masks")
    with pytest.raises(ValueError, match="cannot apply attn_mask or is_causal"):
        model.forward_features(torch.randn(1, 3, 56, 56), is_causal=True)
