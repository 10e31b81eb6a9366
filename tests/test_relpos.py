"""Relative-position-bias models: each kept token keeps its own bias to every other one."""

import contextlib
from unittest import mock

import pytest
import timm
import torch
from timm.models.beit import Block as BeitBlock
from timm.models.vision_transformer_relpos import RelPosBlock

import vitprune
from conftest import make_visible
from vitprune.families.relpos import follow_bias, full_bias, token_index


def test_follow_bias_gathers_rows_and_columns_and_zeroes_the_fusion_token():
    bias = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(1, 2, 4, 4)  # 1 prefix + 3 patches
    tokens = token_index(torch.tensor([[2, 0, -1]]), num_prefix=1, length=4)
    assert tokens.tolist() == [[0, 3, 1, 4]]
    got = follow_bias(bias, tokens)
    assert got.shape == (1, 2, 4, 4)
    torch.testing.assert_close(got[0, :, :3, :3], bias[0][:, [0, 3, 1]][:, :, [0, 3, 1]])
    assert (got[0, :, 3] == 0).all() and (got[0, :, :, 3] == 0).all()


CASES = {
    "beit": (lambda: timm.create_model("beit_base_patch16_224", img_size=64, depth=4), BeitBlock,
             lambda attn: "_get_rel_pos_bias", lambda attn: attn),
    "relpos, class token": (lambda: timm.create_model("vit_relpos_base_patch16_clsgap_224", img_size=64, depth=4),
                            RelPosBlock, lambda attn: "get_bias", lambda attn: attn.rel_pos),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("size_aware", [False, True])
def test_a_block_after_pruning_sees_each_kept_token_with_its_own_bias(case, fuse, size_aware):
    make, block_class, method, owner = CASES[case]
    torch.manual_seed(0)
    model = make().eval()
    for name, param in model.named_parameters():  # LayerScale starts at 1e-5: let attention show
        if name.endswith(("ls1.gamma", "ls2.gamma", "gamma_1", "gamma_2")):
            param.data.fill_(1.0)
    vitprune.patch(model, keep_rate=0.5, stages=(1,), fuse=fuse, size_aware=size_aware)
    P, heads = model.num_prefix_tokens, model.blocks[0].attn.num_heads
    L = P + model.patch_embed.num_patches
    full = 3 * torch.randn(heads, L, L, generator=torch.Generator().manual_seed(2))  # a bias that matters
    seen = {}
    model.blocks[2].register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    with contextlib.ExitStack() as stack, torch.no_grad():
        for block in model.blocks:
            stack.enter_context(mock.patch.object(owner(block.attn), method(block.attn), lambda *a: full[None]))
        model(torch.randn(2, 3, 64, 64))
        for b, kept in enumerate(vitprune.kept_positions(model)[0]):
            real = [p for p in kept.tolist() if p >= 0]
            t = list(range(P)) + [P + p for p in real]
            sub = torch.zeros(heads, len(kept) + P, len(kept) + P)
            sub[:, :len(t), :len(t)] = full[:, t][:, :, t]  # a fusion token: zero bias
            if size_aware:  # plus log(size) on every key column (prefix tokens hold one patch)
                sizes = model.vitprune_state.sizes[b]
                sub = sub + torch.cat([torch.zeros(P), sizes.log()])
            attn = model.blocks[2].attn
            with mock.patch.object(owner(attn), method(attn), lambda *a: sub[None]):
                expected = block_class.forward(model.blocks[2], seen["x"][b:b + 1])
            torch.testing.assert_close(seen["out"][b:b + 1], expected)


def test_beit_with_its_own_and_the_shared_table_adds_both():
    """A BEiT built with both tables (``use_rel_pos_bias`` and ``use_shared_rel_pos_bias``)
    adds each block's own table to the shared one, as timm does: the sum over the full grid,
    and at keep 1.0 the unpatched model's output. The tables start at zero in timm, so they
    are filled here: a zero table would hide either one being left out."""
    torch.manual_seed(0)
    model = make_visible(timm.create_model("beit_base_patch16_224", img_size=64, depth=4, use_rel_pos_bias=True,
                                           use_shared_rel_pos_bias=True).eval(), ("relative_position_bias_table",))
    attn, shared = model.blocks[1].attn, model.rel_pos_bias()
    own = attn._get_rel_pos_bias()
    assert shared.dim() == 3 and own.dim() == 4 and (own != 0).any() and (shared != 0).any()
    torch.testing.assert_close(full_bias(attn, shared), own + shared[None], rtol=0, atol=0)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        vitprune.patch(model, keep_rate=1.0)
        got = model(x)
    torch.testing.assert_close(got, expected)
