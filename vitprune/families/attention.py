"""timm's self-attention, run through its own submodules, plus the row the indicators score.

With a class token the row is the class token's attention (docs/method.md §1). It costs one
``(1 x (P + N))`` product per head beside the model's fused attention, so no block ever
materialises the ``(P + N) x (P + N)`` matrix that the fused kernel avoids. Without a
class token the row is the mean attention each patch receives over all queries; that
needs the matrix, so pruning blocks of such models run timm's explicit attention path.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed_cat
from timm.models.vision_transformer import ParallelScalingBlock
from torch import nn

from ..core.hooks import hooked_by_user
from ..core.state import Scored

#: A timm or ``transformers`` attention module, read by attribute name: their attributes differ
#: by family (``member`` reads the optional ones) and are untyped to a type checker.
AttentionModule = Any


class Dropout(Protocol):
    """What :func:`attend` reads of an attention dropout: an ``nn.Dropout``, or a rate's."""

    p: float
    training: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def class_attention_row(q: torch.Tensor, k: torch.Tensor, scale: float, num_prefix: int,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The class token's softmax attention over the patch tokens, per head, in float32.

    The logits are computed in the model's dtype, like the model's own attention, and
    the softmax in float32. When ``k`` is a view of timm's fused ``qkv`` output (no
    ``k_norm``), the product runs on that layout directly instead of copying ``k``.

    Args:
        q: ``(B, H, P + N, d)`` queries, as the attention uses them (after ``q_norm``).
        k: ``(B, H, P + N, d)`` keys, likewise.
        scale: The attention's softmax scale.
        num_prefix: ``P``; the class token is token 0, as in timm.
        bias: The attention's additive bias ``(B or 1, H, P + N, P + N)``, or ``None``.

    Returns:
        ``(B, H, N)``: the softmax over all ``P + N`` keys, restricted to the patch columns.
    """
    B, H, L, d = k.shape
    q_cls = q[:, :, 0] * scale  # (B, H, d)
    if k.stride(3) == 1 and k.stride(1) == d:
        # (B, L, H * d) as it sits in memory, times a block-diagonal (B, H * d, H) of the
        # class queries: H times the minimal work, which is negligible, and no copy.
        blocks = q_cls.unsqueeze(-1) * torch.eye(H, device=q.device).to(q.dtype).unsqueeze(1)
        logits = torch.bmm(k.transpose(1, 2).reshape(B, L, H * d), blocks.reshape(B, H * d, H))
        logits = logits.transpose(1, 2)
    else:
        logits = (q_cls.unsqueeze(2) @ k.transpose(-2, -1)).squeeze(2)
    if bias is not None:
        logits = logits + bias[:, :, 0]
    return logits.float().softmax(dim=-1)[:, :, num_prefix:]


def join_scored(parts: "list[Scored]") -> Scored:
    """One :class:`Scored` for parallel attentions: their heads side by side."""
    rows = [p.row for p in parts if p.row is not None]
    row = torch.cat(rows, dim=1) if rows else None  # every part has one, or none does (``source``)
    return Scored(row, torch.cat([p.keys for p in parts], dim=1))


#: Where the per-head attention that the indicators score comes from (docs/method.md §1):
#: ``"cls"``, the class token's row; ``"mean"``, for models without a class token, the mean
#: attention each patch receives over all queries (needs the full matrix in pruning blocks);
#: ``"none"`` when no score is needed (bipartite merging): no row at all.
ROW_SOURCES = ("cls", "mean", "none")


def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        fused: bool,
        attn_drop: Dropout,
        num_prefix: int,
        source: str,
        bias: Optional[torch.Tensor] = None,
        follow: Literal["timm", "transformers"] = "timm",
        softmax_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, Scored]:
    """Multi-head attention as timm computes it, and what the reduction step needs.

    Args:
        q, k, v: ``(B, H, L, d)``, after any ``q_norm``/``k_norm``.
        scale: The softmax scale.
        fused: Use ``scaled_dot_product_attention`` (timm's ``fused_attn``); ignored for
            ``source="mean"``, which needs the attention matrix itself.
        attn_drop: The module's attention dropout.
        num_prefix: Tokens at the front that are never scored.
        source: One of :data:`ROW_SOURCES`.
        bias: Additive attention bias broadcastable to ``(B, H, L, L)`` (relative position,
            token sizes), or ``None``.
        follow: Whose code the rounding follows, so that nothing reduced gives the model's
            own output bit for bit: ``"timm"`` scales the queries before the explicit product
            and leaves the fused one its default scale; ``"transformers"`` scales the
            products and hands the fused one its scale.
        softmax_dtype: The explicit path's softmax runs in this dtype and returns to the
            queries' (``None``: in theirs; ``transformers``' ViT, DeiT, CLIP and SigLIP use
            float32).

    Returns:
        The attention output ``(B, H, L, d)``, and the row ``(B, H, L - num_prefix)`` in
        float32 (``None`` for ``source="none"``) with the keys.
    """
    dropout_p = attn_drop.p if attn_drop.training else 0.0
    sdpa_scale = scale if follow == "transformers" else None
    if source == "none" and fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=sdpa_scale), \
            Scored(None, k)
    if source != "cls" or not fused:
        logits = (q * scale) @ k.transpose(-2, -1) if follow == "timm" else (q @ k.transpose(-2, -1)) * scale
        logits = logits if bias is None else logits + bias
        if softmax_dtype is None:
            weights = logits.softmax(dim=-1)
        else:
            weights = logits.softmax(dim=-1, dtype=softmax_dtype).to(q.dtype)
        if source == "none":
            row = None
        elif source == "mean":
            row = weights.float().mean(dim=2)[..., num_prefix:]
        else:
            row = class_attention_row(q, k, scale, num_prefix, bias)
        return attn_drop(weights) @ v, Scored(row, k)
    row = class_attention_row(q, k, scale, num_prefix, bias)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=sdpa_scale)
    return out, Scored(row, k)


def member(module: nn.Module, name: str, default: Any = None) -> Any:
    """``getattr(module, name, default)`` without the exception ``Module.__getattr__`` raises
    for an absent name: this runs in every block, where building the exception's message
    cost more than the lookup (a few microseconds per absent name)."""
    attributes = module.__dict__
    for store in (attributes["_parameters"], attributes["_modules"], attributes["_buffers"], attributes):
        if name in store:
            return store[name]
    return getattr(module, name) if hasattr(type(module), name) else default  # class attributes, properties


def split_heads(y: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, N, heads * d)`` as ``(B, N, heads, d)``; ``d`` explicit, so an empty batch works."""
    return y.reshape(*y.shape[:-1], heads, y.shape[-1] // heads)


def own_qkv_bias(attn: AttentionModule) -> Optional[torch.Tensor]:
    """EVA's and BEiT's bias of a fused ``qkv`` kept beside it (``q_bias``, ``k_bias``,
    ``v_bias`` joined, as timm joins them), or ``None`` where the module has none."""
    if member(attn, "q_bias") is None:
        return None
    return torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))


