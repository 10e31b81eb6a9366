"""``patch`` and ``unpatch``: turn pruning on and off in a timm ViT, in place."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import torch
from torch import nn
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

from .blocks import BLOCK_ATTRS, PRUNE_BLOCKS, SUPPORTED_ATTENTION
from .config import PruneConfig
from .overlap import apply_overlap, check_overlap, remove_overlap
from .state import PruneState

#: Model classes ``patch`` accepts (exact type match).
SUPPORTED_MODELS = (VisionTransformer, VisionTransformerDistilled)

#: Pooling modes that read only prefix tokens (or none), so a fusion token cannot skew them.
SUPPORTED_POOLS = ("token", "")

MODEL_ATTR = "vitprune_state"
_ORIGINAL_BLOCKS = {pruned: original for original, pruned in PRUNE_BLOCKS.items()}
_OPTIONS = tuple(f.name for f in dataclasses.fields(PruneConfig))


def _supported_names() -> str:
    return ", ".join(f"timm {cls.__name__}" for cls in SUPPORTED_MODELS)


def _check_model(model: nn.Module) -> None:
    """Raise ``TypeError`` unless ``model`` is a ViT this version can prune."""
    if type(model) not in SUPPORTED_MODELS:
        raise TypeError(
            f"vitprune cannot patch a {type(model).__module__}.{type(model).__name__}; "
            f"supported: {_supported_names()} (vit_*, deit_*, deit3_* models and others built on them)"
        )
    if getattr(model, "cls_token", None) is None:
        raise TypeError(
            "vitprune needs a class token: the indicators score patches by the class token's "
            "attention, and this model has none (class_token=False)"
        )
    if getattr(model, "attn_pool", None) is not None or model.global_pool not in SUPPORTED_POOLS:
        raise TypeError(
            f"vitprune supports global_pool in {SUPPORTED_POOLS}, got {model.global_pool!r}: pooling "
            "over patch tokens would count the fusion token as a single patch"
        )


def _original_block_type(block: nn.Module) -> type:
    return _ORIGINAL_BLOCKS.get(type(block), type(block))


def _check_blocks(model: nn.Module, stages: "tuple[int, ...]") -> None:
    """Raise ``TypeError`` unless every stage block and its attention are known exactly."""
    for index in stages:
        block = model.blocks[index]
        original = _original_block_type(block)
        if original not in PRUNE_BLOCKS:
            known = ", ".join(cls.__name__ for cls in PRUNE_BLOCKS)
            raise TypeError(f"block {index} is a {original.__name__}; vitprune can prune in: {known}")
        attn_type = SUPPORTED_ATTENTION[original]
        if type(block.attn) is not attn_type:
            raise TypeError(
                f"block {index} uses attention {type(block.attn).__name__}; vitprune can prune "
                f"{original.__name__} blocks with timm's {attn_type.__name__}"
            )


def _make_config(config: Optional[PruneConfig], options: "dict[str, Any]") -> PruneConfig:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; accepted: {', '.join(_OPTIONS)}")
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
    """Make ``model`` prune patch tokens, in place, and return it.

    Everything is validated before the model is touched: on any error the model is
    exactly as it was. Patching a patched model replaces the previous patch.

    Args:
        model: A timm ``VisionTransformer`` (or distilled DeiT) with a class token.
        config: A :class:`PruneConfig`; ``options`` override its fields.
        generator: Generator for ``indicator="random"`` (instead of ``seed``).
        **options: :class:`PruneConfig` fields: ``indicator``, ``keep_rate``, ``stages``,
            ``T``, ``fuse``, ``seed``, ``overlap_stride``.

    Returns:
        The same model object.

    Raises:
        TypeError: The model, a block, or an option is not of a supported kind.
        ValueError: An option's value is out of range for this model.

    Example:
        >>> model = timm.create_model("deit_small_patch16_224")
        >>> vitprune.patch(model, indicator="var", keep_rate=0.7, stages=(3, 6, 9))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = _make_config(config, options)
    _check_model(model)
    cfg = cfg.resolve(len(model.blocks))
    _check_blocks(model, cfg.stages)
    gen = _make_generator(cfg, generator)
    if cfg.overlap_stride is not None:
        previous = model.__dict__.get(MODEL_ATTR)
        check_overlap(model, cfg.overlap_stride, None if previous is None else previous.overlap)

    unpatch(model)
    state = PruneState(cfg, model.num_prefix_tokens, gen)
    if cfg.overlap_stride is not None:
        state.overlap = apply_overlap(model, cfg.overlap_stride)
    setattr(model, MODEL_ATTR, state)
    for number, index in enumerate(cfg.stages):
        block = model.blocks[index]
        block.__class__ = PRUNE_BLOCKS[type(block)]
        block.vitprune_state = state
        block.vitprune_stage = number
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` in place and return the model; a no-op on an unpatched model.

    Restores every block's original class, the patch embedding and position embedding
    (with ``overlap_stride``), and deletes every attribute the patch added.
    """
    state = model.__dict__.get(MODEL_ATTR)
    if state is not None and state.overlap is not None:
        remove_overlap(model, state.overlap)
    for block in model.modules():
        original = _ORIGINAL_BLOCKS.get(type(block))
        if original is not None:
            block.__class__ = original
            for name in BLOCK_ATTRS:
                block.__dict__.pop(name, None)
    model.__dict__.pop(MODEL_ATTR, None)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` is currently patched by vitprune."""
    return MODEL_ATTR in model.__dict__


def _state(model: nn.Module) -> PruneState:
    state = model.__dict__.get(MODEL_ATTR)
    if state is None:
        raise ValueError("this model is not patched by vitprune; call vitprune.patch(model, ...) first")
    return state


def get_config(model: nn.Module) -> PruneConfig:
    """The active config of a patched model, with explicit stages and per-stage keep rates."""
    return _state(model).config


def kept_positions(model: nn.Module) -> List[torch.Tensor]:
    """Which original patches survive each stage of the last forward.

    Returns:
        One ``(B, n_s)`` long tensor per stage, in stage order: for each non-prefix token
        after stage ``s``, the index (row-major over the patch grid) of the patch token it
        was when it entered the first block, or ``-1`` for the fusion token. Empty before
        the first forward.
    """
    return _state(model).kept_positions()
