"""vitprune: prune the patch tokens of a pretrained timm Vision Transformer, in place.

>>> import timm, vitprune
>>> model = timm.create_model("deit_small_patch16_224")
>>> vitprune.patch(model, indicator="var", keep_rate=0.7, stages=(3, 6, 9))
>>> vitprune.unpatch(model)
"""

from .budget import OverlapOption, fit_keep_rate, fit_overlap, overlap_options
from .config import INDICATORS, PruneConfig, default_stages, keep_count
from .flops import analytic_flops, count_flops
from .patching import SUPPORTED_MODELS, get_config, is_patched, kept_positions, patch, unpatch
from .visualize import kept_masks, visualize

__version__ = "0.1.0"

__all__ = [
    "INDICATORS",
    "OverlapOption",
    "PruneConfig",
    "SUPPORTED_MODELS",
    "analytic_flops",
    "count_flops",
    "default_stages",
    "fit_keep_rate",
    "fit_overlap",
    "get_config",
    "is_patched",
    "keep_count",
    "kept_masks",
    "kept_positions",
    "overlap_options",
    "patch",
    "unpatch",
    "visualize",
]
