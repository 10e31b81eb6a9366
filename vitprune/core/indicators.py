"""Patch importance scores from the class token's attention, one per head (docs/method.md §2).

Pure torch functions. Each takes ``attn`` of shape ``(B, H, N)``: for every image and
head, the class token's softmax attention over the ``N`` patch tokens. Each returns
float32 scores of shape ``(B, N)``; higher means keep.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

Score = Callable[[torch.Tensor], torch.Tensor]


def head_variance(attn: torch.Tensor) -> torch.Tensor:
    """Population variance across heads: ``mean_h (a_h - mean_h a_h)^2``.

    The paper's Eq. 6 prints the deviation without its square, which sums to zero
    for every patch; this is the variance it names. (Written out: ``Tensor.var`` over
    the head axis is 30x slower on CPU.)
    """
    a = attn.float()
    return (a - a.mean(dim=1, keepdim=True)).square().mean(dim=1)


def median(t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """The textbook median along ``dim``: the mean of the two middle values for an even count.

    ``torch.median`` returns the lower middle value instead, which would make
    :func:`head_medad` identically zero for two heads (one deviation is always 0).
    """
    ordered = t.sort(dim=dim).values
    count = t.shape[dim]
    upper = ordered.narrow(dim, count // 2, 1)
    middle = upper if count % 2 else (ordered.narrow(dim, count // 2 - 1, 1) + upper) / 2
    return middle if keepdim else middle.squeeze(dim)


def head_medad(attn: torch.Tensor) -> torch.Tensor:
    """Median absolute deviation across heads: ``median_h |a_h - median_h a_h|``.

    Both medians run over the head axis, separately for every patch, and are textbook
    medians (see :func:`median`), as in ``numpy.median`` and
    ``scipy.stats.median_abs_deviation``.
    """
    a = attn.float()
    return median((a - median(a, dim=1, keepdim=True)).abs(), dim=1)


def head_mean(attn: torch.Tensor) -> torch.Tensor:
    """Mean attention across heads: EViT's class-attention score, our baseline."""
    return attn.float().mean(dim=1)


def uniform_random(attn: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Uniform scores in [0, 1), independent of the attention: the ablation baseline.

    Drawn on the generator's device (CPU by default) and moved to ``attn``'s device,
    so a seeded run gives the same choice on every device.
    """
    gen_device = generator.device if generator is not None else attn.device
    scores = torch.rand(attn.shape[0], attn.shape[2], generator=generator, device=gen_device)
    return scores.to(attn.device)


def head_agreement(attn: torch.Tensor) -> torch.Tensor:
    """Minus the variance across heads: ranks the patches the heads agree on first.

    The falsifier the paper's referee asked for: if keeping these does as well as
    keeping the most diverse patches, diversity is not what carries the method.
    """
    return -head_variance(attn)


SCORES: Dict[str, Score] = {
    "var": head_variance,
    "medad": head_medad,
    "cls": head_mean,
    "lowvar": head_agreement,
}
