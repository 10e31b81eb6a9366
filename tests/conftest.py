"""Shared model factories. All models use random weights: nothing is downloaded."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Tuple

import pytest
import timm
import torch
from timm.models.vision_transformer import ParallelScalingBlock, ParallelThingsBlock, ResPostBlock

# Under pytest-xdist (the README's `-n 2`) each worker is a process with torch's whole thread
# pool: two workers on two cores then run every operation on four threads, and ran a third of
# the suite in 9 minutes (one process: all of it in 13). Each worker takes its share instead.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

#: The families the equivalence tests cover, each small enough for a CPU test.
MODEL_FACTORIES: Dict[str, Callable[[], torch.nn.Module]] = {
    "deit_tiny": lambda: timm.create_model("deit_tiny_patch16_224"),
    "deit3_small (LayerScale)": lambda: timm.create_model("deit3_small_patch16_224", img_size=128),
    "qk_norm": lambda: timm.create_model("deit_tiny_patch16_224", qk_norm=True, img_size=128),
    "deit_tiny_distilled (2 prefix)": lambda: timm.create_model("deit_tiny_distilled_patch16_224"),
    "dinov2 reg4 (5 prefix)": lambda: timm.create_model("vit_small_patch14_reg4_dinov2", img_size=112),
}


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODEL_FACTORIES[name]().eval()


def image_batch(model: torch.nn.Module, batch: int = 2, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *model.patch_embed.img_size, generator=generator)


#: The paper's method (its three stages, top-scored tokens kept, one fusion token, plain
#: attention), for the tests that check it rather than the library's defaults.
PAPER = dict(stages=None, selection="top", reduction="fuse", size_aware=False, class_only_last=False)


def paper(**options):
    """``PAPER`` with ``options`` overriding it (for example other stages)."""
    return {**PAPER, **options}


_TINY, _SMALL = "deit_tiny_patch16_224", dict(img_size=64, depth=4)

#: Every supported family, shrunk (small images, few blocks), random weights: the timm model
#: and its ``create_model`` arguments.
FAMILIES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "ResPostBlock": (_TINY, dict(img_size=64, block_fn=ResPostBlock)),
    "ParallelThingsBlock": (_TINY, dict(img_size=64, block_fn=ParallelThingsBlock)),
    "ParallelScalingBlock": (_TINY, dict(img_size=64, block_fn=ParallelScalingBlock)),
    "ParallelScalingBlock, no qkv bias": (_TINY, dict(img_size=64, block_fn=ParallelScalingBlock, qkv_bias=False)),
    "ParallelScalingBlock, RmsNorm, qk-norm (xp)": ("vit_base_patch16_xp_224", _SMALL),
    "ParallelScalingBlock, register, gap (pwee)": ("vit_pwee_patch16_reg1_gap_256", _SMALL),
    "ResPostBlock, gap (rpn)": ("vit_base_patch16_rpn_224", _SMALL),
    "CLIP tower": ("vit_base_patch16_clip_224", _SMALL),
    "DINOv2": ("vit_small_patch14_dinov2", dict(img_size=56, depth=4)),
    "hybrid (ResNet stem)": ("vit_tiny_r_s16_p8_224", dict(img_size=128)),
    "flexivit": ("flexivit_small", _SMALL),
    "gap, no class token": ("vit_base_patch16_gap_224", _SMALL),
    "avgmax, no class token": (_TINY, dict(img_size=64, class_token=False, global_pool="avgmax")),
    "max, no class token": (_TINY, dict(img_size=64, class_token=False, global_pool="max")),
    "siglip gap": ("vit_base_patch16_siglip_gap_224", _SMALL),
    "siglip map (attention pool)": ("vit_base_patch16_siglip_224", _SMALL),
    "registers, no class token": ("vit_betwixt_patch16_reg4_gap_256", _SMALL),
    "Eva02 (rope, SwiGLU, avg pool)": ("eva02_tiny_patch14_224", dict(img_size=56, depth=4)),
    "rope ViT (AttentionRope)": ("vit_small_patch16_rope_224", _SMALL),
    "mixed rope (per-head tables)": ("vit_small_patch16_rope_mixed_224", _SMALL),
    "PE core (rope, map pool)": ("vit_pe_core_tiny_patch16_384", _SMALL),
    "DINOv3 (rope, registers)": ("vit_small_patch16_dinov3", _SMALL),
    "Sapiens2 (rope, grouped key/value heads)":  # full heads in the first and last block, as timm's layout
        ("vit_base_patch16_sapiens2", dict(_SMALL, num_kv_heads=(12, 6, 6, 12))),
    "BEiT (relative position bias)": ("beit_base_patch16_224", _SMALL),
    "BEiT, shared table": ("beit_base_patch16_224", dict(_SMALL, use_rel_pos_bias=False, use_shared_rel_pos_bias=True)),
    "relpos, no class token": ("vit_relpos_small_patch16_224", _SMALL),
    "relpos, class token, token pool": ("vit_relpos_base_patch16_cls_224", _SMALL),
    "relpos, res-post blocks": ("vit_relpos_medium_patch16_rpn_224", _SMALL),
    "shared relpos": ("vit_srelpos_small_patch16_224", _SMALL),
}


def build(name, **kwargs):
    """The family's small model (``kwargs`` added to its ``create_model`` arguments), eval mode."""
    model_name, arguments = FAMILIES[name]
    torch.manual_seed(0)
    return available(model_name, **arguments, **kwargs).eval()


