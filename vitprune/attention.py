"""timm's self-attention, run through its own submodules, plus the class token's row.

The row is what the indicators score (METHOD.md §1). It costs one ``(1 x (P + N))``
product per head beside the model's fused attention, so no block ever materialises
the ``(P + N) x (P + N)`` matrix that the fused kernel avoids.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from timm.layers import Attention


def class_attention_row(q: torch.Tensor, k: torch.Tensor, scale: float, num_prefix: int) -> torch.Tensor:
    """The class token's softmax attention over the patch tokens, per head, in float32.

    The logits are computed in the model's dtype, like the model's own attention, and
    the softmax in float32. When ``k`` is a view of timm's fused ``qkv`` output (no
    ``k_norm``), the product runs on that layout directly instead of copying ``k``.

    Args:
        q: ``(B, H, P + N, d)`` queries, as the attention uses them (after ``q_norm``).
        k: ``(B, H, P + N, d)`` keys, likewise.
        scale: The attention's softmax scale.
        num_prefix: ``P``; the class token is token 0, as in timm.

    Returns:
        ``(B, H, N)``: the softmax over all ``P + N`` keys, restricted to the patch columns.
    """
    B, H, L, d = k.shape
    q_cls = q[:, :, 0] * scale  # (B, H, d)
    if k.stride(3) == 1 and k.stride(1) == d:
        # (B, L, H * d) as it sits in memory, times a block-diagonal (B, H * d, H) of the
        # class queries: H times the minimal work, which is negligible, and no copy.
        blocks = q_cls.unsqueeze(-1) * torch.eye(H, dtype=q.dtype, device=q.device).unsqueeze(1)
        logits = torch.bmm(k.transpose(1, 2).reshape(B, L, H * d), blocks.reshape(B, H * d, H))
        logits = logits.transpose(1, 2)
    else:
        logits = (q_cls.unsqueeze(2) @ k.transpose(-2, -1)).squeeze(2)
    return logits.float().softmax(dim=-1)[:, :, num_prefix:]


def attention_with_class_row(
        attn: Attention,
        x: torch.Tensor,
        num_prefix: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``attn(x)`` exactly as timm computes it, and the class token's attention row.

    Uses the module's own ``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``gate``, ``proj``
    and dropouts, and its fused or explicit path as ``attn.fused_attn`` says; the
    equivalence tests hold this to timm's forward.

    Returns:
        The attention output ``(B, P + N, C)`` and the row ``(B, H, N)`` in float32.
    """
    B, L, _ = x.shape
    gate_layer = getattr(attn, "gate", None)
    gate = gate_layer(x).sigmoid() if gate_layer is not None else None
    qkv = attn.qkv(x).reshape(B, L, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)

    row = class_attention_row(q, k, attn.scale, num_prefix)
    if attn.fused_attn:
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=attn.attn_drop.p if attn.training else 0.0,
        )
    else:
        weights = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        out = attn.attn_drop(weights) @ v

    out = out.transpose(1, 2).reshape(B, L, attn.num_heads * attn.head_dim)
    out = attn.norm(out) if hasattr(attn, "norm") else out
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out)), row
