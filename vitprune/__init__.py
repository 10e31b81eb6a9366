"""vitprune: reduce the patch tokens of a pretrained timm Vision Transformer, in place.

>>> import timm, vitprune
>>> model = timm.create_model("deit_small_patch16_224")
>>> vitprune.patch(model, keep_rate=0.7)  # the measured best: merging, size-aware, every block
>>> vitprune.patch(model, indicator="var", keep_rate=0.7, stages=(3, 6, 9),  # the paper's method
...                selection="top", reduction="fuse", size_aware=False)
>>> vitprune.unpatch(model)

See docs/method.md for the method and README.md for the evidence behind the defaults.
"""

from .baseline import fit_merging, merging_config
from .budget import OverlapOption, fit_keep_rate, fit_overlap, overlap_options
from .config import INDICATORS, REDUCTIONS, SELECTIONS, PruneConfig, default_stages, keep_count
from .flops import analytic_flops, count_flops
from .patching import SUPPORTED_MODELS, get_config, is_patched, kept_positions, patch, unpatch
from .visualize import kept_masks, visualize

__version__ = "0.1.0"

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