def available(name: str, **kwargs) -> torch.nn.Module:
    """``timm.create_model(name, **kwargs)``, or a skip where this timm version lacks the model
    (the minimum-version CI run has fewer models than the newest timm)."""
    if not timm.is_model(name):
        pytest.skip(f"timm {timm.__version__} has no {name}")
    return timm.create_model(name, **kwargs)


def images(model, batch=3, seed=1):
    return torch.randn(batch, 3, *model.patch_embed.img_size, generator=torch.Generator().manual_seed(seed))


def small_vit(**kwargs):
    """deit_tiny at 64x64 (16 patches, 12 blocks unless ``depth`` says), random weights, eval mode."""
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224", img_size=64, **kwargs).eval()


def all_blocks(model):
    return tuple(range(len(model.blocks)))


def snapshot(model):
    """Everything a patch could change: classes, attribute names, tensors (values and
    dtypes), and which parameter objects the model holds."""
    return {
        "types": [(name, type(m)) for name, m in model.named_modules()],
        "attrs": [(name, sorted(vars(m))) for name, m in model.named_modules()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "params": [(name, id(p)) for name, p in model.named_parameters()],
    }


def assert_same(before, after):
    assert before["types"] == after["types"]
    assert before["attrs"] == after["attrs"]
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert value.dtype == after["state"][key].dtype, key
        assert torch.equal(value, after["state"][key]), key
    assert before["params"] == after["params"]


def assert_same_per_stage(got, expected, stages):
    """Per-stage tensors (``kept_positions``, ``token_groups``) equal stage by stage, and
    ``stages`` of each: ``zip`` alone stops at the shorter list, so a lost stage would pass."""
    assert len(got) == len(expected) == stages
    for stage, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"stage {stage}"


def make_visible(model: torch.nn.Module, suffixes: Tuple[str, ...]) -> torch.nn.Module:
    """``model`` with the parameters named by ``suffixes`` (biases, layer scales, relative
    position tables: timm starts many at or near zero) and the head's weight redrawn at a
    visible scale, so a term a forward leaves out moves the logits by far more than a test's
    tolerance (timm's rope ViTs start with logits near 1e-3). Returns ``model``."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(suffixes):
                parameter.normal_(0, 0.5)
        head = getattr(model, "head", None)
        if isinstance(head, torch.nn.Linear):
            head.weight.normal_(0, head.in_features ** -0.5)
    return model


def assert_class_only_exact(model, x, fused, atol):
    """With nothing reduced, ``class_only_last=True`` gives the unpatched model's logits, with
    fused or explicit attention (``fused``), and a direct ``forward_features`` still computes
    every token. Patches ``model``."""
    import vitprune

    for block in model.blocks:
        block.attn.fused_attn = fused
    with torch.no_grad():
        expected, features = model(x), model.forward_features(x)
    vitprune.patch(model, keep_rate=1.0, class_only_last=True)
    assert model.blocks[-1].vitprune_class_only
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=atol)
        torch.testing.assert_close(model.forward_features(x), features)  # called directly: every token


def assert_hooked_projections_run_as_in_timm(model, x, atol):
    """A forward hook that changes the output of each projection of the last block's
    attention (a fused ``qkv``, or ``q_proj``/``k_proj``/``v_proj``) runs in a patched forward
    whose last block computes the prefix tokens alone, as often as in timm, and with nothing
    reduced gives the unpatched model's logits with the same hook; a fused ``qkv`` that timm
    calls sees every token there too. Patches ``model``."""
    import vitprune

    attn = model.blocks[-1].attn
    layers = {name: getattr(attn, name) for name in ("qkv", "q_proj", "k_proj", "v_proj")
              if isinstance(getattr(attn, name, None), torch.nn.Module)}
    seen = []

    def change(module, args, out, name=None):
        seen.append((name, out.shape[1]))
        return out * 1.5

    for name, layer in layers.items():
        layer.register_forward_hook(lambda m, a, o, name=name: change(m, a, o, name))
    with torch.no_grad():
        expected, in_timm = model(x), list(seen)
    seen.clear()
    vitprune.patch(model, keep_rate=1.0, class_only_last=True)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=atol)
    assert [name for name, _ in seen] == [name for name, _ in in_timm] and layers
    if "qkv" in layers:
        assert seen == in_timm


def trained_logits(model, x, labels, steps=2, lr=0.1):
    """``model``'s eval-mode logits on ``x`` after ``steps`` SGD steps of cross-entropy on
    ``(x, labels)`` in train mode (the optimizer made first, from the parameters as they are)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        optimizer.step()
    with torch.no_grad():
        return model.eval()(x)


def training_step(model, forward, seed=7):
    """With the global seed set to ``seed``: ``forward(model)``, then the backward pass of the
    sum of its squares. Returns the output (detached) and every parameter's gradient."""
    torch.manual_seed(seed)
    out = forward(model)
    out.square().sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_training_step_kept(model, forward):
    """Dropout on in ``model`` (train mode, float64): with the same seed, a patch at keep 1.0 in
    every block (every token through the last) gives its training forward and every gradient
    bit for bit. ``forward(model)`` is the output a user reads; a second seed must change it,
    so the masks are really drawn. Patches ``model``."""
    import copy

    import vitprune

    expected, expected_grads = training_step(copy.deepcopy(model), forward)
    assert not torch.equal(training_step(copy.deepcopy(model), forward, seed=8)[0], expected)  # the masks are drawn
    vitprune.patch(model, keep_rate=1.0, stages="all", class_only_last=False)
    got, grads = training_step(model, forward)
    assert torch.equal(got, expected)
    assert grads.keys() == expected_grads.keys()
    assert all(torch.equal(grads[n], expected_grads[n]) for n in grads)


def onnxruntime_output(model, x, folder):
    """``model`` exported with ``torch.onnx.export(..., dynamo=True)`` into ``folder`` and run
    on ``x`` by onnxruntime (a skip where onnxruntime or onnxscript is missing)."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    path = str(folder / "pruned.onnx")
    torch.onnx.export(model, (x,), path, dynamo=True, verbose=False)
    session = ort.InferenceSession(path)
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


@pytest.fixture
def tiny() -> torch.nn.Module:
    return make_model("deit_tiny")


#: A tiny ``transformers`` vision config: 4 layers of width 32 on 32 x 32 images of 8 x 8 patches.
HF_SIZES = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=64)


def require_transformers():
    """The ``transformers`` module, or a skip of the calling test module when it is missing
    or older than the release vitprune supports."""
    transformers = pytest.importorskip("transformers")
    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if release < (5, 24):
        pytest.skip(f"vitprune supports transformers >= 5.24, found {transformers.__version__}",
                    allow_module_level=True)
    return transformers


@pytest.fixture
def rgb_tree(tmp_path):
    """A folder tree of 3 classes x 4 random 70 x 90 RGB JPEGs."""
    import numpy as np
    from PIL import Image

    root = tmp_path / "tree"
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (70, 90, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{i}.jpg")
    return root
