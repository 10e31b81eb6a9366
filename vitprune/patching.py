"""``patch`` and ``unpatch``: turn pruning on and off in a timm ViT, in place."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import torch
from torch import nn
from timm.layers import AttentionPoolLatent
from timm.models.beit import Beit
from timm.models.eva import Eva
from timm.models.vision_transformer import ParallelScalingBlock, ParallelThingsBlock, VisionTransformer
from timm.models.vision_transformer_relpos import VisionTransformerRelPos

from .blocks import BLOCK_ATTRS, PRUNE_BLOCKS, SUPPORTED_ATTENTION, attention_modules
from .config import SPREAD, PruneConfig
from .models import PRUNE_MODELS
from .relpos import BIAS_ATTENTION, BIAS_BLOCKS
from .rope import ROPE_ATTENTION, ROPE_BLOCKS
from .overlap import apply_overlap, check_overlap, remove_overlap
from .state import PruneState

#: Model classes ``patch`` accepts (exact type match).
SUPPORTED_MODELS = tuple(PRUNE_MODELS)

#: Why known model families cannot be pruned by this version, by class name.
UNSUPPORTED_REASONS = {
    "NaFlexVit": "it packs variable-resolution images with per-image padding masks; dropping tokens "
                 "would have to follow each image's mask, which this version does not do",
    "Hiera": "it is hierarchical: its mask-unit attention and pooling stages need the full token grid",
    "Xcit": "its cross-covariance attention mixes channels, not tokens: there is no per-patch "
            "attention to score, and its local patch interaction needs the full grid",
    "VisionTransformerSAM": "its windowed attention blocks partition the full token grid into windows",
    "Cait": "its patch tokens never attend to the class token (it joins only in the last class-attention "
            "blocks), so the self-attention blocks have no class-token row to score",
    "SwinTransformer": "its windowed attention and patch merging need the full token grid",
    "PyramidVisionTransformerV2": "it is hierarchical (spatial-reduction attention on the full grid)",
    "Twins": "its locally-grouped attention needs the full token grid",
    "MultiScaleVit": "its pooling attention and stages need the full token grid",
}

#: Pooling modes for which a fusion token is harmless: token and none read only prefix
#: tokens; avg and avgmax weight tokens by patch count; map weights its attention the same.
SUPPORTED_POOLS = ("token", "", "avg", "avgmax", "max", "map")

MODEL_ATTR = "vitprune_state"
_ALL_BLOCKS = {**PRUNE_BLOCKS, **ROPE_BLOCKS, **BIAS_BLOCKS}
_ORIGINAL_BLOCKS = {pruned: original for original, pruned in _ALL_BLOCKS.items()}
_ORIGINAL_MODELS = {pruned: original for original, pruned in PRUNE_MODELS.items()}
_OPTIONS = tuple(f.name for f in dataclasses.fields(PruneConfig))


def _supported_names() -> str:
    return ", ".join(f"timm {cls.__name__}" for cls in SUPPORTED_MODELS)


def check_model(model: nn.Module) -> None:
    """Raise ``TypeError`` unless ``model`` is a ViT this version can prune."""
    kind = _ORIGINAL_MODELS.get(type(model), type(model))
    if kind not in SUPPORTED_MODELS:
        reason = UNSUPPORTED_REASONS.get(kind.__name__)
        why = f": {reason}" if reason else ""
        raise TypeError(
            f"vitprune cannot patch a {kind.__module__}.{kind.__name__}{why}; supported: "
            f"{_supported_names()} (vit_*, deit_*, deit3_*, CLIP, SigLIP and DINOv2 towers, flexivit, "
            "hybrids; eva02_*, rope ViTs, DINOv3 and PE on timm's Eva; beit*, vit_relpos_*)"
        )
    if model.global_pool not in SUPPORTED_POOLS:
        raise TypeError(
            f"vitprune supports global_pool in {SUPPORTED_POOLS}, got {model.global_pool!r}: "
            "this pooling would treat the fusion token as a single patch"
        )
    if model.global_pool in ("avg", "avgmax", "map") and "pool" not in vars(VisionTransformer):
        raise TypeError(
            f"vitprune weights global_pool={model.global_pool!r} by patch count through "
            "VisionTransformer.pool, which this timm version lacks; upgrade timm"
        )
    attn_pool = getattr(model, "attn_pool", None)
    if attn_pool is not None and (type(attn_pool) is not AttentionPoolLatent or attn_pool.pos_embed is not None):
        raise TypeError(
            f"vitprune supports attention pooling by timm's AttentionPoolLatent without a position "
            f"embedding (global_pool='map'), got {type(attn_pool).__name__}: its input must stay a full grid"
        )


def _original_block_type(block: nn.Module) -> type:
    return _ORIGINAL_BLOCKS.get(type(block), type(block))


#: Families whose position terms (rope, relative bias) live inside every block: all their
#: blocks from the first stage on are swapped, with these subclasses.
FOLLOWING_BLOCKS = {Eva: ROPE_BLOCKS, Beit: BIAS_BLOCKS, VisionTransformerRelPos: BIAS_BLOCKS}


def _family(model: nn.Module) -> type:
    return _ORIGINAL_MODELS.get(type(model), type(model))


def _swap_plan(model: nn.Module, stages: "tuple[int, ...]",
               size_aware: bool = False) -> "dict[int, tuple[Optional[int], Optional[int]]]":
    """Which blocks ``patch`` swaps: index -> (stage number or ``None``, stage whose output
    the block receives or ``None``). ViT blocks: the stage blocks, and with ``size_aware``
    every block after the first stage (they add the size bias). Rope and bias families:
    every block from the first stage on, since each must gather its tokens' position terms."""
    every = _family(model) in FOLLOWING_BLOCKS or size_aware
    plan, last = {}, None
    for index in range(stages[0] if stages else len(model.blocks), len(model.blocks)):
        number = stages.index(index) if index in stages else None
        if number is not None or every:
            plan[index] = (number, last)
        last = number if number is not None else last
    return plan