def project_qkv(attn: AttentionModule, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` as ``(B, heads, N, d)`` through the module's own projections: a fused
    ``qkv`` (with EVA/BEiT's separate ``q_bias``/``k_bias``/``v_bias`` when present), or
    separate ``q_proj``/``k_proj``/``v_proj`` (grouped key/value heads allowed)."""
    B, N, _ = x.shape
    if attn.qkv is not None:
        bias = own_qkv_bias(attn)
        if bias is None:
            qkv = attn.qkv(x)
        elif attn.qkv_bias_separate:  # timm adds the bias after the product
            qkv = attn.qkv(x) + bias
        else:
            qkv = F.linear(x, weight=attn.qkv.weight, bias=bias)
        head_dim = qkv.shape[-1] // (3 * attn.num_heads)  # not -1: an empty batch reshapes too
        return qkv.reshape(B, N, 3, attn.num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    kv_heads = member(attn, "num_kv_heads", attn.num_heads)
    q = split_heads(attn.q_proj(x), attn.num_heads).transpose(1, 2)
    k = split_heads(attn.k_proj(x), kv_heads).transpose(1, 2)
    v = split_heads(attn.v_proj(x), kv_heads).transpose(1, 2)
    return q, k, v


def rotate(t: torch.Tensor, rope: torch.Tensor, num_prefix: int, half: bool) -> torch.Tensor:
    """Rotary embedding on the non-prefix tokens of ``(B, H, L, d)`` ``t`` (timm's ``cat`` table)."""
    turned = apply_rot_embed_cat(t[:, :, num_prefix:], rope, half=half) if half else \
        apply_rot_embed_cat(t[:, :, num_prefix:], rope)  # no ``half`` before timm 1.0.20
    return torch.cat([t[:, :, :num_prefix], turned], dim=2)


def attention_with_row(
        attn: AttentionModule,
        x: torch.Tensor,
        num_prefix: int,
        source: str = "cls",
        bias: Optional[torch.Tensor] = None,
        rope: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Scored]:
    """``attn(x)`` exactly as timm computes it, and what the reduction step needs.

    The one attention path of every family: timm's ``Attention``, Eva's ``EvaAttention``
    and ``AttentionRope`` (with ``rope``), BEiT's and relpos's attention (with their
    relative bias already in ``bias``). Uses the module's own projections (fused ``qkv``
    or separate), ``q_norm``/``k_norm``, rotary embedding, grouped key/value heads,
    ``norm``, ``gate``, ``proj`` and dropouts where it has them, and its fused or explicit
    path as ``attn.fused_attn`` says; the equivalence tests hold this to timm's forward.

    Args:
        attn: The attention module.
        x: ``(B, P + N, C)`` tokens (already normed by the block where it norms first).
        num_prefix: ``P``, tokens never scored.
        source: One of :data:`ROW_SOURCES`.
        bias: Additive attention bias (relative position, token sizes), or ``None``.
        rope: timm's rotary table for the non-prefix tokens (``cat`` layout), or ``None``.

    Returns:
        The attention output ``(B, P + N, C)`` and the :class:`Scored` row and keys (the
        row after the rotation and bias, as the attention sees them).
    """
    gate_layer = member(attn, "gate")
    gate = gate_layer(x).sigmoid() if gate_layer is not None else None
    q, k, v = project_qkv(attn, x)
    q_norm, k_norm = member(attn, "q_norm"), member(attn, "k_norm")
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    if rope is not None:
        npt, half = attn.num_prefix_tokens, member(attn, "rotate_half", False)
        q, k = rotate(q, rope, npt, half).type_as(v), rotate(k, rope, npt, half).type_as(v)
    groups = member(attn, "num_kv_groups", 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out, row = attend(q, k, v, scale=attn.scale, fused=attn.fused_attn, attn_drop=attn.attn_drop,
                      num_prefix=num_prefix, source=source, bias=bias)
    out = out.transpose(1, 2).flatten(2)
    norm = member(attn, "norm")
    if norm is not None:
        out = norm(out)
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out)), row


def parallel_scaling_with_row(
        block: ParallelScalingBlock,
        x: torch.Tensor,
        num_prefix: int,
        source: str = "cls",
        bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Scored]:
    """``block(x)`` for timm's ``ParallelScalingBlock`` (attention and MLP side by side),
    through its own submodules, and the row the indicators score."""
    B, L, C = x.shape
    zeros = getattr(block, "qkv_bias", None)
    mlp_bias: Optional[torch.Tensor] = block.mlp_bias
    if mlp_bias is not None and zeros is not None:
        # timm before 1.0.25 hands in_proj the bias cat((qkv zeros, mlp_bias)) while its split
        # puts the MLP first, so mlp_bias lands on other outputs: followed as it is
        y = F.linear(block.in_norm(x), block.in_proj.weight, torch.cat((zeros, mlp_bias)))
        mlp_bias = None  # added already
    else:
        y = block.in_proj(block.in_norm(x))
    x_mlp, q, k, v = torch.split(y, block.in_split, dim=-1)
    if mlp_bias is not None:
        x_mlp = x_mlp + mlp_bias
    q = block.q_norm(q.view(B, L, block.num_heads, block.head_dim)).transpose(1, 2)
    k = block.k_norm(k.view(B, L, block.num_heads, block.head_dim)).transpose(1, 2)
    v = v.view(B, L, block.num_heads, block.head_dim).transpose(1, 2)
    out, row = attend(q, k, v, scale=block.scale, fused=block.fused_attn, attn_drop=block.attn_drop,
                      num_prefix=num_prefix, source=source, bias=bias)
    out = out.transpose(1, 2).reshape(B, L, C)
    x_mlp = block.mlp_drop(block.mlp_act(x_mlp))
    out_proj = getattr(block, "out_proj", None)  # older timm (1.0.20) has only the split ones
    if out_proj is not None:
        y = out_proj(torch.cat((out, x_mlp), dim=-1))
    else:
        y = getattr(block, "attn_out_proj")(out) + getattr(block, "mlp_out_proj")(x_mlp)
    return x + block.drop_path(block.ls(y)), row


def prefix_rows(bias: Optional[torch.Tensor], num_prefix: int) -> Optional[torch.Tensor]:
    """An attention bias ``(..., L or 1, L)`` for the queries of the first ``num_prefix``
    tokens alone (a bias shared by every query row is kept as it is)."""
    if bias is not None and bias.shape[-2] != 1:
        bias = bias[..., :num_prefix, :]
    return bias


def project_prefix_qkv(attn: AttentionModule, x: torch.Tensor, num_prefix: int
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`project_qkv` with queries for the first ``num_prefix`` tokens only: ``q``
    ``(B, heads, P, d)``, ``k`` and ``v`` of every token. A fused ``qkv`` runs as two products
    on slices of its weight (and of its bias, or of EVA's ``q_bias``/``k_bias``/``v_bias``),
    unless the user hooked it where timm calls it: then it is called, on every token."""
    B, L, _ = x.shape
    prefix = x[:, :num_prefix]
    if attn.qkv is not None and hooked_by_user(attn.qkv) and (own_qkv_bias(attn) is None or attn.qkv_bias_separate):
        q, k, v = project_qkv(attn, x)  # called as timm calls it, so its hooks see every token
        return q[:, :, :num_prefix], k, v
    if attn.qkv is None:
        kv_heads = member(attn, "num_kv_heads", attn.num_heads)
        q = split_heads(attn.q_proj(prefix), attn.num_heads).transpose(1, 2)
        k = split_heads(attn.k_proj(x), kv_heads).transpose(1, 2)
        return q, k, split_heads(attn.v_proj(x), kv_heads).transpose(1, 2)
    weight, bias, separate = attn.qkv.weight, own_qkv_bias(attn), False
    if bias is None:
        bias = attn.qkv.bias
    else:
        separate = attn.qkv_bias_separate
    width = weight.shape[0] // 3
    if separate:  # timm adds the bias after the product
        q = F.linear(prefix, weight[:width]) + bias[:width]
        kv = F.linear(x, weight[width:]) + bias[width:]
    else:
        q = F.linear(prefix, weight[:width], None if bias is None else bias[:width])
        kv = F.linear(x, weight[width:], None if bias is None else bias[width:])
    head_dim = width // attn.num_heads
    k, v = kv.reshape(B, L, 2, attn.num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return split_heads(q, attn.num_heads).transpose(1, 2), k, v


def prefix_attention(attn: AttentionModule, x: torch.Tensor, num_prefix: int,
                     bias: Optional[torch.Tensor] = None, rope: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``attn(x)[:, :num_prefix]``, without the other tokens' queries.

    Keys and values come from every token; queries, the attention products, ``norm``,
    ``gate`` and ``proj`` from the first ``num_prefix`` only: what a block needs when the
    model reads nothing but the class token after it (``class_only_last``). The same
    modules as :func:`attention_with_row`: timm's ``Attention``, Eva's ``EvaAttention`` and
    ``AttentionRope`` (rotary embedding on the keys of the non-prefix tokens: the prefix
    tokens' queries are never rotated, as in timm; grouped key/value heads).

    Args:
        attn: The attention module.
        x: ``(B, P + N, C)`` tokens, already normed by the block where it norms first.
        num_prefix: ``P``.
        bias: Additive attention bias broadcastable to ``(B, H, P + N, P + N)``, or ``None``.
        rope: timm's rotary table for the non-prefix tokens (``cat`` layout), or ``None``.

    Returns:
        ``(B, P, C)``: the attention output of the prefix tokens.
    """
    P = num_prefix
    q, k, v = project_prefix_qkv(attn, x, P)
    q_norm, k_norm = member(attn, "q_norm"), member(attn, "k_norm")
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    if rope is not None:
        k = rotate(k, rope, attn.num_prefix_tokens, member(attn, "rotate_half", False)).type_as(v)
        q = q.type_as(v)
    groups = member(attn, "num_kv_groups", 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out, _ = attend(q, k, v, scale=attn.scale, fused=attn.fused_attn, attn_drop=attn.attn_drop,
                    num_prefix=P, source="none", bias=prefix_rows(bias, P))
    out = out.transpose(1, 2).flatten(2)
    norm = member(attn, "norm")
    if norm is not None:
        out = norm(out)
    gate_layer = member(attn, "gate")
    if gate_layer is not None:
        out = out * gate_layer(x[:, :P]).sigmoid()
    return attn.proj_drop(attn.proj(out))
