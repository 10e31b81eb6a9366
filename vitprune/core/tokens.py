"""Keep the top-scoring tokens and fuse the rest into one (docs/method.md §3-5). Pure torch."""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch


#: Whether torch.export is tracing (torch < 2.3 has no way to ask: never).
is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _dynamo_is_compiling() -> bool:  # torch < 2.3 has no torch.compiler.is_compiling
    import torch._dynamo

    return torch._dynamo.is_compiling()


#: Whether torch.compile (dynamo) is tracing.
is_compiling = getattr(torch.compiler, "is_compiling", None) or _dynamo_is_compiling


class Selection(NamedTuple):
    """Which of ``n`` tokens stay, per image.

    Attributes:
        keep: ``(B, k)`` indices of the kept tokens, in their original order.
        drop: ``(B, n - k)`` indices of the pruned tokens, highest score first.
    """

    keep: torch.Tensor
    drop: torch.Tensor


def select_top(scores: torch.Tensor, k: int) -> Selection:
    """Split the tokens of every image into its ``k`` highest scores and the rest.

    Ties keep the earlier token (a stable sort), so the choice is deterministic.
    Indices are never differentiated. While ``torch.export`` traces (and so in ONNX
    export, which has no stable sort) the order comes from ``topk``, whose tie order
    is the backend's: exact ties in float scores are the only case where it differs.
    """
    if not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k must be in [1, {scores.shape[1]}], got {k}")
    order = descending_order(scores)
    keep = order[:, :k].sort(dim=1).values
    return Selection(keep=keep, drop=order[:, k:])


def untracked(t: torch.Tensor) -> torch.Tensor:
    """``t`` with no autograd history: ``t.detach()``, or ``t`` itself when it needs none
    (inference), which saves an operation in every reduction step (see
    ``merging.bipartite_merge`` on what one costs)."""
    return t.detach() if t.requires_grad else t


def descending_order(values: torch.Tensor) -> torch.Tensor:
    """Indices that sort each row of ``values`` from high to low, ties earlier first (a stable
    sort); while exporting, ``topk``'s order (see :func:`select_top`). Never differentiated."""
    if is_exporting():
        return untracked(values).topk(values.shape[1], dim=1, sorted=True).indices
    return untracked(values).sort(dim=1, descending=True, stable=True).indices


def flat_index(index: torch.Tensor, n: int) -> torch.Tensor:
    """``(B, m)`` indices into ``n`` tokens per image as ``(B * m,)`` rows of the ``(B * n, C)`` batch."""
    return (index + torch.arange(index.shape[0], device=index.device).unsqueeze(1) * n).reshape(-1)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b]]`` for every image: ``(B, n, C)`` and ``(B, m)`` give ``(B, m, C)``.

    One row selection over the flattened batch (``index_select``), which reads whole token
    rows: several times faster on CPU than ``gather`` with an index expanded over channels.
    """
    B, n, C = x.shape
    return x.reshape(B * n, C).index_select(0, flat_index(index, n)).view(B, index.shape[1], C)


def fusion_weights(scores: torch.Tensor, T: float) -> torch.Tensor:
    """Eq. 8's weights ``softmax(s / (T * scale))`` over the last axis, in float32.

    ``scale`` is the mean absolute score of each image over the ``scores`` given
    (floored at the smallest normal float), which makes ``T`` unit-free: raw variances
    are ~1e-6, so a raw ``T = 1`` would always mean plain mean pooling. The logits are
    shifted so that the largest is exactly 0 before dividing by ``T``, so any ``T > 0``
    is finite: a tiny ``T`` approaches all weight on the top score (ties share it),
    ``T = inf`` gives the mean.
    """
    s = scores.float()
    scale = s.abs().mean(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    shifted = s / scale
    shifted = shifted - shifted.amax(dim=-1, keepdim=True)  # <= 0, and exactly 0 at the top
    logits = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / T)  # 0 / tiny T is 0, not NaN
    return torch.softmax(logits, dim=-1)


def fuse_tokens(tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i x_i`` per image: ``(B, m, C)`` tokens, ``(B, m)`` weights, ``(B, 1, C)`` out."""
    return torch.bmm(weights.to(tokens.dtype).unsqueeze(1), tokens)


def prune_tokens(
        x: torch.Tensor,
        scores: torch.Tensor,
        num_prefix: int,
        k: int,
        fuse: bool,
        T: float,
) -> Tuple[torch.Tensor, Selection]:
    """Keep the prefix tokens and the ``k`` top-scoring others; fuse or drop the rest.

    Args:
        x: ``(B, num_prefix + n, C)`` tokens.
        scores: ``(B, n)`` scores of the non-prefix tokens.
        num_prefix: Tokens at the front that are always kept (class, distillation, registers).
        k: How many non-prefix tokens to keep.
        fuse: Append one fusion token made from the pruned ones (when any are pruned).
        T: Fusion temperature, see :func:`fusion_weights`.

    Returns:
        ``(B, num_prefix + k [+ 1], C)`` tokens, and the selection made.
    """
    sel = select_top(scores, k)
    return keep_or_fuse(x, sel.keep, sel.drop, num_prefix, fuse, scores, T), sel


def keep_or_fuse(x: torch.Tensor, keep: torch.Tensor, drop: torch.Tensor, num_prefix: int, fuse: bool,
                 scores: "torch.Tensor | None", T: float) -> torch.Tensor:
    """The prefix tokens, the ``keep`` tokens, and with ``fuse`` one fusion token of the
    ``drop`` tokens (weighted by their ``scores``, see :func:`fusion_weights`)."""
    patches = x[:, num_prefix:]
    parts = [x[:, :num_prefix], gather_tokens(patches, keep)]
    if fuse and drop.shape[1] > 0:
        if scores is None:
            raise ValueError("a fusion token is weighted by the removed tokens' scores: pass scores")
        weights = fusion_weights(scores.gather(1, drop), T)
        parts.append(fuse_tokens(gather_tokens(patches, drop), weights))
    return torch.cat(parts, dim=1)
