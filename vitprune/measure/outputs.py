"""The tensor a model's output stands for: timm models return it; ``transformers`` models
return an output object that holds it (logits, projected embeddings, pooled output)."""

from __future__ import annotations

from typing import Any

import torch

#: Fields of a ``transformers`` output, in the order a user would read them.
_FIELDS = ("logits", "image_embeds", "pooler_output", "last_hidden_state")


def main_tensor(output: Any) -> torch.Tensor:
    """``output`` itself when it is a tensor, else its first field of :data:`_FIELDS` that is set.

    Raises:
        TypeError: The output holds none of them.
    """
    if isinstance(output, torch.Tensor):
        return output
    for field in _FIELDS:
        value = getattr(output, field, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot find the output tensor in a {type(output).__name__} (looked for a tensor or "
                    f"{', '.join(_FIELDS)})")


def logits_of(output: Any) -> torch.Tensor:
    """Class scores: ``output`` itself when it is a tensor, else its ``logits``.

    Raises:
        TypeError: The output has no class scores (a backbone or vision tower).
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned a {type(output).__name__} without logits: accuracy needs an "
                        "image classifier")
    return logits