def _check_blocks(model: nn.Module, plan: "dict[int, tuple[Optional[int], Optional[int]]]") -> None:
    """Raise ``TypeError`` unless every block to swap, and the attention it runs, are known exactly."""
    family = _family(model)
    known_blocks = FOLLOWING_BLOCKS.get(family, PRUNE_BLOCKS)
    accepted = {Eva: ROPE_ATTENTION, Beit: BIAS_ATTENTION, VisionTransformerRelPos: BIAS_ATTENTION}.get(
        family, (SUPPORTED_ATTENTION,))
    for index, (number, _) in plan.items():
        block = model.blocks[index]
        original = _original_block_type(block)
        if original not in known_blocks:
            known = ", ".join(cls.__name__ for cls in known_blocks)
            raise TypeError(f"block {index} is a {original.__name__}; vitprune can prune in: {known}")
        if number is None and family is Eva:
            continue  # a following Eva block runs timm's own forward
        attentions = attention_modules(block) if family not in FOLLOWING_BLOCKS else {"attn": block.attn}
        for name, attn in attentions.items():
            if type(attn) not in accepted:
                raise TypeError(
                    f"block {index} uses attention {type(attn).__name__} ({name}); vitprune can prune "
                    f"{original.__name__} blocks with timm's {' or '.join(a.__name__ for a in accepted)}"
                )


#: Indicators that measure disagreement between heads: one head gives every patch score 0.
HEAD_SPREAD_INDICATORS = ("var", "medad", "lowvar")


def scored_heads(block: nn.Module) -> int:
    """How many attention heads a pruning block's scored row has (parallel attentions joined)."""
    if isinstance(block, ParallelScalingBlock):
        return block.num_heads
    if isinstance(block, ParallelThingsBlock):
        return sum(branch.attn.num_heads for branch in block.attns)
    return block.attn.num_heads


def _check_heads(model: nn.Module, config: PruneConfig) -> None:
    """Raise ``ValueError`` when the indicator compares heads and a stage block has one."""
    if config.indicator not in HEAD_SPREAD_INDICATORS:
        return
    for index in config.stages:
        heads = scored_heads(model.blocks[index])
        if heads < 2:
            raise ValueError(
                f"indicator={config.indicator!r} measures how attention heads disagree, but block {index} "
                f"has {heads} head, so every patch would score 0; use indicator='cls' or the default "
                "(indicator=None: bipartite merging)"
            )


def _patch_count(model: nn.Module, config: PruneConfig) -> Optional[int]:
    """Patch tokens at the model's own input size (after ``overlap_stride``), for the
    ``"spread"`` schedule; ``None`` when the embedding does not say."""
    from .flops import num_patches  # flops imports this module

    if config.stages != SPREAD:
        return None
    try:
        return num_patches(model, None, config.overlap_stride)
    except (AttributeError, TypeError):
        return int(model.patch_embed.num_patches)


