"""The model families ``patch`` accepts: one record per model class, registered by the
module that implements the family (``vitprune/families/``), and the reasons known
families are refused. ``patching`` reads only this registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

from torch import nn


def own_attention(block: nn.Module) -> Dict[str, nn.Module]:
    """The attention a block runs through vitprune: its ``attn``."""
    return {"attn": block.attn}


def attention_heads(block: nn.Module) -> int:
    """Heads of a block's ``attn``."""
    return block.attn.num_heads


@dataclass(frozen=True)
class Family:
    """How vitprune patches one model class.

    Attributes:
        model: The model class, matched exactly.
        patched: The subclass a patched model has (pooling by token size, intermediates).
        blocks: Block class -> its pruning subclass, for the blocks this family swaps.
        attention: The attention classes the pruning blocks know how to run.
        follows: Whether every block from the first stage on is swapped, because each
            carries position terms (rope, relative bias) that must follow the kept tokens.
            Otherwise only the stage blocks are (and, with ``size_aware``, the later ones).
        check_followers: Whether a swapped block that only follows runs vitprune's own
            attention (so its attention class must be known too); ``False`` when it runs
            the block's own forward.
        attention_modules: The attention modules of a block that vitprune runs, by name.
        heads: How many heads the scored attention row of a block has.
        overlap: Whether ``overlap_stride`` applies (an absolute position embedding).
        examples: Model names users know the family by, for messages.
    """

    model: type
    patched: type
    blocks: Mapping[type, type]
    attention: Tuple[type, ...]
    follows: bool = False
    check_followers: bool = True
    attention_modules: Callable[[nn.Module], Dict[str, nn.Module]] = own_attention
    heads: Callable[[nn.Module], int] = attention_heads
    overlap: bool = False
    examples: str = ""


#: Attributes ``patch`` adds to a block it swaps; ``unpatch`` deletes exactly these.
BLOCK_ATTRS = ("vitprune_state", "vitprune_stage", "vitprune_follow")

_FAMILIES: Dict[type, Family] = {}
_PATCHED: Dict[type, Family] = {}
_PRUNING_BLOCKS: Dict[type, type] = {}  # pruning subclass -> original block class

#: Why known model classes cannot be patched by this version, by class name.
REFUSED = {
    "NaFlexVit": "it packs variable-resolution images with per-image padding masks; dropping tokens "
                 "would have to follow each image's mask, which this version does not do",
    "Hiera": "it is hierarchical: its mask-unit attention and pooling stages need the full token grid",
    "Xcit": "its cross-covariance attention mixes channels, not tokens: there is no per-patch "
            "attention to score, and its local patch interaction needs the full grid",
    "VisionTransformerSAM": "its windowed attention blocks partition the full token grid into windows",
    "Cait": "its patch tokens never attend to the class token (it joins only in the last class-attention "
            "blocks), so the self-attention blocks have no class-token row to score",
    "SwinTransformer": "its windowed attention and patch merging need the full token grid",
    "PyramidVisionTransformerV2": "it is hierarchical (spatial-reduction attention on the full grid)",
    "Twins": "its locally-grouped attention needs the full token grid",
    "MultiScaleVit": "its pooling attention and stages need the full token grid",
}


def register(family: Family) -> Family:
    """Make ``family`` patchable; called once by the module that implements it."""
    _FAMILIES[family.model] = family
    _PATCHED[family.patched] = family
    for original, pruning in family.blocks.items():
        _PRUNING_BLOCKS[pruning] = original
    return family


def families() -> Tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


def family_of(model: nn.Module) -> Optional[Family]:
    """The family of ``model`` (patched or not), or ``None`` when it has none."""
    return _FAMILIES.get(type(model)) or _PATCHED.get(type(model))


def original_model_class(model: nn.Module) -> type:
    """The class ``model`` had before ``patch`` (its own class when not patched)."""
    family = _PATCHED.get(type(model))
    return type(model) if family is None else family.model


def original_block_class(block: nn.Module) -> type:
    """The class ``block`` had before ``patch`` (its own class when not swapped)."""
    return _PRUNING_BLOCKS.get(type(block), type(block))


def is_pruning_block(module: nn.Module) -> bool:
    return type(module) in _PRUNING_BLOCKS


def is_patched_model(module: nn.Module) -> bool:
    return type(module) in _PATCHED
