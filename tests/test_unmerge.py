"""unmerge: a reduced forward's tokens spread back over every original patch."""

import pytest
import timm
import torch

import vitprune
from conftest import HF_SIZES, images, paper, small_vit

#: The defaults (bipartite merge, every block), bipartite in rounds, the paper's fusion token
#: and dropping at its three stages.
CONFIGS = [{}, dict(keep_rate=0.3, stages=(2, 5)), paper(), paper(reduction="drop")]
PATCHES = 16  # small_vit: 64x64 images, 16x16 patches


def features(options, batch=3, **model_options):
    model = vitprune.patch(small_vit(**model_options), **{"keep_rate": 0.6, **options})
    x = images(model, batch)
    with torch.no_grad():
        return model, model.forward_features(x)


@pytest.mark.parametrize("options", CONFIGS, ids=str)
def test_every_patch_gets_the_features_of_the_token_that_holds_it(options):
    model, tokens = features(options)
    spread = vitprune.unmerge(model, tokens)
    group = vitprune.token_groups(model)[-1]
    assert spread.shape == (3, 1 + PATCHES, tokens.shape[-1])
    assert torch.equal(spread[:, 0], tokens[:, 0])  # the class token passes through
    for b in range(3):
        for patch in range(PATCHES):
            held = int(group[b, patch])
            expected = torch.zeros_like(tokens[b, 1]) if held < 0 else tokens[b, 1 + held]
            assert torch.equal(spread[b, 1 + patch], expected)
    if options.get("reduction") == "drop":
        assert (group < 0).any()  # some patches were dropped, and they read zero
        assert ((spread[:, 1:].abs().sum(dim=-1) == 0) == (group < 0)).all()


@pytest.mark.parametrize("options", CONFIGS[:3], ids=str)
def test_the_mean_over_patches_is_the_size_weighted_mean_of_the_tokens(options):
    model, tokens = features(options)
    sizes = model.vitprune_state.sizes
    spread = vitprune.unmerge(model, tokens)
    weighted = (tokens[:, 1:] * sizes.unsqueeze(-1)).sum(dim=1) / sizes.sum(dim=1, keepdim=True)
    torch.testing.assert_close(spread[:, 1:].mean(dim=1), weighted, rtol=1e-5, atol=1e-6)


def test_a_gradient_reaches_each_token_once_per_patch_it_holds():
    model = vitprune.patch(small_vit(), keep_rate=0.6)
    with torch.no_grad():
        tokens = model.forward_features(images(model)).requires_grad_()
    vitprune.unmerge(model, tokens).sum().backward()
    sizes = model.vitprune_state.sizes
    assert torch.equal(tokens.grad[:, 0], torch.ones_like(tokens.grad[:, 0]))
    assert torch.equal(tokens.grad[:, 1:], sizes.unsqueeze(-1).expand_as(tokens.grad[:, 1:]))


def test_nothing_reduced_gives_the_unpatched_features_back():
    reference = small_vit()
    x = images(reference)
    with torch.no_grad():
        expected = reference.forward_features(x)
        model = vitprune.patch(small_vit(), keep_rate=1.0, class_only_last=False)
        spread = vitprune.unmerge(model, model.forward_features(x))
    torch.testing.assert_close(spread, expected, rtol=1e-5, atol=1e-6)


def test_intermediates_unmerge_by_the_block_they_came_from():
    model = vitprune.patch(small_vit(), keep_rate=0.5, **paper())  # stages (3, 6, 9)
    x = images(model)
    with torch.no_grad():
        taken = model.forward_intermediates(x, indices=[1, 4, 11], output_fmt="NLC", intermediates_only=True)
    groups = vitprune.token_groups(model)
    before, after_first, last = taken
    assert vitprune.unmerge(model, before, block=1) is before  # no reduction yet: as it is
    spread = vitprune.unmerge(model, after_first, block=4)  # patch tokens only, as timm returns them
    assert spread.shape == (3, PATCHES, before.shape[-1])
    held = groups[0].clamp_min(0).unsqueeze(-1).expand_as(spread)
    assert torch.equal(spread, after_first.gather(1, held))
    assert torch.equal(vitprune.unmerge(model, last, block=-1), vitprune.unmerge(model, last, block=11))
    with pytest.raises(ValueError, match=r"left 3 images of \d+ patch tokens .* after block 7"):
        vitprune.unmerge(model, after_first, block=7)


