"""Every supported ViT family: nothing pruned == unpatched, pruning runs, unpatch restores.

Models are shrunk (small images, few blocks) and use random weights. Families without a
class token score the mean attention each patch receives; their pruning blocks use the
explicit attention path, so with an indicator they match the fused unpatched model to float
tolerance. Otherwise nothing reduced is timm's output bit for bit (``assert_timms``).
"""

import copy
import inspect

import pytest
import timm
import torch

import vitprune
from conftest import FAMILIES, PAPER, all_blocks, assert_training_step_kept, build, images, paper
from vitprune.measure.flops import count_flops, schedule_flops


#: Where timm hands torch's fused attention a 3-D mask (BEiT's shared table alone), torch
#: computes it on its math path; the patch gathers the table per image after the first stage,
#: a 4-D mask, which takes the fused kernel: the same sums, rounded otherwise.
MATH_PATH_IN_TIMM = {"BEiT, shared table"}


def assert_timms(name, got, expected):
    """timm's outputs bit for bit; for a family in ``MATH_PATH_IN_TIMM``, within a few
    rounding steps of the outputs' size."""
    if name in MATH_PATH_IN_TIMM:
        step = torch.finfo(got.dtype).eps * expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=0, atol=8 * step)
    else:
        assert_bit_for_bit(got, expected)


def assert_bit_for_bit(got, expected, label=""):
    assert torch.equal(got, expected), f"{got.dtype}{label}: {(got - expected).abs().max().item():.3g} off timm's"


def unreduced_and_timm(model, dtype, **options):
    """A copy of ``model`` in ``dtype`` on two images: the patch's outputs with nothing reduced
    (keep 1.0 in every block, every token through the last) and timm's."""
    cast = copy.deepcopy(model).to(dtype)
    x = images(cast, batch=2).to(dtype)
    with torch.no_grad():
        expected = cast(x)
        vitprune.patch(cast, **{**options, "keep_rate": 1.0, "stages": "all", "class_only_last": False})
        return cast(x), expected


