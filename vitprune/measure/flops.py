"""FLOP counts, in fvcore's convention (one multiply-add = one flop).

Two independent counts that cross-check each other:

- :func:`count_flops` traces the model with fvcore. fvcore has no handle for
  ``aten::scaled_dot_product_attention``, which timm uses, nor for a convolution with
  string padding (SigLIP's patch embedding), and would silently count them as zero; we
  register both.
- :func:`analytic_flops` counts the matrix products from the token schedule: patch
  embedding, per block the qkv / attention / projection / MLP products at the number of
  tokens each sees, the scoring row and fusion in pruning blocks, and the head. Norms,
  activations and softmaxes are left out (fvcore counts norms: about 0.2 %). It covers
  every family vitprune patches (timm and ``transformers``); a pooling attention after the
  blocks is counted at the tokens it reads, and a hybrid's CNN stem by the products of one
  image through it (``core.stem``: its cost does not depend on pruning).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from timm.layers import AttentionPoolLatent, RelPosMlp
from timm.models.vision_transformer import Block, ParallelScalingBlock, ResPostBlock
from torch import nn

from ..core.config import PruneConfig, token_counts
from ..core.grid import forward_options, num_patches, patch_conv, runnable_size
from ..core.merging import bipartite_rounds
from ..core.patching import get_config, is_patched, spread_patches
from ..core.modes import evaluating
from ..core.registry import Family, attention_heads, family_of, original_block_class, own_attention
from ..core.stem import run_stem, stem_of


@dataclass(frozen=True)
class BlockTokens:
    """Tokens one block sees: ``attn`` in its attention, ``mlp`` in its MLP (fewer after pruning)."""

    attn: int
    mlp: int


def token_schedule(config: Optional[PruneConfig], depth: int, num_prefix: int, num_patches: int) -> List[BlockTokens]:
    """The tokens each block sees under ``config`` (``None``: unpruned); a spread
    config is resolved for ``num_patches`` (:func:`flop_counter` passes it resolved for the
    model's own size, as ``patch`` does)."""
    counts = (num_patches,) * depth
    if config is not None:
        stages, rates = config.resolve(depth, num_patches).schedule()
        counts = token_counts(rates, stages, depth, num_patches, config.reduction == "fuse")
    before = (num_patches,) + counts[:-1]
    return [BlockTokens(attn=num_prefix + a, mlp=num_prefix + m) for a, m in zip(before, counts)]


def reduction_flops(config: PruneConfig, n: int, out: int, C: int, heads: int) -> int:
    """Products of one reduction step from ``n`` to ``out`` non-prefix tokens of width ``C``:
    key similarities (``C / heads``-wide averaged keys) between removed or candidate tokens
    and the kept or destination ones, then the sums, one ``C``-wide addition per token fewer
    (``n - out``; by this convention a fusion of ``r`` tokens counts ``r - 1``, and a drop,
    which sums nothing, is charged too: under 1e-5 of a model, kept so that the recorded
    experiments' counts stay those of the same code)."""
    if out == n:
        return 0
    kept = out - 1 if config.reduction == "fuse" else out
    removed = n - kept
    total = (n - out) * C  # the fusion or merge sums
    if config.selection != "top" or config.reduction == "merge":
        d = C // heads
        if config.selection == "top":
            total += removed * kept * d
        else:
            if config.selection == "bipartite":  # each round: candidates x destinations
                for before in [n] + bipartite_rounds(n, kept)[:-1]:
                    total += (before // 2) * ((before + 1) // 2) * d
            else:
                split = max(1, min(kept, n // 2))
                total += (n - split) * split * d
    return total


#: Layers that multiply each token by a matrix: ``nn.Linear``, and PyTorch's quantized
#: ``Linear`` (static or dynamic: ``torch.ao.quantization.quantize_dynamic`` swaps them in),
#: the same multiply-adds in int8, while this torch has them (they are deprecated).
_LINEAR: Tuple[type, ...] = (nn.Linear,) + tuple(
    c for c in [getattr(getattr(torch.ao.nn, "quantized", None), "Linear", None)] if isinstance(c, type))


def _is_linear(module: Any) -> bool:
    return isinstance(module, _LINEAR)


def _products(linear: Any) -> int:
    """Multiply-adds of one token through a layer of :data:`_LINEAR`."""
    return int(linear.in_features) * int(linear.out_features)


def _linear_flops(modules: Iterable[nn.Module]) -> int:
    """Multiply-adds of one token through every linear layer (:data:`_LINEAR`) in ``modules`` (and below),
    but those of relative-position MLPs, which run on their table (:func:`_table_flops`)."""
    modules = list(modules)
    tables = {id(m) for module in modules for table in _tables(module) for m in table.modules()}
    return sum(_products(m) for module in modules for m in module.modules() if _is_linear(m) and id(m) not in tables)


def _tables(module: nn.Module) -> List[nn.Module]:
    """The relative-position MLPs in ``module`` (timm's ``RelPosMlp``: relpos models)."""
    return [m for m in module.modules() if isinstance(m, RelPosMlp)]


def _table_flops(tables: Sequence[nn.Module]) -> int:
    """Relative-position MLPs (:func:`_tables`), each run once per image on its table of
    relative offsets (the full grid's, whatever tokens are left: the bias is gathered after)."""
    total = 0
    for table in tables:
        coords: Any = table.rel_coords_log  # (2h - 1, 2w - 1, 2)
        total += coords.numel() // coords.shape[-1] * sum(
            _products(m) for m in table.modules() if _is_linear(m))
    return total


class _BlockCost(NamedTuple):
    """One block's products per token: its attention modules' Linear layers (at the tokens
    the attention sees), its other Linear layers (the MLP, at the tokens after the
    reduction), the heads of its scored attention, of ``attention`` the key and value
    projections' (two thirds of a fused ``qkv``, or ``k_proj`` and ``v_proj``; 0 where it
    has neither), and ``width``, the query-key and attention-value width (``heads x
    head_dim``, summed over parallel attentions). A block that runs whole before its
    reduction (``ParallelScalingBlock``) has all its Linear layers in ``attention``."""

    attention: int
    rest: int
    heads: int
    keys_values: int
    width: int


def _key_value_flops(attention: Sequence[nn.Module]) -> int:
    """Per token, the key and value projections of a block's one attention module (0 for
    several, or for projections of another shape)."""
    if len(attention) != 1:
        return 0
    module = attention[0]
    qkv: Any = getattr(module, "qkv", None)
    if _is_linear(qkv):
        return _linear_flops([qkv]) * 2 // 3
    projections: List[Any] = [getattr(module, name, None) for name in ("k_proj", "v_proj")]
    linear = [p for p in projections if _is_linear(p)]
    return _linear_flops(linear) if len(linear) == len(projections) else 0


def _attention_width(module: nn.Module, default: int) -> int:
    """``num_heads x head_dim`` of an attention module that says both, else ``default``."""
    heads, head_dim = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    return heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else default


def _block_cost(block: nn.Module, family: Optional[Family], width: int) -> _BlockCost:
    """What one block multiplies per token; ``width`` is the model's, for attention modules
    that do not say theirs."""
    if isinstance(block, ParallelScalingBlock):  # attention and MLP from one projection, on all tokens
        return _BlockCost(_linear_flops([block]), 0, block.num_heads, 0, _attention_width(block, width))
    attention_of, heads_of = (family.attention_modules, family.heads) if family else (own_attention, attention_heads)
    attention = list(attention_of(block).values())
    inside = {id(m) for module in attention for m in module.modules()}
    rest = [m for m in block.modules() if _is_linear(m) and id(m) not in inside]
    return _BlockCost(attention=_linear_flops(attention), rest=_linear_flops(rest), heads=heads_of(block),
                      keys_values=_key_value_flops(attention),
                      width=sum(_attention_width(module, width) for module in attention))


@dataclass(frozen=True)
class _Layout:
    """What the analytic count reads of a model: its patch convolution (``None`` for a hybrid
    whose stem's feature map is the grid), a hybrid's CNN stem, width, the products of each
    block, prefix tokens, the cost of what follows the blocks given the tokens left, and the
    model's family (``None``: none). Worked out once per count (fits count many schedules
    of one model)."""

    conv: Optional[nn.Conv2d]
    stem: Optional[nn.Module]
    width: int
    blocks: Tuple[_BlockCost, ...]
    prefix: int
    after_blocks: Callable[[int], int]
    family: Optional[Family]


def _refuse(model: nn.Module, why: str) -> TypeError:
    return TypeError(
        f"analytic FLOPs cover the ViTs vitprune patches (timm and transformers) whose patch embedding is a "
        f"convolution or a hybrid's CNN stem and whose blocks multiply by Linear layers only; this "
        f"{type(model).__name__} {why}: "
        f"use vitprune.count_flops (fvcore), which traces whatever the model does")


def _pool_flops(pool: nn.Module, tokens: int) -> int:
    """A pooling attention after the blocks over ``tokens``: learned queries (one for
    ``nn.MultiheadAttention``, ``latent_len`` for timm's ``AttentionPoolLatent``) take
    their projections, the products and the layers after them; every token its keys and
    values."""
    if isinstance(pool, nn.MultiheadAttention):
        C = pool.embed_dim
        return C * C + 2 * tokens * C * C + 2 * tokens * C + C * C
    latent: Any = pool  # timm's AttentionPoolLatent, its attributes untyped
    queries, keys_values = latent.latent_len, _linear_flops([latent.kv])
    return (tokens * keys_values + queries * (_linear_flops([pool]) - keys_values)
            + 2 * queries * tokens * _attention_width(pool, 0))


def _known_block(block: nn.Module, family: Optional[Family]) -> bool:
    """A block of a class its family's ``patch`` swaps (exactly), or, in a model of no
    family, a plain timm block."""
    return original_block_class(block) in family.blocks if family else isinstance(block, (Block, ResPostBlock))


def _layout(model: nn.Module) -> _Layout:
    family = family_of(model)
    blocks = family.blocks_of(model) if family else getattr(model, "blocks", None)
    conv, embed, stem = patch_conv(model), getattr(model, "patch_embed", None), stem_of(model)
    if conv is None and stem is None:
        raise _refuse(model, "has no patch convolution")
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or not all(_known_block(b, family) for b in blocks):
        raise _refuse(model, "has blocks of a kind vitprune does not patch")
    strange = sorted({type(a).__name__ for b in blocks for a in family.foreign_attention(b).values()}) if family else []
    if strange:  # another attention's products (a differential one runs two maps)
        raise _refuse(model, f"has attention of a kind vitprune does not patch ({', '.join(strange)})")
    if any(isinstance(m, nn.modules.conv._ConvNd) for m in blocks.modules()):
        raise _refuse(model, "has convolutions inside its blocks")
    width = conv.out_channels if conv is not None else int(getattr(model, "embed_dim"))
    in_blocks = {id(m) for m in blocks.modules()}
    pools = [m for m in model.modules()
             if isinstance(m, (nn.MultiheadAttention, AttentionPoolLatent)) and id(m) not in in_blocks]
    tables = _tables(model)
    skip = {id(m) for part in (blocks, embed, *pools, *tables) if isinstance(part, nn.Module) for m in part.modules()}
    once = _linear_flops(m for m in model.modules() if _is_linear(m) and id(m) not in skip)
    once += _table_flops(tables)  # relative-position MLPs, on their tables

    def after_blocks(tokens: int) -> int:  # heads read one pooled (or class) token; a pool reads all
        return once + sum(_pool_flops(pool, tokens) for pool in pools)

    return _Layout(conv=conv, stem=stem, width=width, blocks=tuple(_block_cost(b, family, width) for b in blocks),
                   prefix=family.prefix_of(model) if family else getattr(model, "num_prefix_tokens", 0),
                   after_blocks=after_blocks, family=family)


def analytic_flops(model: nn.Module, img_size: Optional[Sequence[int]] = None) -> int:
    """FLOPs of one image through ``model`` (patched or not), from its token schedule.

    Args:
        model: A ViT of a family ``patch`` accepts (timm or ``transformers``) with a
            convolutional patch embedding or a hybrid's CNN stem, or a timm ViT of
            ``Block`` or ``ResPostBlock`` blocks.
        img_size: ``(H, W)`` or an int; the model's own input size when ``None``. Another
            size needs a model that runs there (timm's ``dynamic_img_size``; else ``ValueError``).
    """
    return schedule_flops(model, get_config(model) if is_patched(model) else None, img_size)


def schedule_flops(model: nn.Module, config: Optional[PruneConfig], img_size: Optional[Sequence[int]] = None) -> int:
    """FLOPs of one image through ``model`` if it were patched with ``config`` (``None``: unpruned).

    Per block: the attention modules' Linear layers at the tokens the attention sees, the
    two attention products, the block's other Linear layers (the MLP) at the tokens left
    after the reduction step, and the reduction step itself. ``config.overlap_stride``,
    when set, replaces the patch embedding's stride. A hybrid's CNN stem is counted by
    the products of one blank image through it, once per count. A spread schedule is
    resolved for the model's own input size, as ``patch`` resolves it, and applied as a
    rate at ``img_size``: the count is what the patched model runs at that size.

    Raises:
        TypeError: For models this formula does not describe (no patch convolution or
            stem, blocks of a kind vitprune does not patch, convolutions inside the
            blocks), and ``overlap_stride`` on a hybrid: use
            :func:`count_flops` (fvcore) for those.
    """
    return flop_counter(model, img_size)(config)


def flop_counter(model: nn.Module, img_size: Optional[Sequence[int]] = None
                 ) -> Callable[[Optional[PruneConfig]], int]:
    """:func:`schedule_flops` of ``model`` for any config, reading the model once (and
    running a hybrid's stem once): what the budget fits call, which count many schedules
    of one model.

    Raises:
        TypeError: As :func:`schedule_flops`, at once.
    """
    layout = _layout(model)
    size = runnable_size(model, img_size)  # a size the model cannot run at has no count
    conv, C, prefix = layout.conv, layout.width, layout.prefix
    per_patch = 0 if conv is None else C * conv.in_channels * math.prod(conv.kernel_size)
    stem = 0 if layout.stem is None else run_stem(layout.stem, size).flops
    depth = len(layout.blocks)
    family = layout.family
    class_only = family is not None and family.class_only_refusal(model) is None  # as ``forward`` decides

    grids: Dict[Optional[int], int] = {}  # patches per stride: a hybrid's off its own size runs the stem

    def count(config: Optional[PruneConfig]) -> int:
        stride = None if config is None else config.overlap_stride
        if stride not in grids:
            grids[stride] = num_patches(model, img_size, stride)
        patches = grids[stride]
        if config is not None:
            config = config.settle_class_only(class_only, depth)
            if config.class_only_last and not class_only:  # what forward runs on this model
                config = dataclasses.replace(config, class_only_last=False)
            config = config.resolve(depth, spread_patches(model, family, config))  # as ``patch`` resolves it
        schedule = token_schedule(config, depth, prefix, patches)
        stages = () if config is None else config.schedule()[0]
        total = stem + patches * per_patch
        for index, (cost, tokens) in enumerate(zip(layout.blocks, schedule)):
            L = tokens.attn
            if config is not None and config.class_only_last and index == depth - 1:
                total += _class_only_flops(cost, L, prefix, C)
                continue
            total += L * cost.attention + 2 * L * L * cost.width + tokens.mlp * cost.rest
            if config is not None and index in stages:
                row = L * C if config.needs_scores else 0  # the class row, where scored (at keep 1.0 too)
                total += row + reduction_flops(config, L - prefix, tokens.mlp - prefix, C, cost.heads)
        return total + layout.after_blocks(schedule[-1].mlp)

    return count


def _class_only_flops(cost: _BlockCost, L: int, prefix: int, C: int) -> int:
    """A block that computes the ``prefix`` tokens' outputs only (``class_only_last``): keys
    and values of all ``L`` tokens, the rest of the attention and the MLP for the prefix."""
    return (L * cost.keys_values + prefix * (cost.attention - cost.keys_values) + 2 * prefix * L * cost.width
            + prefix * cost.rest)


def _sdpa_flops(inputs: List[Any], outputs: List[Any]) -> int:
    """fvcore handle: ``q @ k^T`` and ``attn @ v``, i.e. ``B * H * Lq * Lk * (d_qk + d_v)``."""
    from fvcore.nn.jit_handles import get_shape

    q, k, v = (get_shape(value) for value in inputs[:3])
    return math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])


def _conv_mode_flops(inputs: List[Any], outputs: List[Any]) -> int:
    """fvcore handle for a convolution with string padding (``"valid"``, ``"same"``), which
    fvcore does not know: every output position of every image is one kernel's products."""
    from fvcore.nn.jit_handles import get_shape

    weight, out = get_shape(inputs[1]), get_shape(outputs[0])
    return out[0] * math.prod(weight) * math.prod(out[2:])


#: fvcore's normalisation counts, which :func:`analytic_flops` leaves out.
_NORMS = frozenset({"batch_norm", "group_norm", "layer_norm", "instance_norm"})


class _Calling(nn.Module):
    """``model(x, **options)`` as a module fvcore can trace (it passes positional inputs only)."""

    def __init__(self, model: nn.Module, options: Dict[str, bool]) -> None:
        super().__init__()
        self.model, self.options = model, options

    def forward(self, x: torch.Tensor) -> Any:
        return self.model(x, **self.options)


def count_flops(model: nn.Module, img_size: Optional[Sequence[int]] = None, products_only: bool = False) -> int:
    """FLOPs of one image through ``model`` (patched or not), traced by fvcore.

    Args:
        model: Any module taking a ``(1, 3, H, W)`` image; a timm ViT for ``img_size=None``.
        img_size: ``(H, W)`` or an int; the model's own input size when ``None``. A
            ``transformers`` model at another size is called with
            ``interpolate_pos_encoding=True``, as it must be to run there; a timm model
            built for one size (no ``dynamic_img_size``) is refused another (``ValueError``).
        products_only: Leave out fvcore's normalisation counts (batch, group, layer and
            instance norms): what :func:`analytic_flops` counts, for a like-for-like check.
            A ResNetV2 stem's group norms and weight standardisation are up to 4 % of it.

    The model runs in eval mode; every module's own mode is restored afterwards.

    Raises:
        TypeError: ``model`` is no module with a convolutional stem, or ``products_only`` is
            not ``True`` or ``False``.
        ValueError: ``img_size`` is one the model cannot run at.
    """
    if not isinstance(products_only, bool):  # "no" would count products only
        raise TypeError(f"products_only must be True or False, got {products_only!r}")
    with warnings.catch_warnings():  # fvcore's import path touches the deprecated torch.jit.script
        warnings.simplefilter("ignore", FutureWarning)
        from fvcore.nn import FlopCountAnalysis

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    param = next(model.parameters(), None)
    first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)  # it reads the image
    if param is None or first_conv is None:
        raise TypeError(
            f"count_flops traces a model that takes (1, C, H, W) images through a convolutional stem; "
            f"this {type(model).__name__} has {'no parameters' if param is None else 'no Conv2d'}"
        )
    channels = first_conv.in_channels
    size = runnable_size(model, img_size)
    x = torch.zeros(1, channels, *size, dtype=param.dtype, device=param.device)
    with evaluating(model), torch.no_grad():
        options = forward_options(model, size)
        analysis = FlopCountAnalysis(_Calling(model, options) if options else model, x).set_op_handle(
            "aten::scaled_dot_product_attention", _sdpa_flops, "aten::_convolution_mode", _conv_mode_flops)
        analysis.unsupported_ops_warnings(False)
        analysis.uncalled_modules_warnings(False)
        analysis.tracer_warnings("none")
        if not products_only:
            return int(analysis.total())
        return int(sum(flops for op, flops in analysis.by_operator().items() if op not in _NORMS))