@pytest.mark.parametrize("call, error, match", [
    (lambda m, t: vitprune.unmerge(m, t, block=12), ValueError, r"block must be in \[-12, 11\]"),
    (lambda m, t: vitprune.unmerge(m, t, block=True), TypeError, "block must be an int or None, got bool"),
    (lambda m, t: vitprune.unmerge(m, t[0]), TypeError, r"tokens must be a \(B, tokens, channels\) tensor"),
    (lambda m, t: vitprune.unmerge(m, t[:2]), ValueError, "the last forward left 3 images"),
    (lambda m, t: vitprune.unmerge(m, t[:, :-2]), ValueError, "patch tokens"),  # -1: the patches alone
    (lambda m, t: vitprune.unmerge(small_vit(), t), ValueError, "not patched by vitprune"),
], ids=["block out of range", "bool block", "2-D tokens", "another batch", "another token count", "unpatched"])
def test_what_does_not_fit_the_last_forward_is_refused(call, error, match):
    model, tokens = features({})
    with pytest.raises(error, match=match):
        call(model, tokens)


def test_only_the_prefix_and_patches_or_the_patches_alone_are_taken():
    """With four register tokens beside the class token (5 prefix tokens) every token count
    but ``left`` and ``5 + left`` is refused, the counts next to them included."""
    model, tokens = features({}, reg_tokens=4)
    left = vitprune.token_groups(model)[-1].amax().item() + 1
    assert tokens.shape[1] == 5 + left
    for count in range(left - 2, left + 8):
        cut = torch.cat([tokens, tokens[:, -2:]], dim=1)[:, -count:]
        if count in (left, 5 + left):
            assert vitprune.unmerge(model, cut).shape[1] == count - left + PATCHES
        else:
            with pytest.raises(ValueError, match="patch tokens"):
                vitprune.unmerge(model, cut)


def test_the_first_block_counts_from_the_end_as_minus_the_depth():
    model = vitprune.patch(small_vit(), keep_rate=0.5, **paper())
    x = images(model)
    with torch.no_grad():
        first, = model.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True)
    assert vitprune.unmerge(model, first, block=-12) is first
    with pytest.raises(ValueError, match=r"block must be in \[-12, 11\] .*, got -13"):
        vitprune.unmerge(model, first, block=-13)


def test_a_patch_without_stages_gives_the_tokens_back():
    model, tokens = features(dict(stages=()))
    assert vitprune.unmerge(model, tokens) is tokens


def test_before_any_forward_it_says_to_run_one():
    model = vitprune.patch(small_vit(), keep_rate=0.6)
    with pytest.raises(ValueError, match="no forward has run on this thread"):
        vitprune.unmerge(model, torch.zeros(1, 5, 192))


def test_a_transformers_backbone_unmerges_its_last_hidden_state():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ViTModel(transformers.ViTConfig(**HF_SIZES)).eval()
    vitprune.patch(model, keep_rate=0.5)
    with torch.no_grad():
        hidden = model(torch.randn(2, 3, 32, 32)).last_hidden_state
    spread = vitprune.unmerge(model, hidden)
    group = vitprune.token_groups(model)[-1]
    assert spread.shape == (2, 1 + (32 // 8) ** 2, hidden.shape[-1])
    assert torch.equal(spread[:, 1:], hidden[:, 1:].gather(1, group.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])))


def test_overlapping_patches_unmerge_onto_the_finer_grid():
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4).eval()
    vitprune.patch(model, keep_rate=0.6, overlap_stride=12)
    with torch.no_grad():
        tokens = model.forward_features(torch.randn(2, 3, 64, 64))
    assert vitprune.unmerge(model, tokens).shape[1] == 1 + 5 * 5  # (64 - 16) // 12 + 1 = 5 per side
