"""Edge cases a hostile user found (issue 13): each works like the unpatched model, or is
refused with an error that names the problem, before the model changes."""

import math

import pytest
import timm
import torch
from torch import nn

import vitprune
from conftest import FAMILIES, assert_same, build, images, paper, small_vit, snapshot
from vitprune.commands.cli import main
from vitprune.core.state import DYNAMO_TRACES_RECORDS
from vitprune.core.tokens import fusion_weights


def tiny(**kwargs):
    return small_vit(depth=4, **kwargs)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_batch_of_zero_images_behaves_as_in_the_unpatched_model(name):
    """An empty output where timm gives one; where timm's own attention cannot reshape an
    empty batch (Eva, BEiT on timm 1.0.x) the same error, or an empty output when only
    vitprune's attention ran."""
    model = build(name)
    empty = images(model, batch=0)
    with torch.no_grad():
        try:
            expected = model(empty)
        except RuntimeError:
            expected = None
        for options in ({}, paper(indicator="var", stages=(1,))):
            vitprune.patch(model, keep_rate=0.5, **options)
            if expected is None:
                try:
                    assert model(empty).shape[0] == 0
                except RuntimeError as error:
                    assert "cannot reshape tensor of 0 elements" in str(error)
            else:
                assert model(empty).shape == expected.shape and expected.shape[0] == 0


def test_visualize_refuses_a_batch_of_zero_images():
    model = vitprune.patch(tiny(), keep_rate=0.5)
    with pytest.raises(ValueError, match="a batch of 0"):
        vitprune.visualize(model, torch.zeros(0, 3, 64, 64))


@pytest.mark.parametrize("cast", ["half", "double"])
def test_unpatch_after_a_cast_restores_the_position_embedding_in_the_current_dtype(cast):
    model = tiny()
    original = model.pos_embed.detach().clone()
    vitprune.patch(model, keep_rate=0.7, overlap_stride=8)
    getattr(model, cast)()
    vitprune.unpatch(model)
    dtype = model.patch_embed.proj.weight.dtype
    assert model.pos_embed.dtype == dtype
    assert torch.equal(model.pos_embed.detach(), original.to(dtype))
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64, dtype=dtype))  # no mixed-dtype error


@pytest.mark.parametrize("dynamic", [False, True])
def test_forward_intermediates_with_overlap_returns_maps_of_the_overlapped_grid(dynamic):
    model = tiny(dynamic_img_size=dynamic)
    vitprune.patch(model, keep_rate=0.7, overlap_stride=8, **paper(indicator="var", stages=(2,)))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        _, maps = model.forward_intermediates(x, indices=[0, 1], output_fmt="NCHW")
        _, tokens = model.forward_intermediates(x, indices=[0, 1], output_fmt="NLC")
    side = (64 - 16) // 8 + 1
    for grid, flat in zip(maps, tokens):
        assert grid.shape == (2, 192, side, side)
        assert torch.equal(grid, flat.reshape(2, side, side, 192).permute(0, 3, 1, 2))


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_intermediates_gives_maps_after_pruning_on_every_family(name):
    """timm's default NCHW: the reduced blocks' tokens spread back over the patch grid, as
    ``unmerge`` spreads the NLC tokens of the same blocks; blocks before the first reduction
    as timm gives them."""
    model = build(name)
    x = images(model, batch=2)
    with torch.no_grad():
        expected = model.forward_intermediates(x, indices=[0, 3], intermediates_only=True)
        vitprune.patch(model, keep_rate=0.5, stages=(2,))  # merging at block 2
        maps = model.forward_intermediates(x, indices=[0, 3], intermediates_only=True)
        tokens = model.forward_intermediates(x, indices=[0, 3], output_fmt="NLC", intermediates_only=True)
    assert maps[0].shape == expected[0].shape == maps[1].shape
    torch.testing.assert_close(maps[0], expected[0])  # before the reduction: the unpatched map
    assert tokens[0].shape[1] == maps[0].shape[2] * maps[0].shape[3] > tokens[1].shape[1]  # block 3's: fewer
    for block, grid, flat in zip([0, 3], maps, tokens):
        spread = vitprune.unmerge(model, flat, block)
        assert torch.equal(grid, spread.reshape(2, *grid.shape[2:], -1).permute(0, 3, 1, 2))


