"""Which tokens go when redundancy counts, and merging them into the tokens that stay. Pure torch.

Three selections, all giving a :class:`Matched` (the kept and removed tokens, and for each
removed token the kept token it is most like):

- ``top`` (the paper): keep the ``k`` best-scored tokens; each removed one is matched to
  the kept token whose key is most similar.
- ``redundant`` (ours): the best-scored ``min(k, n // 2)`` tokens are destinations that
  always stay; of the rest, the ``n - k`` most similar to a destination go. Important
  tokens are never merged away, and among the unimportant ones the copies go first.
- ``bipartite`` (token merging, Bolya et al. 2023): the same, with the destinations chosen
  by position (every other token) instead of by score; to remove more than half, in rounds.

Similarity is the cosine of the attention keys averaged over heads, as in token merging.
Bipartite matching can also weigh each candidate's *crowding* (:func:`crowding_scores`) into the
order in which candidates go: of two candidates equally close to a destination, the one
with more near copies among the destinations goes first (after the energy score of Tran et
al., "Accelerating Transformers with Spectrum-Preserving Token Merging", NeurIPS 2024).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .tokens import descending_order, gather_tokens, select_top, untracked


class Matched(NamedTuple):
    """Which of ``n`` tokens stay, and where the removed ones go, per image.

    Attributes:
        keep: ``(B, k)`` indices of the kept tokens, in their original order (bipartite:
            the candidates that stay, then the destinations, each in original order).
        drop: ``(B, n - k)`` indices of the removed tokens.
        dest: ``(B, n - k)``: for each removed token, the position in ``keep`` (0..k-1) of
            the kept token most similar to it.
    """

    keep: torch.Tensor
    drop: torch.Tensor
    dest: torch.Tensor


def key_metric(keys: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """``(B, N, d)`` unit vectors: the non-prefix keys ``(B, H, P + N, d)`` averaged over heads.

    In float32 at least, whatever the keys' dtype: in bfloat16 (8 bits of mantissa) the
    cosines of near copies tie or swap, and a bfloat16 model would merge other tokens than
    the same model in float32 (see :func:`cosines`). Detached: only indices leave a
    matching, so no gradient is recorded for it, and the new tensors are normalised in place
    (an operation's allocation saved in every block)."""
    keys = untracked(keys)
    dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32  # a Python test: no operator
    metric = (keys[:, :, num_prefix:] if num_prefix else keys).sum(dim=1, dtype=dtype)  # the norm divides the 1 / H out
    return metric.div_(torch.linalg.vector_norm(metric, dim=-1, keepdim=True).clamp_min_(1e-12))


#: Devices whose autocast :func:`cosines` turns off (``torch.is_autocast_enabled`` refuses
#: devices without autocast, and ``torch.amp.is_autocast_available`` breaks torch 2.4's graphs).
AUTOCAST_DEVICES = ("cpu", "cuda")


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(B, m, n)``: every row of ``a`` ``(B, m, d)`` against every row of ``b`` ``(B, n, d)``
    (unit vectors: cosines), in their own dtype even under CPU or CUDA autocast, which would
    compute a float32 product in float16 or bfloat16."""
    device = a.device.type
    if device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return torch.bmm(a, b.mT)
    return torch.bmm(a, b.mT)


#: Cosine similarity above which a destination counts towards a candidate's crowding with its
#: similarity; below it, with ``exp(cos - margin) - 1`` (between -1 and 0).
CROWDING_MARGIN = 0.6


def crowding_scores(similarity: torch.Tensor, margin: float = CROWDING_MARGIN) -> torch.Tensor:
    """``(B, c)``: how crowded each candidate is among the destinations.

    The mean over destinations of ``cos`` where ``cos > margin`` and ``exp(cos - margin) - 1``
    elsewhere: high for a candidate with many near copies, negative for one unlike most.

    Args:
        similarity: ``(B, c, d)`` cosines of ``c`` candidates to ``d`` destinations.
        margin: Where near copies start.
    """
    below = torch.expm1(similarity - margin)
    return torch.where(similarity > margin, similarity, below).mean(dim=-1)


def _removal_order(similarity: torch.Tensor, weight: float) -> "tuple[torch.Tensor, torch.Tensor]":
    """Candidates from first to go to last (``descending_order``), and each one's closest
    destination, from their ``(B, c, d)`` similarities: by closeness to the nearest destination
    plus ``weight`` times their :func:`crowding_scores` (``weight`` 0: token merging's order)."""
    best, partner = similarity.max(dim=-1)
    if weight:
        best = best.add_(crowding_scores(similarity), alpha=weight)
    return descending_order(best), partner


def _positions_in(keep: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """For token indices ``index`` (all in ``keep``), their positions within ``keep``."""
    lookup = keep.new_zeros(keep.shape[0], n)
    lookup.scatter_(1, keep, torch.arange(keep.shape[1], device=keep.device).expand_as(keep))
    return lookup.gather(1, index)


def match_top(scores: torch.Tensor, metric: torch.Tensor, k: int) -> Matched:
    """Keep the ``k`` best-scored tokens; match each removed one to its most similar kept token."""
    sel = select_top(scores, k)
    similarity = cosines(gather_tokens(metric, sel.drop), gather_tokens(metric, sel.keep))
    return Matched(sel.keep, sel.drop, similarity.argmax(dim=-1))


def match_redundant(priority: torch.Tensor, metric: torch.Tensor, k: int) -> Matched:
    """Remove the ``n - k`` tokens most similar to a destination, among the non-destinations.

    Args:
        priority: ``(B, n)``; the ``min(k, n // 2)`` highest are the destinations (ties:
            the earlier token), which always stay.
        metric: ``(B, n, d)`` unit vectors (:func:`key_metric`).
        k: Tokens kept, ``1 <= k <= n``.
    """
    n = priority.shape[1]
    _check_k(k, n)
    return _match(descending_order(priority), max(1, min(k, n // 2)), metric, k, concat=False)


def match_bipartite(metric: torch.Tensor, k: int, sizes: Optional[torch.Tensor] = None,
                    crowding: float = 0.0) -> Matched:
    """Token merging's bipartite matching: tokens 0, 2, 4, ... are the destinations, the
    others the candidates, and the kept tokens come back as [candidates that stay,
    destinations], as the paper concatenates the two sets (so the next block's
    alternation runs over that order).

    One round removes at most half the tokens. To keep ``k < ceil(n / 2)`` the matching
    runs in rounds, each on the tokens the last one left (their keys merged as
    ``sizes``-weighted averages, ``sizes`` defaulting to ones), until ``k`` remain; the
    result maps every token to the kept token it ends up in. ``crowding`` weighs each
    candidate's :func:`crowding_scores` into the order in which candidates go (0: the paper's).
    """
    B, n, _ = metric.shape
    _check_k(k, n)
    if 2 * k >= n:
        return _bipartite_round(metric, k, crowding)
    sizes = metric.new_ones(B, n) if sizes is None else sizes.to(metric.dtype)
    slot = torch.arange(n, device=metric.device).expand(B, n)  # each token's place among the current ones
    origin = slot  # each current token's original index
    for after in bipartite_rounds(n, k):
        step = _bipartite_round(metric, after, crowding)
        slot, origin = token_slots(step.keep, step.drop, step.dest).gather(1, slot), origin.gather(1, step.keep)
        merged, sizes = merge_tokens(metric, sizes, step)
        metric = merged / merged.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    kept = torch.zeros(B, n, device=metric.device).scatter(1, origin, 1.0)
    drop = descending_order(-kept)[:, :n - k]  # the tokens not kept, in index order
    return Matched(origin, drop, slot.gather(1, drop))


def bipartite_rounds(n: int, k: int) -> "list[int]":
    """Tokens left after each round of bipartite matching from ``n`` down to ``k``: each
    round removes at most half (``[k]`` alone when ``2 k >= n``, none when ``k == n``)."""
    left = []
    while n > k:
        n = n - min(n - k, n // 2)  # not -=: under tracing n may be a shape tensor
        left.append(n)
    return left


def _bipartite_round(metric: torch.Tensor, k: int, crowding: float = 0.0) -> Matched:
    """One round: the even tokens are the destinations, the odd ones the candidates (strided
    views, no gathers); the ``n - k`` candidates closest to a destination go (``crowding``:
    see :func:`_removal_order`). With ``crowding`` 0 the same as ``_match`` with
    ``order = [evens, odds]`` and ``concat``, written out for speed."""
    B, n, _ = metric.shape
    metric = untracked(metric)
    ranked, partner = _removal_order(cosines(metric[:, 1::2], metric[:, 0::2]), crowding)
    removed, stays = ranked[:, :n - k], ranked[:, n - k:]
    stay = stays.sort(dim=1).values * 2 + 1
    destinations = torch.arange(0, n, 2, device=metric.device).expand(B, -1)
    return Matched(torch.cat([stay, destinations], dim=1), removed * 2 + 1, partner.gather(1, removed) + stay.shape[1])


def _check_k(k: int, n: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")


def _match(order: torch.Tensor, split: int, metric: torch.Tensor, k: int, concat: bool) -> Matched:
    """``order[:, :split]`` are destinations; remove the ``n - k`` others closest to one.
    With ``concat`` the destinations must already be in index order (bipartite's are)."""
    n = order.shape[1]
    dst, src = order[:, :split], order[:, split:]
    metric = untracked(metric)
    similarity = cosines(gather_tokens(metric, src), gather_tokens(metric, dst))
    best, partner = similarity.max(dim=-1)  # (B, n - split): each candidate's closest destination
    ranked = descending_order(best)
    removed, stays = ranked[:, :n - k], ranked[:, n - k:]
    stay = src.gather(1, stays).sort(dim=1).values
    drop, partner = src.gather(1, removed), partner.gather(1, removed)
    if concat:  # [stay, dst]: destination j sits at len(stay) + j
        return Matched(torch.cat([stay, dst], dim=1), drop, partner + stay.shape[1])
    keep = torch.cat([dst, stay], dim=1).sort(dim=1).values
    return Matched(keep, drop, _positions_in(keep, dst.gather(1, partner), n))


def merge_tokens(tokens: torch.Tensor, sizes: torch.Tensor, matched: Matched,
                 num_prefix: int = 0) -> "tuple[torch.Tensor, torch.Tensor]":
    """Size-weighted averages of each kept token and the removed tokens matched to it.

    Args:
        tokens: ``(B, P + n, C)``: ``num_prefix`` tokens that are copied as they are, then
            the ``n`` tokens ``matched`` indexes.
        sizes: ``(B, n)`` float: how many original patches each of the ``n`` holds.
        matched: The selection.
        num_prefix: ``P``.

    Returns:
        ``(B, P + k, C)`` tokens and the ``(B, k)`` sizes of the ``k`` kept ones; a kept
        token ``j`` becomes ``(s_j x_j + sum_i s_i x_i) / (s_j + sum_i s_i)`` over the
        removed ``i`` matched to it.
    """
    B, L, C = tokens.shape
    P, k = num_prefix, matched.keep.shape[1]
    kept_sizes, drop_sizes = sizes.gather(1, matched.keep), sizes.gather(1, matched.drop)
    new_sizes = kept_sizes.scatter_add(1, matched.dest, drop_sizes)
    # Rows of the flattened batch: one selection copies the prefix and the kept tokens; every
    # kept token is scaled once by its own share s_j / S_j (exactly 1 where nothing arrives),
    # then each removed token times its share s_i / S_j is added to its row. (Scaling a
    # receiving row once per token it receives writes the same values but sends the kept
    # token that many times its gradient.)
    image = torch.arange(B, device=tokens.device).unsqueeze(1)
    source = matched.keep + P
    if P:
        source = torch.cat([torch.arange(P, device=tokens.device).expand(B, P), source], dim=1)
    flat = tokens.reshape(B * L, C)
    out = flat.index_select(0, (source + image * L).reshape(-1)).view(B, P + k, C)
    out[:, P:].mul_(_as(kept_sizes / new_sizes, tokens.dtype).unsqueeze(-1))
    rows = (matched.dest + (image * (P + k) + P)).reshape(-1)
    removed_share = _as(drop_sizes / new_sizes.gather(1, matched.dest), tokens.dtype).reshape(-1, 1)
    out.view(B * (P + k), C).index_add_(0, rows, flat.index_select(0, (matched.drop + (image * L + P)).reshape(-1))
                                        * removed_share)
    return out, new_sizes


class Merged(NamedTuple):
    """What :func:`bipartite_merge` gives: the new tokens and sizes, and where every
    candidate went (for :func:`bipartite_keep` and :func:`bipartite_slots`).

    Attributes:
        tokens: ``(B, P + k)``.
        sizes: ``(B, k)``.
        stays: ``(B, m)``: the candidates that stay, in order (candidate ``c`` is token ``2 c + 1``).
        removed: ``(B, n - k)``: the candidates merged away.
        dest: ``(B, n - k)``: the destination (``j``: token ``2 j``) each removed candidate joined.
    """

    tokens: torch.Tensor
    sizes: torch.Tensor
    stays: torch.Tensor
    removed: torch.Tensor
    dest: torch.Tensor


def bipartite_merge(tokens: torch.Tensor, keys: torch.Tensor, sizes: torch.Tensor, k: int,
                    num_prefix: int, crowding: float = 0.0) -> Merged:
    """One round of token merging, selection and merge together: bit for bit
    ``merge_tokens(tokens, sizes, match_bipartite(key_metric(keys, P), k, crowding=crowding), P)``
    when ``2 k >= n``, in three quarters of the operations.

    The step runs in every block, and a batch-1 CPU forward pays per operation rather than
    per byte there (each costs a few microseconds after the block's matrix products), so the
    rows are indexed once, in the flattened batch, for the selection and the merge alike;
    every destination row is scaled in place by its own share (1 where nothing arrives).
    A batch of one indexes its image's rows directly, with no row offsets to build (about
    a tenth of the step's time on a 2-core CPU).

    Args:
        tokens: ``(B, P + n, C)``.
        keys: ``(B, H, P + n, d)``, the attention's keys.
        sizes: ``(B, n)`` float.
        k: Tokens kept, ``ceil(n / 2) <= k < n``.
        num_prefix: ``P``.
        crowding: Weight of each candidate's :func:`crowding_scores` in the order candidates go.

    Returns:
        A :class:`Merged`: the ``(B, P + k, C)`` tokens, their ``(B, k)`` sizes, the
        ``(B, k - ceil(n / 2))`` candidates that stay, in order (:func:`bipartite_keep` makes
        the kept indices of them), and the removed candidates with their destinations.
    """
    B, L, C = tokens.shape
    P = num_prefix
    n = L - P
    if not (n + 1) // 2 <= k < n:
        raise ValueError(f"one round keeps between ceil(n / 2) = {(n + 1) // 2} and n - 1 = {n - 1} of "
                         f"n = {n} tokens, got k = {k}")
    metric = key_metric(keys, 0)  # the prefix's too, unused: no slice, the two sets are strided views
    # no gradient reaches the matching: only indices leave it
    ranked, partner = _removal_order(cosines(metric[:, P + 1::2], metric[:, P::2]), crowding)
    removed, stays = ranked[:, :n - k], ranked[:, n - k:].sort(dim=1).values
    m = stays.shape[1]
    dest = partner.gather(1, removed)  # each removed candidate's destination, 0.. among the evens
    src_sizes, dst_sizes = sizes[:, 1::2], sizes[:, 0::2]
    moved = src_sizes.gather(1, removed)
    new_dst = dst_sizes.scatter_add(1, dest, moved)
    # every destination times its own share s_j / S_j (exactly 1 where nothing arrived), then
    # each removed candidate times its share s_i / S_j added to its destination
    kept_share = _as(dst_sizes / new_dst, tokens.dtype)
    removed_share = _as(moved / new_dst.gather(1, dest), tokens.dtype)
    if type(B) is int and B == 1:  # batch 1 (eager, or a graph of it): the image's own rows, no offsets
        candidates = tokens[0, P + 1::2]
        out = torch.cat([tokens[0, :P], candidates.index_select(0, stays[0]), tokens[0, P::2]])
        moving = candidates.index_select(0, removed[0]).mul_(removed_share.view(-1, 1))
        out[P + m:].mul_(kept_share.view(-1, 1)).index_add_(0, dest[0], moving)  # the destinations
        out = out.unsqueeze(0)
    else:  # rows of the flattened batch: image b's token t is row b L + t, candidate c is token P + 2 c + 1
        grid = torch.arange(B * L, device=tokens.device).view(B, L)
        first_candidate = grid[:, P + 1:P + 2]
        source = torch.cat([grid[:, :P], torch.add(first_candidate, stays, alpha=2), grid[:, P::2]], dim=1)
        flat = tokens.reshape(B * L, C)
        out = flat.index_select(0, source.view(-1)).view(B, P + k, C)  # prefix, candidates that stay, destinations
        out[:, P + m:].mul_(kept_share.unsqueeze(-1))
        rows = (dest + torch.arange(P + m, B * (P + k) + P + m, P + k, device=tokens.device).view(B, 1)).view(-1)
        drop_rows = torch.add(first_candidate, removed, alpha=2).view(-1)
        out.view(B * (P + k), C).index_add_(0, rows, flat.index_select(0, drop_rows).mul_(removed_share.view(-1, 1)))
    return Merged(out, torch.cat([src_sizes.gather(1, stays), new_dst], dim=1), stays, removed, dest)


def bipartite_keep(stays: torch.Tensor, n: int) -> torch.Tensor:
    """The kept indices of :func:`bipartite_merge` over ``n`` tokens, as ``match_bipartite``
    gives them: the candidates that stay (``stays``, ``(B, m)``), then every destination."""
    destinations = torch.arange(0, n, 2, device=stays.device).expand(stays.shape[0], -1)
    return torch.cat([stays * 2 + 1, destinations], dim=1)


def bipartite_slots(stays: torch.Tensor, removed: torch.Tensor, dest: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`token_slots` of a :func:`bipartite_merge` over ``n`` tokens, from its
    ``stays``, ``removed`` and ``dest`` (index tensors: a record of them holds no tokens)."""
    return token_slots(bipartite_keep(stays, n), removed * 2 + 1, dest + stays.shape[1])


def token_slots(keep: torch.Tensor, drop: torch.Tensor, into: "torch.Tensor | int") -> torch.Tensor:
    """``(B, n)`` long: for each of the ``n`` tokens a reduction received, the index among the
    tokens it left of the one that holds it now.

    Args:
        keep: ``(B, k)`` indices of the kept tokens, in their new order (kept token ``keep[:, i]``
            is new token ``i``).
        drop: ``(B, n - k)`` indices of the removed tokens.
        into: ``(B, n - k)``: the new token each removed one joined (a merge), or one index for
            all of them (``k``, a fusion token after the kept ones), or ``-1`` (dropped).
    """
    B, k = keep.shape
    slots = keep.new_empty(B, k + drop.shape[1])
    slots.scatter_(1, keep, torch.arange(k, device=keep.device).expand(B, k))
    if not isinstance(into, torch.Tensor):
        into = drop.new_full(drop.shape, into)
    return slots.scatter_(1, drop, into)


def _as(share: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``share`` in ``dtype``, with no conversion when it already is."""
    return share if share.dtype == dtype else share.to(dtype)


def size_bias(sizes: torch.Tensor, num_prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, 1, 1, P + n)`` additive attention bias: ``log s`` for each key holding ``s`` patches.

    Adding it to the logits makes a token count as its ``s`` patches would: attending to it
    once with ``+log s`` equals attending to ``s`` copies of it (prefix tokens hold one).
    """
    bias = torch.nn.functional.pad(sizes.log(), (num_prefix, 0))  # log 1 = 0 for prefix tokens
    if bias.dtype != dtype:
        bias = bias.to(dtype)
    return bias.view(bias.shape[0], 1, 1, bias.shape[1])
