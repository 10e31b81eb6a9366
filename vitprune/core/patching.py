"""``patch`` and ``unpatch``: turn pruning on and off in a timm ViT, in place."""

from __future__ import annotations

import dataclasses
from typing import Any, List, NoReturn, Optional, Sequence, Union

import torch
from torch import nn

from .. import families as _registered  # noqa: F401  (importing it registers the timm families)
from .config import Indicator, PruneConfig, Reduction, Selection, Stages, is_spread
from .hooks import bypassed, warn_of_bypassed_hooks
from .overlap import apply_overlap, check_overlap, remove_overlap
from .registry import (BLOCK_ATTRS, REFUSED, SHARDED, Family, families, family_of, grid_patches, holds_patch,
                       is_patched_model, is_pruning_block, original_block_class, original_model_class, sharded)
from .state import PruneState

MODEL_ATTR = "vitprune_state"
_OPTIONS = tuple(f.name for f in dataclasses.fields(PruneConfig))

#: Indicators that measure disagreement between heads: one head gives every patch score 0.
HEAD_SPREAD_INDICATORS = ("var", "medad", "lowvar")


def supported_models() -> "tuple[type, ...]":
    """The model classes ``patch`` accepts (exact type match), from the family registry."""
    return tuple(family.model for family in families())


def check_model(model: nn.Module) -> Family:
    """The family of ``model``; ``TypeError`` unless it is a ViT this version can prune."""
    shard = sharded(model)  # fully_shard's class, even of a patched model: patch before sharding
    family = None if shard else family_of(model)
    if family is None:
        kind = original_model_class(model)
        reason = SHARDED if shard else REFUSED.get(kind.__name__)
        why = f": {reason}" if reason else ""
        names = ", ".join(f"{f.library} {f.model.__name__}" for f in families())
        examples = "; ".join(dict.fromkeys(f.examples for f in families() if f.examples))
        raise TypeError(f"vitprune cannot patch a {kind.__module__}.{kind.__name__}{why}; supported: {names} "
                        f"({examples})")
    if len(family.blocks_of(model)) == 0:
        raise TypeError(f"this {family.model.__name__} has no transformer blocks (depth 0): nothing to prune")
    family.check(model)
    return family


def _swap_plan(family: Family, depth: int, stages: "tuple[int, ...]",
               size_aware: bool = False, class_only: bool = False) -> "dict[int, tuple[Optional[int], Optional[int]]]":
    """Which blocks ``patch`` swaps: index -> (stage number or ``None``, stage whose output
    the block receives or ``None``): the stage blocks, every block after the first
    stage where the family's blocks follow the tokens or with ``size_aware`` (they add
    the size bias), and with ``class_only`` the last block."""
    every = family.follows or size_aware
    plan: "dict[int, tuple[Optional[int], Optional[int]]]" = {}
    last: Optional[int] = None
    for index in range(stages[0] if stages else depth, depth):
        number = stages.index(index) if index in stages else None
        if number is not None or every:
            plan[index] = (number, last)
        last = number if number is not None else last
    if class_only and depth - 1 not in plan:
        plan[depth - 1] = (None, last)
    return plan


def settle_class_only(model: nn.Module, config: PruneConfig, family: Family) -> PruneConfig:
    """``config`` for ``model`` (of ``family``) with ``class_only_last=None`` made definite (on
    where the family allows it and no explicit stage is the last block, see
    :meth:`PruneConfig.settle_class_only`); ``TypeError`` when it is ``True`` and the model
    cannot take it."""
    reason = family.class_only_refusal(model)
    if config.class_only_last and reason is not None:
        raise TypeError(f"class_only_last=True cannot apply to this {family.model.__name__}: {reason}; "
                        "leave class_only_last=None (on where exact) or False")
    return config.settle_class_only(reason is None, len(family.blocks_of(model)))