def check_options(options: "dict[str, Any]") -> None:
    """Raise ``TypeError`` naming any key of ``options`` that is not a :class:`PruneConfig` field."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; accepted: {', '.join(_OPTIONS)}")


def _make_config(config: Optional[PruneConfig], options: "dict[str, Any]") -> PruneConfig:
    check_options(options)
    if config is None:
        return PruneConfig(**options)
    if not isinstance(config, PruneConfig):
        raise TypeError(f"config must be a vitprune.PruneConfig, got {type(config).__name__}")
    return dataclasses.replace(config, **options)


def _make_generator(config: PruneConfig, generator: Optional[torch.Generator]) -> Optional[torch.Generator]:
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if config.indicator != "random":
            raise ValueError(f"generator only applies to indicator='random', not {config.indicator!r}")
        if config.seed is not None:
            raise ValueError("pass either seed or generator, not both")
        return generator
    if config.seed is not None:
        return torch.Generator().manual_seed(config.seed)
    return None


def patch(
        model: nn.Module,
        config: Optional[PruneConfig] = None,
        /,
        *,
        generator: Optional[torch.Generator] = None,
        **options: Any,
) -> nn.Module:
    """Make ``model`` reduce its patch tokens, in place, and return it.

    Everything is validated before the model is touched: on any error the model is
    exactly as it was. Patching a patched model replaces the previous patch. The
    defaults are the configuration our experiments found most accurate at equal FLOPs
    (bipartite matching, merging into the most similar kept token, size-aware
    attention; docs/method.md §9); the paper's method is
    ``indicator="var", selection="top", reduction="fuse", size_aware=False``.

    Args:
        model: A timm ViT of a supported family (``SUPPORTED_MODELS``; README,
            "Supported models"). With a class token the indicators score its attention
            row; without one, the mean attention each patch receives.
        config: A :class:`PruneConfig`; ``options`` override its fields.
        generator: Generator for ``indicator="random"`` (instead of ``seed``).
        **options: :class:`PruneConfig` fields: ``indicator``, ``keep_rate``, ``stages``,
            ``T``, ``selection``, ``reduction``, ``size_aware``, ``fuse``, ``seed``,
            ``overlap_stride``.

    Returns:
        The same model object.

    Raises:
        TypeError: The model, a block, or an option is not of a supported kind.
        ValueError: An option's value is out of range for this model.

    Example:
        >>> model = timm.create_model("deit_small_patch16_224")
        >>> vitprune.patch(model, keep_rate=0.7)
        >>> vitprune.patch(model, indicator="var", keep_rate=0.7, stages=(3, 6, 9),
        ...                selection="top", reduction="fuse", size_aware=False)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = _make_config(config, options)
    check_model(model)
    cfg = cfg.resolve(len(model.blocks), _patch_count(model, cfg))
    plan = _swap_plan(model, cfg.stages, cfg.size_aware)
    _check_blocks(model, plan)
    _check_heads(model, cfg)
    gen = _make_generator(cfg, generator)
    if cfg.overlap_stride is not None and not isinstance(model, VisionTransformer):
        raise TypeError(f"overlap_stride is supported for VisionTransformer models only, not {_family(model).__name__}")
    if cfg.overlap_stride is not None:
        previous = model.__dict__.get(MODEL_ATTR)
        check_overlap(model, cfg.overlap_stride, None if previous is None else previous.overlap)

    unpatch(model)
    source = "cls" if getattr(model, "cls_token", None) is not None else "mean"
    state = PruneState(cfg, model.num_prefix_tokens, gen, row_source=source)
    if cfg.overlap_stride is not None:
        state.overlap = apply_overlap(model, cfg.overlap_stride)
    setattr(model, MODEL_ATTR, state)
    model.__class__ = PRUNE_MODELS[type(model)]
    for index, (number, follow) in plan.items():
        block = model.blocks[index]
        block.__class__ = _ALL_BLOCKS[type(block)]
        block.vitprune_state = state
        block.vitprune_stage = number
        block.vitprune_follow = follow
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` in place and return the model; a no-op on an unpatched model.

    Restores every block's original class, the patch embedding and position embedding
    (with ``overlap_stride``, in the dtype and on the device the model has now), and
    deletes every attribute the patch added. ``model`` may also hold patched models (an
    ``nn.Sequential`` around one, say): each of them is unpatched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for module in list(model.modules()):
        original = _ORIGINAL_BLOCKS.get(type(module))
        if original is not None:
            module.__class__ = original
            for name in BLOCK_ATTRS:
                module.__dict__.pop(name, None)
        elif MODEL_ATTR in module.__dict__:  # a patched model
            state = module.__dict__.pop(MODEL_ATTR)
            if state.overlap is not None:
                remove_overlap(module, state.overlap)
            module.__class__ = _ORIGINAL_MODELS.get(type(module), type(module))
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` is currently patched by vitprune."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return MODEL_ATTR in model.__dict__ and type(model) in _ORIGINAL_MODELS


def state_of(model: nn.Module) -> PruneState:
    """The :class:`PruneState` of a patched model; ``ValueError`` for an unpatched one."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    state = model.__dict__.get(MODEL_ATTR)
    if state is None:
        raise ValueError("this model is not patched by vitprune; call vitprune.patch(model, ...) first")
    return state


def get_config(model: nn.Module) -> PruneConfig:
    """The active config of a patched model, with explicit stages and per-stage keep rates."""
    return state_of(model).config


def kept_positions(model: nn.Module) -> List[torch.Tensor]:
    """Which original patches survive each stage of the last forward.

    Returns:
        One ``(B, n_s)`` long tensor per stage, in stage order: for each non-prefix token
        after stage ``s``, the index (row-major over the patch grid) of the patch token it
        was when it entered the first block, or ``-1`` for the fusion token. Empty before
        the first forward.
    """
    return state_of(model).kept_positions()
