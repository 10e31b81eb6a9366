"""vitprune: reduce the patch tokens of a pretrained timm Vision Transformer, in place.

>>> import timm, vitprune
>>> model = timm.create_model("deit_small_patch16_224")
>>> vitprune.patch(model, keep_rate=0.7)  # the measured best: merging, size-aware, every block
>>> vitprune.patch(model, indicator="var", keep_rate=0.7, stages=(3, 6, 9),  # the paper's method
...                selection="top", reduction="fuse", size_aware=False)
>>> vitprune.unpatch(model)

See docs/method.md for the method and README.md for the evidence behind the defaults.
"""

from . import families  # noqa: F401  (registers the timm families)
from .core.config import INDICATORS, REDUCTIONS, SELECTIONS, PruneConfig, default_stages, keep_count
from .core.patching import get_config, is_patched, kept_positions, patch, supported_models, unpatch
from .measure.baseline import fit_merging, merging_config
from .measure.budget import OverlapOption, fit_keep_rate, fit_overlap, overlap_options
from .measure.flops import analytic_flops, count_flops
from .pictures.visualize import kept_masks, visualize

__version__ = "0.1.0"

#: Model classes ``patch`` accepts (exact type match), one per registered family.
SUPPORTED_MODELS = supported_models()

__all__ = [
    "INDICATORS",
    "OverlapOption",
    "PruneConfig",
    "REDUCTIONS",
    "SELECTIONS",
    "SUPPORTED_MODELS",
    "analytic_flops",
    "count_flops",
    "default_stages",
    "fit_keep_rate",
    "fit_merging",
    "fit_overlap",
    "get_config",
    "is_patched",
    "keep_count",
    "kept_masks",
    "kept_positions",
    "merging_config",
    "overlap_options",
    "patch",
    "unpatch",
    "visualize",
]