def _check_blocks(model: nn.Module, family: Family, plan: "dict[int, tuple[Optional[int], Optional[int]]]") -> None:
    """Raise ``TypeError`` unless every block to swap, and the attention it runs, are known exactly."""
    for index, (number, _) in plan.items():
        block = family.blocks_of(model)[index]
        original = original_block_class(block)
        if original not in family.blocks:
            known = ", ".join(cls.__name__ for cls in family.blocks)
            why = f" ({SHARDED})" if sharded(block) else ""
            raise TypeError(f"block {index} is a {original.__name__}{why}; vitprune can prune in: {known}")
        if number is None and not family.check_followers:
            continue  # a block that only follows runs its own forward
        for name, attn in family.foreign_attention(block).items():
            accepted = " or ".join(a.__name__ for a in family.attention)
            raise TypeError(
                f"block {index} uses attention {type(attn).__name__} ({name}); vitprune can prune "
                f"{original.__name__} blocks with timm's {accepted}"
            )


def _skips_attention(family: Family, block: nn.Module, stage: Optional[int], prefix_only: bool) -> bool:
    """Whether a swapped ``block`` runs its attention's layers itself in some call: at a stage
    (``stage``), as the last block computing the prefix tokens alone (``prefix_only``), or as
    a follower in a family whose followers do (timm's ViT and Eva blocks run timm's forward)."""
    pruning = family.blocks[original_block_class(block)]
    return stage is not None or prefix_only or not getattr(pruning, "vitprune_follower_runs_timm")  # PruningBlock's


def _check_heads(model: nn.Module, family: Family, config: PruneConfig) -> None:
    """Raise ``ValueError`` when the indicator compares heads and a stage block has one."""
    if config.indicator not in HEAD_SPREAD_INDICATORS:
        return
    for index in config.schedule()[0]:
        heads = family.heads(family.blocks_of(model)[index])
        if heads < 2:
            raise ValueError(
                f"indicator={config.indicator!r} measures how attention heads disagree, but block {index} "
                f"has {heads} head, so every patch would score 0; use indicator='cls' or the default "
                "(indicator=None: bipartite merging)"
            )


def spread_patches(model: nn.Module, family: Optional[Family], config: PruneConfig) -> Optional[int]:
    """The patch count ``config`` is resolved for: the model's own (after ``overlap_stride``)
    for the spread schedules, at every input size; ``None`` for other schedules. A model
    of no family counts its patches as a family does by default (the FLOP count's what-if)."""
    if not is_spread(config.stages):
        return None
    return (grid_patches if family is None else family.patches_of)(model, config.overlap_stride)


def check_model_overlap(model: nn.Module, family: Family, stride: int) -> None:
    """Raise ``TypeError`` or ``ValueError`` unless ``model`` can take ``overlap_stride=stride``."""
    if not family.overlap:
        bases = [f.model for f in families() if f.overlap]
        names = " or ".join(c.__name__ for c in bases if not any(c is not b and issubclass(c, b) for b in bases))
        raise TypeError(f"overlap_stride is supported for {names} models only (an absolute position "
                        f"embedding), not {family.model.__name__}")
    previous = model.__dict__.get(MODEL_ATTR)
    check_overlap(model, stride, None if previous is None else previous.overlap)


