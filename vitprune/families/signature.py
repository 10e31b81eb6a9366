"""A patched class's methods keep the signature of the methods they replace."""

from __future__ import annotations

import functools
from typing import Any, Callable


def showing_signature(body: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """A method that runs ``body`` and shows ``original``'s signature, name and docs.

    The patched classes take ``(*args, **kwargs)`` and hand them on to the class they
    patch, whatever its parameters are; tools that read a model's parameters by name must
    still find the original's: ``torch.export``'s ``dynamic_shapes={"x": ...}``,
    ``transformers``' ``Trainer`` (it keeps the dataset columns ``forward`` takes).
    ``inspect.signature`` follows ``__wrapped__`` to ``original``."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return body(self, *args, **kwargs)

    return functools.update_wrapper(method, original)
