"""The model families ``patch`` accepts: one record per model class, registered by the
module that implements the family (``vitprune/families/``), and the reasons known
families are refused. ``patching`` reads only this registry."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple, cast

from torch import nn


def timm_blocks(model: nn.Module) -> nn.ModuleList:
    """A timm ViT's transformer blocks."""
    return cast(nn.ModuleList, model.blocks)


def timm_prefix(model: nn.Module) -> int:
    """Tokens before the patches in a timm ViT (class, distillation, registers)."""
    return cast(int, model.num_prefix_tokens)


def timm_class_token(model: nn.Module) -> bool:
    return getattr(model, "cls_token", None) is not None


def timm_check(model: nn.Module) -> None:
    """Refuse the timm pooling modes a reduced token would mislead (``TypeError``)."""
    from timm.layers import AttentionPoolLatent

    pools = ("token", "", "avg", "avgmax", "max", "map")
    if model.global_pool not in pools:
        raise TypeError(
            f"vitprune supports global_pool in {pools}, got {model.global_pool!r}: "
            "this pooling would treat the fusion token as a single patch"
        )
    attn_pool = getattr(model, "attn_pool", None)
    if attn_pool is not None and (type(attn_pool) is not AttentionPoolLatent or attn_pool.pos_embed is not None):
        raise TypeError(
            f"vitprune supports attention pooling by timm's AttentionPoolLatent without a position "
            f"embedding (global_pool='map'), got {type(attn_pool).__name__}: its input must stay a full grid"
        )


def grid_patches(model: nn.Module, stride: Optional[int]) -> int:
    """Patch tokens at the model's own input size (with ``stride`` for overlapping patches),
    from its patch convolution (``core.grid``)."""
    from .grid import num_patches

    try:
        return num_patches(model, None, stride)
    except (AttributeError, TypeError):
        return int(getattr(model.patch_embed, "num_patches"))


def no_class_only(model: nn.Module) -> Optional[str]:
    return ("vitprune implements it for timm's VisionTransformer, VisionTransformerDistilled, Eva, Beit and "
            "VisionTransformerRelPos and for transformers' ViT and DeiT classifiers only")


#: Where PyTorch's dynamically quantized layers live: they quantize their input on a scale
#: taken from all of it, so a row's result depends on the other rows given with it.
_DYNAMIC_QUANTIZED = "torch.ao.nn.quantized.dynamic."


def _dynamic_quantized(module: nn.Module) -> bool:
    return type(module).__module__.startswith(_DYNAMIC_QUANTIZED)


def _holds_dynamic_quantized(module: nn.Module) -> bool:
    for child in module._modules.values():
        if child is not None and (_dynamic_quantized(child) or _holds_dynamic_quantized(child)):
            return True
    return False


def row_coupled_layer(block: nn.Module) -> Optional[str]:
    """A sentence naming the first layer of ``block`` whose result for a token depends on
    the other tokens it is given (a dynamically quantized ``Linear``, from
    ``torch.ao.quantization.quantize_dynamic``), or ``None``: computing the prefix tokens
    alone is exact only where every layer treats each token on its own."""
    if not _holds_dynamic_quantized(block):  # the forward asks at every call: a quick walk first
        return None
    name, layer = next((n, m) for n, m in block.named_modules() if _dynamic_quantized(m))
    return (f"the last block's {name} is a dynamically quantized {type(layer).__name__}, which rounds its "
            "input on a scale taken from every token it is given, so the prefix tokens computed alone "
            "would round otherwise")


def no_extras(model: nn.Module) -> "list[nn.Module]":
    return []


def own_attention(block: nn.Module) -> Dict[str, nn.Module]:
    """The attention a block runs through vitprune: its ``attn``."""
    return {"attn": cast(nn.Module, block.attn)}


def attention_heads(block: nn.Module) -> int:
    """Heads of a block's ``attn``."""
    return cast(int, getattr(block.attn, "num_heads"))