def assert_unpruned_close(name, model, got, expected):
    """Bit for bit with a class token (:func:`assert_timms`); without one the pruning blocks
    score the mean received attention on the explicit path, equal to the fused unpatched
    model to float tolerance."""
    if model.cls_token is not None:
        assert_timms(name, got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("indicator", ["var", "medad"])
def test_nothing_pruned_equals_unpatched_in_every_family(name, indicator):
    model = build(name)
    x = images(model)
    with torch.no_grad():
        expected = model(x)
        vitprune.patch(model, indicator=indicator, keep_rate=1.0, stages=all_blocks(model))
        got = model(x)
    assert_unpruned_close(name, model, got, expected)
    assert vitprune.get_config(model).stages == all_blocks(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_nothing_reduced_equals_unpatched_with_every_parameter_moved_off_its_initial_value(name):
    """timm starts many parameters at zero or one (biases, relative position tables, register
    tokens, layer scales, the MLP bias of a block without qkv biases), where an equivalence
    test cannot see whether the patch uses them as timm does. Every parameter moved by random
    noise, float64: keep 1.0 in every block, every token through the last, equals timm."""
    model = build(name).double()
    with torch.no_grad():
        for index, parameter in enumerate(model.parameters()):
            noise = torch.randn(parameter.shape, dtype=parameter.dtype, generator=torch.Generator().manual_seed(index))
            parameter.add_(0.05 * noise)
        x = images(model).double()
        expected = model(x)
        vitprune.patch(model, keep_rate=1.0, stages="all", class_only_last=False)
        torch.testing.assert_close(model(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", FAMILIES)
def test_nothing_reduced_rounds_as_timm_in_float32_float16_and_bfloat16(name):
    """The attention the patch runs itself computes as timm's, in the dtypes models run in
    (float16 and bfloat16 as on a GPU, here on the CPU): keep 1.0 in every block, every token
    through the last, gives timm's outputs bit for bit."""
    model = build(name)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert_timms(name, *unreduced_and_timm(model, dtype))


@pytest.mark.parametrize("name", FAMILIES)
def test_on_timms_explicit_attention_nothing_reduced_is_timm_bit_for_bit(name):
    """timm's explicit attention (``fused_attn`` off: ``TIMM_FUSED_ATTN=0``, or a torch without
    the fused kernel), where the patch computes the attention matrix as timm does: keep 1.0 in
    every block, every token through the last, the defaults' method and the paper's (var),
    float32 and float16, on every family (BEiT's shared table and the mean-pooled models
    included, which the fused path leaves a rounding step off)."""
    model = build(name)
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
    for dtype in (torch.float32, torch.float16):
        for options in ({}, paper(indicator="var")):
            assert_bit_for_bit(*unreduced_and_timm(model, dtype, **options), label=f" {options}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_training_step_with_dropout_is_timms_when_nothing_is_reduced(name, fused):
    """Dropout, attention dropout and drop path on, the same seed: at keep 1.0 in every block
    (every token through the last) the patch draws timm's masks in timm's order, so the
    training forward and every gradient are timm's bit for bit (float64)."""
    model = build(name, drop_path_rate=0.2, attn_drop_rate=0.2, proj_drop_rate=0.2, drop_rate=0.2).double().train()
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused
    x = images(model).double()
    assert_training_step_kept(model, lambda model: model(x))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("options", [PAPER, {}], ids=["paper", "defaults"])
def test_pruning_runs_and_unpatch_restores(name, options):
    model = build(name)
    x = images(model)
    with torch.no_grad():
        expected = model(x)
        vitprune.patch(model, keep_rate=0.7, **options)
        pruned = model(x)
        n = model.patch_embed.num_patches
        positions = vitprune.kept_positions(model)
        first_rate = vitprune.get_config(model).keep_rate[0]  # 0.7 at the paper's first stage
        vitprune.unpatch(model)
        restored = model(x)
    assert pruned.shape == expected.shape and torch.isfinite(pruned).all()
    assert not torch.equal(pruned, expected)  # something was pruned (some heads start near zero)
    k = vitprune.keep_count(first_rate, n)
    if options.get("reduction") == "fuse":
        assert positions[0].shape == (3, k + 1) and (positions[0][:, -1] == -1).all()
    else:  # merged into the kept tokens: no fusion token
        assert positions[0].shape == (3, k) and (positions[0] >= 0).all()
    torch.testing.assert_close(restored, expected, rtol=0, atol=0)
    assert type(model) is type(build(name)) and not vitprune.is_patched(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_patched_methods_show_timms_signatures(name):
    """Tools read a model's parameters by name (``torch.export``'s ``dynamic_shapes={"x":
    ...}``); the patched methods take ``(*args, **kwargs)`` and must still show timm's."""
    model = build(name)
    methods = [m for m in ("forward", "forward_features", "forward_intermediates") if hasattr(model, m)]
    before = {m: inspect.signature(getattr(model, m)) for m in methods}
    vitprune.patch(model, keep_rate=0.7)
    assert {m: inspect.signature(getattr(model, m)) for m in methods} == before
    assert model.forward.__name__ == "forward" and "x" in before["forward"].parameters


#: The families timm builds with ``dynamic_img_size`` (BEiT's and relpos' bias tables are fixed to one grid).
DYNAMIC = [name for name in FAMILIES if "relpos" not in name and "BEiT" not in name]


@pytest.mark.parametrize("name", DYNAMIC)
def test_at_another_input_size_every_family_is_exact_unpruned_and_counted(name):
    model = build(name, dynamic_img_size=True)
    embed = model.patch_embed
    (rows, cols), pixels = embed.grid_size, embed.img_size[0] // embed.grid_size[0]  # a token's side
    size = ((rows + 1) * pixels, (cols + 3) * pixels)
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        vitprune.patch(model, keep_rate=1.0, stages=all_blocks(model))
        got = model(x)
    assert_timms(name, got, expected)
    for options in ({"keep_rate": 0.5}, paper(indicator="var", keep_rate=0.7)):
        predicted = schedule_flops(model, vitprune.PruneConfig(**options), size)
        vitprune.patch(model, **options)
        with torch.no_grad():
            assert torch.isfinite(model(x)).all()
        traced = count_flops(model, size, products_only=True)
        assert abs(traced - predicted) / traced < 0.003, (options, traced, predicted)


@pytest.mark.parametrize("name", ["gap, no class token", "siglip map (attention pool)", "registers, no class token"])
def test_models_without_a_class_token_score_the_mean_received_attention(name):
    model = vitprune.patch(build(name), keep_rate=0.5, indicator="var")
    assert model.vitprune_state.row_source == "mean"
    assert vitprune.patch(build("CLIP tower"), indicator="var").vitprune_state.row_source == "cls"
    # bipartite merging needs no score: no row, and the fused attention path
    assert vitprune.patch(build(name), keep_rate=0.5).vitprune_state.row_source == "none"


def test_sizes_count_the_patches_each_token_stands_for():
    model = vitprune.patch(build("gap, no class token"), keep_rate=(0.5, 0.5), **paper(stages=(1, 2)))
    with torch.no_grad():
        model(images(model))
    sizes = model.vitprune_state.sizes
    n = model.patch_embed.num_patches  # 16 -> keep 8 + fusion of 8 (9 tokens) -> keep 5 + fusion
    assert sizes.shape == (3, 6)
    torch.testing.assert_close(sizes.sum(dim=1), torch.full((3,), float(n)))
    assert set(sizes[:, :-1].unique().tolist()) <= {1.0, 8.0}  # a kept earlier fusion token holds 8
    assert (sizes[:, -1] >= 4).all()


@pytest.mark.parametrize("pool", ["avg", "avgmax"])
def test_average_pooling_weights_tokens_by_patch_count(pool):
    model = vitprune.patch(build("gap, no class token"), keep_rate=0.5, stages=(1, 2))
    model.global_pool = pool
    x = images(model)
    with torch.no_grad():
        features = model.forward_features(x)
        sizes = model.vitprune_state.sizes
        # by hand: the fusion token counts as many times as the patches it holds
        mean = sum(sizes[:, i, None] * features[:, i] for i in range(sizes.shape[1])) / sizes.sum(1, keepdim=True)
        pooled = mean if pool == "avg" else 0.5 * (features.amax(dim=1) + mean)
        expected = model.head(model.fc_norm(pooled))
        torch.testing.assert_close(model.forward_head(features), expected)
        torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("name", ["BEiT (relative position bias)", "relpos, no class token"])
def test_inline_average_heads_weight_tokens_by_patch_count(name):
    model = vitprune.patch(build(name), keep_rate=0.5, stages=(1, 2))
    x = images(model)
    with torch.no_grad():
        features = model.forward_features(x)
        sizes = model.vitprune_state.sizes
        tokens = features[:, model.num_prefix_tokens:]
        pooled = (tokens * sizes[..., None]).sum(1) / sizes.sum(1, keepdim=True)
        torch.testing.assert_close(model(x), model.head(model.fc_norm(pooled)))


def test_log_size_bias_equals_repeating_the_token_in_attention_pooling():
    pool = build("siglip map (attention pool)").attn_pool
    tokens = torch.randn(2, 5, pool.latent.shape[-1])
    repeated = torch.cat([tokens, tokens[:, -1:].expand(-1, 3, -1)], dim=1)  # last token 4 times
    sizes = torch.tensor([1.0, 1, 1, 1, 4]).expand(2, 5)
    with torch.no_grad():
        torch.testing.assert_close(pool(tokens, attn_mask=sizes.log()[:, None, None, :]), pool(repeated))


@pytest.mark.parametrize("name, pools_prefix", [("siglip map (attention pool)", False),
                                                 ("PE core (rope, map pool)", True)])
def test_map_head_receives_the_log_size_bias(name, pools_prefix):
    """The attention pool weights each token by the patches it holds; timm's Eva (PE core)
    pools its class token too, as one patch."""
    model = vitprune.patch(build(name), keep_rate=0.5)
    x = images(model)
    with torch.no_grad():
        features = model.forward_features(x)
        sizes, P = model.vitprune_state.sizes, model.num_prefix_tokens
        pooled = features if pools_prefix else features[:, P:]
        if pools_prefix:
            assert P == 1
            sizes = torch.cat([torch.ones(len(sizes), P), sizes], dim=1)
        biased = model.attn_pool(pooled, attn_mask=sizes.log()[:, None, None, :])
        plain = model.attn_pool(pooled)
        out = model.forward_head(features, pre_logits=True)
    torch.testing.assert_close(out, model.fc_norm(biased))
    assert not torch.allclose(out, model.fc_norm(plain))


def test_parallel_scaling_block_prunes_after_the_whole_block():
    model = vitprune.patch(build("ParallelScalingBlock"), keep_rate=0.5, **paper(stages=(0,)))
    block, x = model.blocks[0], torch.randn(2, 17, 192)
    with torch.no_grad():
        out = block(x)
        full = timm.models.vision_transformer.ParallelScalingBlock.forward(block, x)
    keep = vitprune.kept_positions(model)[0][:, :-1]
    assert out.shape == (2, 1 + 8 + 1, 192)
    torch.testing.assert_close(out[:, 1:9], full[:, 1:].gather(1, keep[..., None].expand(-1, -1, 192)))


@pytest.mark.parametrize("name", ["ParallelScalingBlock, no qkv bias", "ParallelScalingBlock, RmsNorm, qk-norm (xp)"])
def test_parallel_scaling_block_adds_a_trained_mlp_bias_as_the_installed_timm_does(name):
    """Without qkv biases the block trains an MLP bias, zero at first (so the equivalence tests
    cannot see where it goes). timm 1.0.25 adds it to the MLP's outputs; earlier releases add
    cat((zeros, mlp_bias)) to every output of the fused projection, whose MLP part comes first.
    The patch follows the installed timm either way."""
    model = build(name)
    with torch.no_grad():
        for block in model.blocks:
            block.mlp_bias.normal_()
        x = images(model)
        expected = model(x)
        vitprune.patch(model, keep_rate=1.0, stages=all_blocks(model), class_only_last=False)
        torch.testing.assert_close(model(x), expected)


def test_parallel_things_block_scores_the_heads_of_every_branch():
    model = vitprune.patch(build("ParallelThingsBlock"), keep_rate=0.5, **paper(stages=(0,)))
    rows = []
    from vitprune.families import attention

    original = attention.attention_with_row

    def spy(attn, x, num_prefix, source="cls", bias=None, rope=None):
        out, row = original(attn, x, num_prefix, source, bias, rope)
        rows.append(row.row)
        return out, row

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("vitprune.families.vit.attention_with_row", spy)
        seen = []
        mp.setattr(model.vitprune_state, "scores", lambda row: (seen.append(row), row.var(1))[1])
        with torch.no_grad():
            model(images(model))
    assert len(rows) == 2 and seen[0].shape == (3, 2 * 3, 16)
    torch.testing.assert_close(seen[0], torch.cat(rows, dim=1))


def test_member_reads_what_getattr_reads_without_its_exception():
    from vitprune.families.attention import member

    class Odd(torch.nn.Module):
        kind = "class attribute"

        def __init__(self):
            super().__init__()
            self.q_bias = torch.nn.Parameter(torch.zeros(2))
            self.norm = torch.nn.Identity()
            self.register_buffer("table", torch.ones(1))
            self.gate = None
            self.groups = 3

        @property
        def heads(self):
            return 4

    module = Odd()
    for name in ("q_bias", "norm", "table", "gate", "groups", "kind", "heads", "absent"):
        assert member(module, name, "default") is getattr(module, name, "default"), name


@pytest.mark.parametrize("name", FAMILIES)
def test_hooks_on_an_attention_the_patch_runs_itself_are_named_and_its_layers_hooks_still_run(name):
    """A swapped block runs its attention's layers itself (to read the scored row), so a
    forward hook on the attention module would go silent: ``patch`` warns, naming it. The
    hooks on the attention's layers run as they run in timm."""
    import warnings

    from vitprune.core.registry import family_of

    model = build(name)
    attentions = family_of(model).attention_modules(model.blocks[1])
    ran = []
    for attn in attentions.values():
        for layer_name, layer in attn.named_children():
            layer.register_forward_hook(lambda *a, layer_name=layer_name: ran.append(layer_name))
    with torch.no_grad():
        model(images(model))
    in_timm, ran[:] = sorted(ran), []
    for attn in attentions.values():
        attn.register_forward_hook(lambda *a: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vitprune.patch(model, keep_rate=0.7)
    named = [str(w.message) for w in caught if "hooks registered on" in str(w.message)]
    if attentions:
        expected = ", ".join(f"blocks.1.{path}" for path in attentions)
        assert len(named) == 1 and f"will not run while the model is patched: {expected};" in named[0]
    else:  # ParallelScalingBlock: one fused projection, no attention module
        assert named == []
    with torch.no_grad():
        model(images(model))
    assert sorted(ran) == in_timm


@pytest.mark.parametrize("name", FAMILIES)
def test_a_hook_added_after_patch_to_an_attention_the_patch_runs_itself_is_named_once(name):
    """Registered after ``patch``, such a hook would go silent unseen: the block's first
    eager call names it, once; a hook ``patch`` already named is not named again."""
    import warnings

    from vitprune.core.registry import family_of

    model = build(name)
    attentions = family_of(model).attention_modules(model.blocks[2])
    for attn in attentions.values():
        attn.register_forward_hook(lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # patch names these
        vitprune.patch(model, keep_rate=0.7)
    attentions = family_of(model).attention_modules(model.blocks[1])
    for attn in attentions.values():
        attn.register_forward_pre_hook(lambda *a: None)

    def named_by_a_call():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                model(images(model))
        return [str(w.message) for w in caught if "after patch" in str(w.message)]

    first, second = named_by_a_call(), named_by_a_call()
    if attentions:
        expected = ", ".join(f"blocks.1.{path}" for path in attentions)
        assert len(first) == 1 and f"hooks were registered on {expected} after patch;" in first[0]
    else:  # ParallelScalingBlock: one fused projection, no attention module
        assert first == []
    assert second == []


@pytest.mark.parametrize("name, followers_run_timm", [("ResPostBlock", True), ("rope ViT (AttentionRope)", True),
                                                     ("BEiT (relative position bias)", False)])
@pytest.mark.parametrize("class_only", [False, True])
def test_patch_names_exactly_the_attention_hooks_that_will_not_run(name, followers_run_timm, class_only):
    """Blocks after the one stage are swapped too (the size bias; rope and relative bias
    follow the tokens), but timm's ViT and Eva blocks that only follow run timm's own
    forward, so their attention's hooks still run and are not named; with the class token
    alone in the last block, its attention is skipped in ``forward``."""
    import warnings

    token = dict(global_pool="token", **({} if "BEiT" in name else {"class_token": True}))  # BEiT always has one
    model = build(name, **token) if class_only else build(name)
    ran = []
    for index, block in enumerate(model.blocks):
        block.attn.register_forward_hook(lambda *a, index=index: ran.append(index))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vitprune.patch(model, keep_rate=0.7, stages=(1,), class_only_last=class_only)
    named = [str(w.message) for w in caught if "hooks registered on" in str(w.message)]
    last = len(model.blocks) - 1
    skipped = [1] + [i for i in range(2, last + 1) if not followers_run_timm or (class_only and i == last)]
    assert len(named) == 1 and f"patched: {', '.join(f'blocks.{i}.attn' for i in skipped)};" in named[0]
    with torch.no_grad():
        model(images(model))
    assert sorted(ran) == [i for i in range(last + 1) if i not in skipped]


def test_a_parallel_branch_holding_an_attention_is_named_and_its_module_list_is_not():
    """ParallelThingsBlock keeps each attention in a branch (``attns.i``, a ``Sequential``) of
    a ``ModuleList``: the swapped block calls neither branch, so hooks on a branch go silent
    and are named; a ``ModuleList`` is never called, even by timm, so its hooks are not. A
    full backward pre-hook alone is named too."""
    import warnings

    model = build("ParallelThingsBlock")
    block = model.blocks[1]
    ran = []
    block.attns.register_forward_hook(lambda *a: ran.append("attns"))
    block.attns[0].register_forward_hook(lambda *a: ran.append("attns.0"))
    block.attns[1].attn.register_full_backward_pre_hook(lambda *a: None)
    with torch.no_grad():
        model(images(model))
    assert ran == ["attns.0"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vitprune.patch(model, keep_rate=0.7, stages=(1,))
    named = [str(w.message) for w in caught if "hooks registered on" in str(w.message)]
    assert len(named) == 1 and "will not run while the model is patched: blocks.1.attns.0, blocks.1.attns.1.attn;" \
        in named[0]
    ran.clear()
    with torch.no_grad():
        model(images(model))
    assert ran == []


def test_a_patch_without_hooks_on_attention_modules_warns_nothing():
    import warnings

    model = build("ResPostBlock")
    model.blocks[1].register_forward_hook(lambda *a: None)  # on the block: still runs
    model.blocks[1].attn.qkv.register_forward_hook(lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vitprune.patch(model, keep_rate=0.7)
