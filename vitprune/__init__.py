"""vitprune: reduce the patch tokens of a pretrained timm Vision Transformer, in place.

>>> import timm, vitprune
>>> model = timm.create_model("deit_small_patch16_224")
>>> vitprune.patch(model, keep_rate=0.7)  # the measured best: merging, size-aware, every block
>>> vitprune.patch(model, indicator="var", keep_rate=0.7, stages=(3, 6, 9),  # the paper's method
...                selection="top", reduction="fuse", size_aware=False)
>>> vitprune.unpatch(model)

See docs/method.md for the method and README.md for the evidence behind the defaults.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List, Tuple

__version__ = "0.1.0"

#: Public name -> the module that defines it. Imported on first use, so ``import vitprune``
#: (and ``vitprune --help``) loads neither torch nor timm until something needs them.
_EXPORTS = {
    "INDICATORS": "core.config", "REDUCTIONS": "core.config", "SELECTIONS": "core.config",
    "PruneConfig": "core.config", "default_stages": "core.config", "keep_count": "core.config",
    "get_config": "core.patching", "is_patched": "core.patching", "kept_positions": "core.patching",
    "patch": "core.patching", "unpatch": "core.patching", "supported_models": "core.patching",
    "token_groups": "core.patching", "unmerge": "core.unmerge",
    "fit_merging": "measure.baseline", "merging_config": "measure.baseline",
    "OverlapOption": "measure.budget", "fit_keep_rate": "measure.budget", "fit_overlap": "measure.budget",
    "overlap_options": "measure.budget",
    "analytic_flops": "measure.flops", "count_flops": "measure.flops",
    "build_settings": "measure.evaluate", "evaluate": "measure.evaluate",
    "kept_masks": "pictures.visualize", "visualize": "pictures.visualize",
}

__all__ = [
    "INDICATORS", "OverlapOption", "PruneConfig", "REDUCTIONS", "SELECTIONS", "SUPPORTED_MODELS",
    "analytic_flops", "build_settings", "count_flops", "default_stages", "evaluate", "fit_keep_rate", "fit_merging", "fit_overlap",
    "get_config", "is_patched", "keep_count", "kept_masks", "kept_positions", "merging_config",
    "overlap_options", "patch", "supported_models", "token_groups", "unmerge", "unpatch", "visualize",
]

if TYPE_CHECKING:  # what static tools and IDEs see
    from .core.config import INDICATORS, REDUCTIONS, SELECTIONS, PruneConfig, default_stages, keep_count
    from .core.patching import get_config, is_patched, kept_positions, patch, supported_models, token_groups, unpatch
    from .core.unmerge import unmerge
    from .measure.baseline import fit_merging, merging_config
    from .measure.budget import OverlapOption, fit_keep_rate, fit_overlap, overlap_options
    from .measure.evaluate import build_settings, evaluate
    from .measure.flops import analytic_flops, count_flops
    from .pictures.visualize import kept_masks, visualize

    SUPPORTED_MODELS: Tuple[type, ...]


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_MODELS":  # model classes ``patch`` accepts, one per registered family
        value = importlib.import_module(f"{__name__}.core.patching").supported_models()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted({*globals(), *__all__})  # a set: a public name used once is in both