def test_forward_intermediates_spreads_the_map_of_the_first_reducing_block_itself():
    """A reducing block's output already has fewer tokens than the grid, so the NCHW map of
    the first one, taken as the last index, is spread back over the grid too."""
    model = vitprune.patch(build("gap, no class token"), keep_rate=0.5, stages=(2,))
    x = images(model, batch=2)
    with torch.no_grad():
        maps = model.forward_intermediates(x, indices=[2], intermediates_only=True)
        tokens = model.forward_intermediates(x, indices=[2], output_fmt="NLC", intermediates_only=True)
    assert maps[0].shape[2] * maps[0].shape[3] == model.patch_embed.num_patches > tokens[0].shape[1]
    spread = vitprune.unmerge(model, tokens[0], 2)
    assert torch.equal(maps[0], spread.reshape(2, *maps[0].shape[2:], -1).permute(0, 3, 1, 2))


POOLED = ["gap, no class token", "Eva02 (rope, SwiGLU, avg pool)", "BEiT (relative position bias)",
          "siglip map (attention pool)", "relpos, no class token"]


@pytest.mark.parametrize("name", POOLED)
def test_forward_head_pools_with_the_sizes_of_the_features_it_is_given(name):
    model = vitprune.patch(build(name), keep_rate=0.5)
    a, b = images(model, seed=1), images(model, seed=2)
    with torch.no_grad():
        expected = model(a)
        features_a = model.forward_features(a)
        model.forward_features(b)  # another forward in between
        got = model.forward_head(features_a)
        final, _ = model.forward_intermediates(a, indices=1, output_fmt="NLC")
        model.forward_features(b)
        from_intermediates = model.forward_head(final)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(from_intermediates, expected)


@pytest.mark.parametrize("name", POOLED)
def test_a_compiled_forward_head_pools_with_the_sizes_of_the_features_it_is_given(name):
    """Eager features from an earlier forward, given to ``forward_head`` compiled alone: the
    graph reads their recorded sizes, not those of the forward that ran last (it did, before).
    One graph where dynamo traces the records; before torch 2.6 the head runs eagerly inside."""
    model = vitprune.patch(build(name), keep_rate=0.5)
    a, b = images(model, seed=1), images(model, seed=2)
    head = torch.compile(model.forward_head, fullgraph=DYNAMO_TRACES_RECORDS, backend="eager")
    with torch.no_grad():
        expected_a, expected_b = model(a), model(b)
        features_a = model.forward_features(a)
        features_b = model.forward_features(b)  # the last forward: b's sizes in the state
        got_a, got_b = head(features_a), head(features_b)
    torch.testing.assert_close(got_a, expected_a)
    torch.testing.assert_close(got_b, expected_b)


def test_forward_head_refuses_features_whose_sizes_it_cannot_know():
    model = vitprune.patch(build("gap, no class token"), keep_rate=0.5)
    with torch.no_grad():
        features = model.forward_features(images(model))
        with pytest.raises(ValueError, match="did not come from this model's forward_features"):
            model.forward_head(features.clone())


@pytest.mark.parametrize("name", ["gap, no class token", "Eva02 (rope, SwiGLU, avg pool)"])
def test_forward_head_pools_features_of_another_token_count_as_timm_does(name):
    """Features with as many tokens as the grid has patches (the unpatched model's, here), given
    after a pruned forward left unequal sizes: every token is one patch, so timm's own pooling,
    not the refusal meant for a copy of the pruned forward's features."""
    model = build(name)
    x = images(model)
    with torch.no_grad():
        whole = model.forward_features(x).clone()
        expected = model.forward_head(whole)
        vitprune.patch(model, keep_rate=0.5)
        model(x)  # a pruned forward: the state holds its unequal sizes
        torch.testing.assert_close(model.forward_head(whole), expected, rtol=0, atol=0)


