"""The user's module hooks on a patched model: where a patched forward would skip them, and
what it does instead.

- A swapped block runs the layers of its attention module itself (to read the scored row),
  so hooks on that module, or on a container of it, do not run. ``patch`` warns of those it
  finds (:func:`warn_of_bypassed_hooks`); a block warns, at its first eager call, of those
  registered since (:func:`warn_of_new_hooks`). Each hook is named once.
- The last block with ``class_only_last`` computes the queries of the prefix tokens alone,
  from slices of a fused ``qkv``'s weight; where the user hooked that ``qkv`` it is called
  instead, on every token, as timm calls it (:func:`hooked_by_user`).

``transformers``' output recorders and fvcore's tracer are not the user's (:data:`_TOOLS`).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Set, Tuple

from torch import nn

from .registry import Family

#: Handle ids of the hooks already named in a warning (ids are unique within a process).
_NAMED: Set[int] = set()


#: Hooks that are tools' own, not the user's: ``transformers``' output recorders (the patched
#: layers serve what they record) and the scope hooks fvcore's tracer puts on every module (they
#: read no tensor; ``count_flops`` must count what runs without them). ``fully_shard``'s hooks
#: count as the user's: on an attention module or its ``qkv`` they gather the parameters.
_TOOLS = ("transformers.", "fvcore.")


def _users_hook(hook: Any) -> bool:
    return not str(getattr(hook, "__module__", "")).startswith(_TOOLS)


def hooked_by_user(module: nn.Module) -> bool:
    """Whether the user hooked ``module`` itself (four truth tests when no one has)."""
    return bool(users_hooks(module))


def users_hooks(module: nn.Module) -> List[int]:
    """Handle ids of the user's forward, forward-pre and backward hooks on ``module`` itself."""
    if not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
            or module._backward_pre_hooks):  # almost always: four truth tests
        return []
    return [key for table in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                              module._backward_pre_hooks) for key, hook in table.items() if _users_hook(hook)]


#: What to hook instead, in both warnings.
_INSTEAD = "hook the block, or the attention's own layers (its projections), which still run"


#: Where a swapped block keeps the modules it does not call: per module, the attribute path
#: from the block, and its name in the model (for messages).
Bypassed = Tuple[Tuple[Tuple[str, ...], str], ...]


def bypassed(family: Family, block: nn.Module, name: str) -> Bypassed:
    """The modules of ``block`` (named ``name`` in the model) whose forward a swapped block
    does not call: its attention modules and the modules that hold them (not a
    ``ModuleList`` or ``ModuleDict``, which are never called)."""
    found = {}
    for attention in family.attention_modules(block):
        parts = tuple(attention.split("."))
        for depth in range(1, len(parts) + 1):
            if not isinstance(_module(block, parts[:depth]), (nn.ModuleList, nn.ModuleDict)):
                found[parts[:depth]] = f"{name}.{'.'.join(parts[:depth])}"
    return tuple(found.items())


def _module(block: nn.Module, parts: Tuple[str, ...]) -> nn.Module:
    for part in parts:
        block = block._modules[part]  # type: ignore[assignment]
    return block


def _name_hooks(block: nn.Module, where: Bypassed) -> List[str]:
    """The names of the modules at ``where`` with hooks not named before; marks them named."""
    named = []
    for parts, name in where:
        ids = [key for key in users_hooks(_module(block, parts)) if key not in _NAMED]
        if ids:
            named.append(name)
            _NAMED.update(ids)
    return named


def warn_of_bypassed_hooks(blocks: nn.ModuleList, where: Dict[int, Bypassed]) -> None:
    """Warn where a block ``patch`` swaps (index -> its :func:`bypassed` modules) has hooks on a
    module it does not call."""
    silenced = [name for index, modules in where.items() for name in _name_hooks(blocks[index], modules)]
    if silenced:
        warnings.warn(
            f"vitprune runs the layers of these attention modules itself, so the hooks registered on "
            f"them will not run while the model is patched: {', '.join(silenced)}; {_INSTEAD}",
            UserWarning, stacklevel=3)


def warn_of_new_hooks(block: nn.Module, where: Bypassed) -> None:
    """Warn, once per hook, where a module at ``where`` in ``block``, which this call of the
    block does not call, has hooks registered after ``patch``."""
    fresh = _name_hooks(block, where)
    if fresh:
        warnings.warn(
            f"vitprune: hooks were registered on {', '.join(fresh)} after patch; the patched block runs "
            "the layers of these attention modules itself, so the hooks do not run while the model is "
            f"patched; {_INSTEAD}, or unpatch", UserWarning, stacklevel=4)