@dataclass(frozen=True)
class Family:
    """How vitprune patches one model class.

    Attributes:
        model: The model class, matched exactly.
        patched: The subclass a patched model has (pooling by token size, intermediates), or
            the model class itself where nothing at model level changes.
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
        blocks_of: Where the model keeps its transformer blocks (a ``ModuleList``).
        prefix_of: How many tokens precede the patches (never reduced).
        patches_of: Patch tokens at the model's own input size, given an ``overlap_stride``
            (or ``None``), for the spread schedules.
        class_token_of: Whether token 0 is a class token (its attention row is scored);
            otherwise the mean attention each patch receives is.
        extras: Modules besides the blocks that ``patch`` swaps (a pooling head that must
            weight tokens by size); their classes are keys of ``blocks`` too, and they carry
            the state but no stage.
        check: Raises ``TypeError`` for a model of this class that cannot be patched
            (a pooling that a reduced token would mislead, say).
        library: The library the family comes from, for messages.
        class_only: Why ``class_only_last`` cannot apply to this model (a sentence), or
            ``None`` when it can: its head reads the prefix tokens alone and its last block
            has ``_vitprune_prefix_attention``.
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
    blocks_of: Callable[[nn.Module], nn.ModuleList] = timm_blocks
    prefix_of: Callable[[nn.Module], int] = timm_prefix
    class_token_of: Callable[[nn.Module], bool] = timm_class_token
    patches_of: Callable[[nn.Module, Optional[int]], int] = grid_patches
    check: Callable[[nn.Module], None] = timm_check
    extras: Callable[[nn.Module], "list[nn.Module]"] = no_extras
    library: str = "timm"
    class_only: Callable[[nn.Module], Optional[str]] = no_class_only

    def class_only_refusal(self, model: nn.Module) -> Optional[str]:
        """Why ``class_only_last`` cannot apply to ``model`` as it is now, or ``None``: the
        family's own reason (:attr:`class_only`), else a layer of the last block that
        would round the prefix tokens otherwise when given them alone
        (:func:`row_coupled_layer`). ``patch``, the forward and the FLOP counts all ask this."""
        reason = self.class_only(model)
        if reason is None:
            reason = row_coupled_layer(self.blocks_of(model)[-1])
        return reason

    def foreign_attention(self, block: nn.Module) -> Dict[str, nn.Module]:
        """The block's attention modules, by name, of a class this family cannot run (``patch``
        refuses them, and the analytic FLOPs do not describe them)."""
        return {name: a for name, a in self.attention_modules(block).items() if type(a) not in self.attention}


#: Attributes ``patch`` adds to a block it swaps; ``unpatch`` deletes exactly these.
BLOCK_ATTRS = ("vitprune_state", "vitprune_stage", "vitprune_follow", "vitprune_class_only", "vitprune_bypassed")

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
    "Cait": "its talking-heads attention mixes the heads before and after the softmax, and its class token "
            "joins only in the class-attention blocks after the others: vitprune runs neither on reduced "
            "tokens (size-aware attention and the scored rows would need both)",
    "SwinTransformer": "its windowed attention and patch merging need the full token grid",
    "PyramidVisionTransformerV2": "it is hierarchical (spatial-reduction attention on the full grid)",
    "Twins": "its locally-grouped attention needs the full token grid",
    "MultiScaleVit": "its pooling attention and stages need the full token grid",
    "OptimizedModule": "it is torch.compile's wrapper: patch the model it wraps, vitprune.patch(compiled._orig_mod, "
                       "...) (the wrapper compiles again at its next call), or patch before compiling",
    "DataParallel": "it is a wrapper: patch the model it wraps, vitprune.patch(wrapper.module, ...)",
    "DistributedDataParallel": "it is a wrapper: patch the model it wraps, vitprune.patch(wrapper.module, ...), "
                               "best before wrapping it",
    "PeftModel": "it is peft's wrapper: patch the model it wraps, vitprune.patch(peft_model.base_model.model, ...)",
    "FeatureGetterNet": "it is timm's features_only wrapper: patch the ViT it wraps, "
                        "vitprune.patch(net.model, ...), whose forward_intermediates the wrapper calls "
                        "(maps after pruning are the tokens spread back over the grid)",
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


#: Family modules registered on first need, by the module prefix of the model classes they
#: serve, so ``import vitprune`` (and patching a timm model) never imports those libraries.
LAZY_FAMILIES = {"transformers.": "vitprune.families.hf"}


def family_of(model: nn.Module) -> Optional[Family]:
    """The family of ``model`` (patched or not), or ``None`` when it has none."""
    found = _FAMILIES.get(type(model)) or _PATCHED.get(type(model))
    if found is None and sharded(model):  # fully_shard's FSDP<class> of a patched model: it runs patched
        return next((_PATCHED[c] for c in type(model).__mro__ if c in _PATCHED), None)
    if found is None:
        for prefix, module in LAZY_FAMILIES.items():
            if type(model).__module__.startswith(prefix) and module not in sys.modules:
                importlib.import_module(module)
                return family_of(model)
    return found


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of ``model`` (patched or not), wherever its family keeps them."""
    family = family_of(model)
    return timm_blocks(model) if family is None else family.blocks_of(model)


def original_model_class(model: nn.Module) -> type:
    """The class ``model`` had before ``patch`` (its own class when not patched)."""
    family = _PATCHED.get(type(model))
    return type(model) if family is None else family.model


def original_block_class(block: nn.Module) -> type:
    """The class ``block`` had before ``patch`` (its own class when not swapped; for one that
    ``fully_shard`` sharded after ``patch``, the class before both)."""
    kind = type(block)
    if kind not in _PRUNING_BLOCKS and sharded(block):
        kind = next((c for c in kind.__mro__ if c in _PRUNING_BLOCKS), kind)
    return _PRUNING_BLOCKS.get(kind, kind)


def is_pruning_block(module: nn.Module) -> bool:
    return type(module) in _PRUNING_BLOCKS


def is_patched_model(module: nn.Module) -> bool:
    return type(module) in _PATCHED


#: Why a module sharded by ``fully_shard`` cannot be patched or unpatched.
SHARDED = ("torch.distributed's fully_shard (FSDP2) has given it a class of its own; call vitprune.patch "
           "(and vitprune.unpatch) before fully_shard: patch the model, then shard its blocks and the model")


def sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) has swapped ``module``'s class for a subclass of its own
    (``FSDP<class>``), which vitprune's class swaps would undo."""
    return any(c.__name__ == "FSDPModule" and c.__module__.startswith("torch.distributed")
               for c in type(module).__mro__)


def holds_patch(module: nn.Module) -> bool:
    """Whether ``module``'s class is, or derives from, a class ``patch`` swaps in."""
    return any(c in _PATCHED or c in _PRUNING_BLOCKS for c in type(module).__mro__)