def test_a_tiny_temperature_gives_finite_outputs_and_the_limit_weights():
    weights = fusion_weights(torch.tensor([[1.0, 3.0, 2.0, 3.0]]), T=1e-40)
    assert torch.equal(weights, torch.tensor([[0.0, 0.5, 0.0, 0.5]]))  # ties share the top
    for T in (1e-40, 1e-300, 5e-324):
        model = vitprune.patch(tiny(), keep_rate=0.5, **paper(indicator="var", stages=(1,), T=T))
        with torch.no_grad():
            assert torch.isfinite(model(torch.randn(2, 3, 64, 64))).all()


@pytest.mark.parametrize("target, options, error, match", [
    ("3", {}, TypeError, "target_gflops must be a number"),
    (math.nan, {}, ValueError, "target_gflops must be > 0"),
    (0.1, {"overlap_stride": 99}, ValueError, r"overlap_stride must be in \[1, 16\]"),
    (0.1, {"img_size": 0}, ValueError, "img_size must be at least the patch size"),
    (0.1, {"img_size": (7, 7)}, ValueError, "img_size must be at least the patch size"),
    (0.1, {"img_size": "64"}, TypeError, "img_size must be an int or a pair"),
    (0.1, {"colour": "red"}, TypeError, r"unknown option\(s\) \['colour'\]"),
    (0.1, {"stages": 5}, TypeError, "stages must be a sequence of block indices, got 5"),
    (0.1, {"stages": "paper"}, ValueError, "unknown stages 'paper'; accepted: 'spread', 'spread2', 'spread3', 'all'"),
])
def test_fit_keep_rate_refuses_what_patch_refuses(target, options, error, match):
    with pytest.raises(error, match=match):
        vitprune.fit_keep_rate(tiny(), target, **options)


def test_the_fits_read_stages_given_as_an_iterator_as_the_same_blocks_in_a_list():
    # patch accepts any iterable; the fits build a config per bisection step, so a one-pass
    # iterator must not be spent by the first one
    model = tiny()
    target = 0.6 * vitprune.analytic_flops(model) / 1e9
    listed = vitprune.fit_keep_rate(model, target, stages=[1, 2])
    assert listed < 1.0 and vitprune.fit_keep_rate(model, target, stages=iter([1, 2])) == listed
    assert (vitprune.overlap_options(model, target, stages=(s for s in (1, 2)))
            == vitprune.overlap_options(model, target, stages=[1, 2]))


#: The functions that read a model to plan a patch, each as ``patch`` would be called on it.
PLANNERS = {
    "fit_keep_rate": lambda model, **kw: vitprune.fit_keep_rate(model, 1.0, **kw),
    "fit_merging": lambda model, **kw: vitprune.fit_merging(model, 1.0, **kw),
    "merging_config": lambda model, **kw: vitprune.merging_config(model, 2, **kw),
    "overlap_options": lambda model, **kw: vitprune.overlap_options(model, 1.0, **kw),
    "fit_overlap": lambda model, **kw: vitprune.fit_overlap(model, 1.0, **kw),
}


@pytest.mark.parametrize("name", PLANNERS)
@pytest.mark.parametrize("make, match", [
    (lambda: timm.create_model("resnet18"), "cannot patch a timm.models.resnet.ResNet"),
    (lambda: nn.Linear(2, 2), "cannot patch a torch.nn.modules.linear.Linear; supported: timm VisionTransformer"),
])
def test_the_fits_refuse_a_model_patch_cannot_take(name, make, match):
    """A TypeError that names the model and what is supported, as ``patch`` raises (the
    merging fits and the overlap options once failed on a missing attribute)."""
    with pytest.raises(TypeError, match=match):
        PLANNERS[name](make())


@pytest.mark.parametrize("name", ["fit_keep_rate", "fit_merging", "merging_config"])
def test_the_fits_refuse_class_only_last_where_patch_refuses_it(name):
    """A mean-pooled head reads every token of the last block: a plan counted with the class
    token alone there would be one ``patch`` then refuses."""
    model = small_vit(depth=4, class_token=False, global_pool="avg")
    with pytest.raises(TypeError, match="class_only_last=True cannot apply to this VisionTransformer"):
        PLANNERS[name](model, class_only_last=True)
    with pytest.raises(TypeError, match="class_only_last=True cannot apply"):
        vitprune.patch(model, class_only_last=True)