def check_options(options: "dict[str, Any]") -> None:
    """Raise ``TypeError`` naming any key of ``options`` that is not a :class:`PruneConfig` field."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; accepted: {', '.join(_OPTIONS)}")


class _Default:
    """The default of a ``patch`` keyword: the field of ``config``, or of ``PruneConfig()``."""

    def __repr__(self) -> str:
        return "<default>"


DEFAULT: Any = _Default()


def _make_config(config: Optional[PruneConfig], options: "dict[str, Any]") -> PruneConfig:
    options = {name: value for name, value in options.items() if value is not DEFAULT}
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
        indicator: Optional[Indicator] = DEFAULT,
        keep_rate: Union[float, Sequence[float]] = DEFAULT,
        stages: Stages = DEFAULT,
        T: float = DEFAULT,
        selection: Optional[Selection] = DEFAULT,
        reduction: Optional[Reduction] = DEFAULT,
        size_aware: bool = DEFAULT,
        crowding: Optional[float] = DEFAULT,
        class_only_last: Optional[bool] = DEFAULT,
        overlap_stride: Optional[int] = DEFAULT,
        seed: Optional[int] = DEFAULT,
        fuse: Optional[bool] = DEFAULT,
        generator: Optional[torch.Generator] = None,
        **unknown: NoReturn,
) -> nn.Module:
    """Make ``model`` reduce its patch tokens, in place, and return it.

    Everything is validated before the model is touched: on any error the model is
    exactly as it was. Patching a patched model replaces the previous patch. The
    defaults are the configuration our experiments found most accurate at equal FLOPs
    (bipartite matching, merging into the most similar kept token, size-aware
    attention, every block, and the class token alone through the last block where the
    head reads nothing else; docs/method.md §9, §10); the paper's method is
    ``indicator="var", stages=None, selection="top", reduction="fuse", size_aware=False,
    class_only_last=False``.
    Every keyword is a :class:`PruneConfig` field (see it for the accepted values) except
    ``generator``; one left out takes ``config``'s value, or ``PruneConfig``'s default.

    Args:
        model: A timm ViT of a supported family (``SUPPORTED_MODELS``; README,
            "Supported models"). With a class token the indicators score its attention
            row; without one, the mean attention each patch receives.
        config: A :class:`PruneConfig`; the keywords given override its fields.
        indicator: What scores the patches: ``"var"``, ``"medad"`` (the paper's), ``"cls"``,
            ``"random"``, ``"lowvar"``; ``None`` (default): no score, bipartite matching.
        keep_rate: Fraction of the patch tokens each stage keeps, in (0, 1] (default
            0.7), or one rate per stage.
        stages: ``"spread"`` (default: every block, at the rate whose token count matches
            the paper's three stages at ``keep_rate``), ``"spread2"`` or ``"spread3"`` (the
            same in every second or third block: faster at batch 1), ``"all"``, ``None``
            (the paper's blocks 3, 6, 9 scaled to the depth) or block indices.
        T: Temperature of the fusion token's weights, > 0 (default 1.0; ``math.inf``: mean);
            ``reduction="fuse"`` only.
        selection: ``"top"``, ``"redundant"`` or ``"bipartite"``; default: ``"bipartite"``
            without an indicator, ``"top"`` with one.
        reduction: ``"merge"`` (default), ``"fuse"`` (the paper's fusion token) or ``"drop"``.
        size_aware: Add ``log(size)`` to the attention logits of merged tokens (default True).
        crowding: Bipartite matching: weight of each candidate's crowding (its near copies
            among the destinations) in the order candidates go; ``0``: token merging's.
        class_only_last: In ``forward``, the last block computes the prefix tokens only,
            which is all a ``global_pool="token"`` head reads: the same logits for most of that
            block's FLOPs. ``None`` (default): on where exact and no explicit stage is the last
            block; ``True``: on or refused; ``False``: off.
        overlap_stride: Give the patch embedding this stride (overlapping patches).
        seed: Seed of the ``"random"`` indicator.
        fuse: The first release's switch (``True``: ``reduction="fuse"``, ``False``: ``"drop"``).
        generator: Generator for ``indicator="random"`` (instead of ``seed``).
        **unknown: Refused with a ``TypeError`` that lists the accepted options.

    Returns:
        The same model object.

    Raises:
        TypeError: The model, a block, or an option is not of a supported kind.
        ValueError: An option's value is out of range for this model.

    Example:
        >>> model = timm.create_model("deit_small_patch16_224")
        >>> vitprune.patch(model, keep_rate=0.7)
        >>> vitprune.patch(model, indicator="var", keep_rate=0.7, stages=(3, 6, 9),
        ...                selection="top", reduction="fuse", size_aware=False, class_only_last=False)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_options(unknown)  # a clear message naming the accepted options, not Python's
    cfg = _make_config(config, dict(
        indicator=indicator, keep_rate=keep_rate, stages=stages, T=T, selection=selection, reduction=reduction,
        size_aware=size_aware, crowding=crowding, class_only_last=class_only_last, overlap_stride=overlap_stride,
        seed=seed, fuse=fuse))
    family = check_model(model)
    blocks = family.blocks_of(model)
    cfg = settle_class_only(model, cfg, family)
    cfg = cfg.resolve(len(blocks), spread_patches(model, family, cfg))
    plan = _swap_plan(family, len(blocks), cfg.schedule()[0], cfg.size_aware, bool(cfg.class_only_last))
    _check_blocks(model, family, plan)
    _check_heads(model, family, cfg)
    gen = _make_generator(cfg, generator)
    if cfg.overlap_stride is not None:
        check_model_overlap(model, family, cfg.overlap_stride)
    prefix = next((name for name, module in model.named_modules() if module is blocks), "blocks")
    last = len(blocks) - 1 if cfg.class_only_last else None
    where = {index: bypassed(family, blocks[index], f"{prefix}.{index}")
             if _skips_attention(family, blocks[index], plan[index][0], index == last) else ()
             for index in sorted(plan)}
    warn_of_bypassed_hooks(blocks, where)

    unpatch(model)
    source = "cls" if family.class_token_of(model) else "mean"
    state = PruneState(cfg, family.prefix_of(model), gen, row_source=source)
    if cfg.overlap_stride is not None:
        state.overlap = apply_overlap(model, cfg.overlap_stride)
    setattr(model, MODEL_ATTR, state)
    model.__class__ = family.patched
    swaps = [(blocks[index], number, follow, where[index]) for index, (number, follow) in plan.items()]
    for module, number, follow, skipped in swaps + [(extra, None, None, ()) for extra in family.extras(model)]:
        module.__class__ = family.blocks[type(module)]
        for name, value in (("vitprune_state", state), ("vitprune_stage", number), ("vitprune_follow", follow),
                            ("vitprune_bypassed", skipped)):
            setattr(module, name, value)
    if cfg.class_only_last:
        setattr(blocks[-1], "vitprune_class_only", True)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` in place and return the model; a no-op on an unpatched model.

    Restores every block's original class, the patch embedding and position embedding
    (with ``overlap_stride``, in the dtype and on the device the model has now), and
    deletes every attribute the patch added. ``model`` may also hold patched models (an
    ``nn.Sequential`` around one, say): each of them is unpatched.

    Raises:
        TypeError: ``fully_shard`` (FSDP2) was applied after ``patch`` (nothing is changed).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    held = next((name for name, module in model.named_modules() if sharded(module) and holds_patch(module)), None)
    if held is not None:  # its class is fully_shard's subclass of vitprune's: restoring one would drop the other
        raise TypeError(f"vitprune cannot unpatch {held or 'the model'}: {SHARDED}")
    for module in list(model.modules()):
        if is_pruning_block(module):
            module.__class__ = original_block_class(module)
            for name in BLOCK_ATTRS:
                module.__dict__.pop(name, None)
        elif is_patched_model(module):
            state = module.__dict__.pop(MODEL_ATTR, None)
            if state is not None and state.overlap is not None:
                remove_overlap(module, state.overlap)
            module.__class__ = original_model_class(module)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` is currently patched by vitprune."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return MODEL_ATTR in model.__dict__ and holds_patch(model)  # fully_shard subclasses the patched class


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


def token_groups(model: nn.Module) -> List[torch.Tensor]:
    """Which token holds each original patch after every stage of the last forward: the
    groups that merging (and fusion) made.

    Returns:
        One ``(B, N)`` long tensor per stage, in stage order, ``N`` the patch tokens that
        entered the first block: for each patch, the index of the non-prefix token that
        holds it after stage ``s`` (patches with the same index were merged into one token;
        the fusion token is the last index), or ``-1`` once it was dropped. A kept patch
        ``p`` at ``kept_positions(model)[s][b, i]`` has group ``i``; with size-tracking
        reductions the count of patches per group is the token's size.

    Raises:
        ValueError: The model is not patched, or no forward has run on this thread.
        RuntimeError: The last forward was compiled, exported or traced: groups are
            recorded by eager forwards only.
    """
    groups = state_of(model).token_groups()
    if not groups:
        raise ValueError("no forward has run on this thread since patching: run one, then read the groups")
    return groups