def test_bench_on_a_cnn_exits_2_with_a_message(capsys):
    code = main(["bench", "--model", "resnet18", "--batch", "1", "--rounds", "1",
                 "--warmup", "0", "--no-progress", "--no-memory"])
    assert code == 2
    assert "cannot patch a timm.models.resnet.ResNet" in capsys.readouterr().err


def test_unpatch_reaches_patched_models_inside_a_container():
    model = tiny()
    before = snapshot(model)
    wrapper = nn.Sequential(vitprune.patch(model, keep_rate=0.5, overlap_stride=8))
    assert vitprune.unpatch(wrapper) is wrapper
    assert not vitprune.is_patched(model) and type(model) is timm.models.vision_transformer.VisionTransformer
    assert_same(before, snapshot(model))


def test_kept_masks_refuses_a_size_other_than_the_last_forwards():
    model = vitprune.patch(tiny(dynamic_img_size=True), keep_rate=0.5)
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert vitprune.kept_masks(model, (32, 32)).shape[-2:] == (32, 32)
    with pytest.raises(ValueError, match="the last forward had 4 patches, but a \\(64, 64\\) input has 16"):
        vitprune.kept_masks(model, (64, 64))


def test_count_flops_names_what_it_needs():
    with pytest.raises(TypeError, match="convolutional stem.*this Linear has no Conv2d"):
        vitprune.count_flops(nn.Linear(2, 2))


@pytest.mark.filterwarnings("ignore:.torch.jit.script. is deprecated:FutureWarning")  # torch 2.14.1 and 2.15.0 warn
def test_scripting_a_patched_model_says_it_is_not_supported():
    model = vitprune.patch(tiny(), keep_rate=0.5)
    with pytest.raises(TypeError, match="cannot be compiled by torch.jit.script.*torch.compile"):
        torch.jit.script(model)


@pytest.mark.parametrize("trace", [
    torch.fx.symbolic_trace,
    lambda m: timm.models.create_feature_extractor(m, return_nodes={"blocks.1": "mid"}),
], ids=["symbolic_trace", "timm fx feature extractor"])
def test_fx_tracing_a_patched_model_says_what_works_instead(trace):
    """fx's proxies have no shapes; before, the trace failed in a block complaining of masks
    the user never passed (fx's placeholder for timm's ``attn_mask``)."""
    model = vitprune.patch(tiny(), keep_rate=0.5)
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    with torch.no_grad():
        expected = model(x)
    with pytest.raises(TypeError, match=r"torch\.fx cannot trace a patched model.*forward_intermediates"):
        trace(model)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",  # the exporter is deprecated
                            "ignore::torch.jit.TracerWarning")  # timm and transformers code before the refusal
def test_the_torchscript_onnx_exporter_is_refused_naming_the_one_that_works(tmp_path):
    """Before, it failed on the stable sort; with ``topk`` in its place its graph of the
    defaults gave other logits than the model (by 0.1 to 0.35 on a random deit_tiny)."""
    model = vitprune.patch(tiny(), keep_rate=0.5)
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    with pytest.raises(TypeError, match=r"TorchScript-based ONNX exporter.*dynamo=True"):
        torch.onnx.export(model, (x,), str(tmp_path / "model.onnx"), dynamo=False)
    with torch.no_grad():
        assert model(x).shape == (2, model.num_classes)


def test_visualize_errors_name_the_problem():
    model = vitprune.patch(tiny(), keep_rate=0.5)
    with pytest.raises(ValueError, match="must be \\(C, H, W\\) or \\(B, C, H, W\\), got shape \\(64, 64\\)"):
        vitprune.visualize(model, torch.randn(64, 64))
    with pytest.raises(ValueError, match="one label per image: 2 images, 1 titles"):
        vitprune.visualize(model, torch.randn(2, 3, 64, 64), titles=["one"])
    vitprune.patch(model, keep_rate=0.5, stages=())
    with pytest.raises(ValueError, match="no pruning stages"):
        vitprune.visualize(model, torch.randn(1, 3, 64, 64))


@pytest.mark.parametrize("call", [vitprune.unpatch, vitprune.is_patched, vitprune.get_config,
                                  vitprune.kept_positions])
def test_functions_taking_a_model_refuse_none(call):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
        call(None)


@pytest.mark.parametrize("indicator", ["var", "medad", "lowvar"])
def test_a_one_head_model_refuses_head_disagreement_indicators(indicator):
    model = tiny(num_heads=1)
    before = snapshot(model)
    with pytest.raises(ValueError, match=f"indicator='{indicator}' measures how attention heads disagree.*1 head"):
        vitprune.patch(model, indicator=indicator, keep_rate=0.5)
    assert_same(before, snapshot(model))
    vitprune.patch(model, indicator="cls", keep_rate=0.5)  # one head is fine for the class-attention mean
    vitprune.patch(model, keep_rate=0.5)  # and for the defaults


def test_a_block_called_alone_after_a_forward_runs_without_that_forward_s_size_bias():
    """A following block reads the size bias its stage left in the last forward only where
    the input is that forward's shape; on any other input it is timm's block as it was."""
    model = vitprune.patch(tiny(), keep_rate=0.7, stages=(1,), class_only_last=False)
    with torch.no_grad():
        model(images(model, batch=2))  # stage 1 leaves a (2, 1, 1, 1 + 12) bias for blocks 2 and 3
        for batch, tokens in [(3, 13), (2, 9)]:  # another batch, another token count
            y = torch.randn(batch, tokens, 192)
            assert torch.equal(model.blocks[2](y), timm.models.vision_transformer.Block.forward(model.blocks[2], y))


def test_a_stage_called_alone_after_a_forward_indexes_its_own_input():
    """A stage block called alone on another batch chains its positions to nothing: they index
    the tokens it was given, not the last forward's previous stage (whose batch differs)."""
    model = vitprune.patch(tiny(), keep_rate=0.5, stages=(1, 2), class_only_last=False)
    with torch.no_grad():
        model(images(model, batch=2))
        model.blocks[2](torch.randn(3, 1 + 12, 192))  # stage 1 alone: 12 patch tokens, keeps 6
    positions = vitprune.kept_positions(model)[-1]
    assert positions.shape == (3, 6) and all(sorted(row) == sorted(set(row)) for row in positions.tolist())
    assert 0 <= positions.min() and positions.max() < 12


def test_a_stage_that_keeps_every_token_changes_nothing_after_a_merge():
    """Stages 1 and 2 at keep rates 0.5 and 1.0 give what stage 1 alone gives: the second
    passes the tokens, their sizes and the size bias on to the blocks after it."""
    x = images(tiny(), batch=2)
    with torch.no_grad():
        expected = vitprune.patch(tiny(), keep_rate=0.5, stages=(1,))(x)
        model = vitprune.patch(tiny(), keep_rate=(0.5, 1.0), stages=(1, 2))
        got = model(x)
    assert (model.vitprune_state.sizes > 1).any()  # merged tokens: without their bias the output moves
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mask", [dict(attn_mask=torch.zeros(1, 1, 17, 17)), dict(is_causal=True)], ids=str)
def test_a_pruning_block_refuses_a_mask_it_could_not_follow(mask):
    """A mask would not match the tokens after a reduction: a stage block refuses either kind."""
    model = vitprune.patch(small_vit(), keep_rate=0.5, **paper(stages=(1,)))
    with pytest.raises(ValueError, match="cannot apply attn_mask or is_causal"):
        model.blocks[1](torch.randn(1, 17, 192), **mask)


def test_attention_dropout_is_off_in_eval_mode_in_the_blocks_the_patch_runs():
    """Built with attention dropout, in eval mode: every block run by vitprune (keep 1.0, a
    stage in every block) gives the unpatched logits."""
    model = small_vit(attn_drop_rate=0.5)
    x = images(model)
    with torch.no_grad():
        expected = model(x)
        vitprune.patch(model, keep_rate=1.0, stages="all", class_only_last=False)
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
