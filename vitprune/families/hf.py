"""Hugging Face ``transformers`` ViTs (transformers 5): ViT, DeiT (with the distillation
token), DINOv2 (with registers) and the CLIP vision tower, patched like timm's.

Registered the first time ``patch`` meets a ``transformers`` model (``registry.LAZY_FAMILIES``),
so ``import vitprune`` never imports ``transformers``. Every layer from the first stage on is
swapped for a subclass that runs the attention through vitprune's path (fused
``scaled_dot_product_attention`` unless the model's ``attn_implementation`` is ``"eager"``:
``"flash_attention_2"`` and others run as SDPA there), adds the size bias, and reduces the
tokens between attention and MLP; the layer's own submodules, parameters and hooks are
kept, so ``output_hidden_states`` returns every layer's tokens (fewer after each stage).
With ``output_attentions`` a swapped layer also runs its own attention module on the same
tokens with the size bias as its mask, so ``transformers`` records every layer's weights
(of the pruned length; ``None``-free only where the implementation returns weights, as
unpatched: ``attn_implementation="eager"``); that doubles the attention's cost while asked.
The ViT and DeiT image classifiers, whose heads read the class (and distillation) token
alone, take ``class_only_last``: in a call that asks for neither ``output_hidden_states``
nor ``output_attentions``, the last layer computes the prefix tokens alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput
from transformers.models.clip.modeling_clip import (CLIPAttention, CLIPEncoderLayer, CLIPVisionModel,
                                                    CLIPVisionModelWithProjection)
from transformers.models.deit.modeling_deit import (DeiTAttention, DeiTForImageClassification,
                                                    DeiTForImageClassificationWithTeacher, DeiTLayer, DeiTModel)
from transformers.models.dinov2.modeling_dinov2 import (Dinov2Attention, Dinov2ForImageClassification, Dinov2Layer,
                                                        Dinov2Model)
from transformers.models.dinov2_with_registers.modeling_dinov2_with_registers import (
    Dinov2WithRegistersAttention, Dinov2WithRegistersForImageClassification, Dinov2WithRegistersLayer,
    Dinov2WithRegistersModel)
from transformers.models.siglip.modeling_siglip import (SiglipAttention, SiglipEncoderLayer,
                                                        SiglipMultiheadAttentionPoolingHead, SiglipVisionModel)
from transformers.models.vit.modeling_vit import ViTAttention, ViTForImageClassification, ViTLayer, ViTModel

from ..core.grid import vision_config
from ..core.registry import REFUSED, Family, family_of, no_extras, register
from ..core.state import PruneState, Scored, in_backward
from .attention import AttentionModule, attend, member, prefix_rows, split_heads
from ..core.tokens import is_exporting
from .layouts import PruningBlock, refuse_masks
from .pooling import size_weighted_mean
from .signature import showing_signature


class _Dropout:
    """What ``attend`` needs of a dropout: its rate, whether it is active, and applying it."""

    def __init__(self, p: float, training: bool) -> None:
        self.p, self.training = p, training

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training)


def _num_heads(attn: AttentionModule) -> int:
    """Heads of a ``transformers`` attention module (``num_attention_heads`` or ``num_heads``)."""
    return member(attn, "num_attention_heads") or attn.num_heads


#: Attention classes whose eager ``transformers`` code computes the softmax in float32 (and
#: returns to the model's dtype); DINOv2's computes it in the model's dtype. Under SDPA the
#: explicit product that scoring by mean received attention needs keeps the model's dtype.
_FLOAT32_SOFTMAX = (ViTAttention, DeiTAttention, CLIPAttention, SiglipAttention)


def _attend(attn: AttentionModule, queries: torch.Tensor, x: torch.Tensor, num_prefix: int, source: str,
            bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Scored]:
    """A ``transformers`` attention module (``q_proj``/``k_proj``/``v_proj`` and ``o_proj`` or
    ``out_proj``) through vitprune's path, with queries from ``queries`` and keys and values
    from ``x``, and what the reduction step needs."""
    heads = _num_heads(attn)
    q = split_heads(attn.q_proj(queries), heads).transpose(1, 2)
    k, v = (split_heads(proj(x), heads).transpose(1, 2) for proj in (attn.k_proj, attn.v_proj))
    scale = member(attn, "scaling") or attn.scale
    p = member(attn, "attention_dropout")
    p = attn.dropout if p is None else p
    fused = attn.config._attn_implementation != "eager"
    out, scored = attend(q, k, v, scale=scale, fused=fused, attn_drop=_Dropout(p, attn.training),
                         num_prefix=num_prefix, source=source, bias=bias, follow="transformers",
                         softmax_dtype=torch.float32 if not fused and isinstance(attn, _FLOAT32_SOFTMAX) else None)
    out = out.transpose(1, 2).flatten(2)
    project = member(attn, "o_proj") or attn.out_proj
    return project(out), scored


def hf_attention_with_row(attn: AttentionModule, x: torch.Tensor, num_prefix: int, source: str,
                          bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Scored]:
    """A ``transformers`` attention module through vitprune's path (see :func:`_attend`)."""
    return _attend(attn, x, x, num_prefix, source, bias)


def hf_prefix_attention(attn: AttentionModule, x: torch.Tensor, num_prefix: int,
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``hf_attention_with_row(attn, x, ...)[0][:, :num_prefix]`` without the other tokens'
    queries (``class_only_last``): keys and values from every token."""
    return _attend(attn, x[:, :num_prefix], x, num_prefix, "none", prefix_rows(bias, num_prefix))[0]


#: Per layer class: (first norm, attention, layer scale 1, dropout, second norm, MLP, layer scale 2).
_Names = Tuple[str, str, Optional[str], Optional[str], str, str, Optional[str]]
_NAMES: Dict[type, _Names] = {
    ViTLayer: ("layernorm_before", "attention", None, "dropout", "layernorm_after", "mlp", None),
    DeiTLayer: ("layernorm_before", "attention", None, "dropout", "layernorm_after", "mlp", None),
    Dinov2Layer: ("norm1", "attention", "layer_scale1", "drop_path", "norm2", "mlp", "layer_scale2"),
    Dinov2WithRegistersLayer: ("norm1", "attention", "layer_scale1", "drop_path", "norm2", "mlp", "layer_scale2"),
    CLIPEncoderLayer: ("layer_norm1", "self_attn", None, None, "layer_norm2", "mlp", None),
    SiglipEncoderLayer: ("layer_norm1", "self_attn", None, None, "layer_norm2", "mlp", None),
}


class _HFLayer(PruningBlock):
    """A ``transformers`` pre-norm layer from the first stage on: ``x + drop(scale(attn(norm1(x))))``,
    reduce, ``x + drop(scale(mlp(norm2(x))))``, with its own submodules."""

    _vitprune_names: "_Names"

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> torch.Tensor:
        if not is_exporting():
            refuse_masks(attention_mask, False)
        # While torch.export traces, transformers materializes its "every token visible" mask
        # (it cannot test the user's mask for padding while tracing), so one arrives even
        # when none was given; it masks nothing and is ignored. A user's own mask is refused
        # in eager mode, where it can be told apart.
        norm1, attention, scale1, drop, norm2, mlp, scale2 = self._vitprune_names
        state, x = self.vitprune_state, hidden_states
        bias = self._vitprune_begin(x)
        if not kwargs.get("output_attentions"):  # with it the attention module runs too (below)
            self._vitprune_watch()
        if self.vitprune_class_only and self._vitprune_head_only():
            P = state.num_prefix
            out = hf_prefix_attention(getattr(self, attention), getattr(self, norm1)(x), P, bias)
            x = x[:, :P] + self._vitprune_branch(out, scale1, drop)
            return x + self._vitprune_branch(getattr(self, mlp)(getattr(self, norm2)(x)), scale2, drop)
        normed = getattr(self, norm1)(x)
        out, scored = hf_attention_with_row(getattr(self, attention), normed, state.num_prefix, state.row_source, bias)
        if kwargs.get("output_attentions"):
            # The module itself runs too (its weights are what transformers records), with the
            # size bias as its additive mask; the output stays vitprune's, as without the flag.
            getattr(self, attention)(normed, attention_mask=bias)
        x = self._vitprune_reduce(x + self._vitprune_branch(out, scale1, drop), scored)
        return x + self._vitprune_branch(getattr(self, mlp)(getattr(self, norm2)(x)), scale2, drop)

    def _vitprune_head_only(self) -> bool:
        """Whether this (last) layer computes the prefix tokens alone: only inside the
        classifier's ``forward`` (:class:`_ClassTokenClassifier`), or when recomputing that
        call's layer in the backward pass; a direct call of the backbone runs every token."""
        state = self.vitprune_state
        if not state.in_forward and not in_backward():
            state.head_only = False
        return state.head_only

    def _vitprune_branch(self, out: torch.Tensor, scale: Optional[str], drop: Optional[str]) -> torch.Tensor:
        if scale is not None:
            out = getattr(self, scale)(out)
        return out if drop is None else getattr(self, drop)(out)


def _layer_class(original: type) -> type:
    return type(f"Prune{original.__name__}", (_HFLayer, original),
                {"_vitprune_names": _NAMES[original], "__module__": __name__,
                 "__doc__": f"transformers ``{original.__name__}`` from the first stage on."})


PruneViTLayer = _layer_class(ViTLayer)
PruneDeiTLayer = _layer_class(DeiTLayer)
PruneDinov2Layer = _layer_class(Dinov2Layer)
PruneDinov2WithRegistersLayer = _layer_class(Dinov2WithRegistersLayer)
PruneCLIPEncoderLayer = _layer_class(CLIPEncoderLayer)
PruneSiglipEncoderLayer = _layer_class(SiglipEncoderLayer)
_LAYERS = {ViTLayer: PruneViTLayer, DeiTLayer: PruneDeiTLayer, Dinov2Layer: PruneDinov2Layer,
           Dinov2WithRegistersLayer: PruneDinov2WithRegistersLayer, CLIPEncoderLayer: PruneCLIPEncoderLayer,
           SiglipEncoderLayer: PruneSiglipEncoderLayer}
_ATTENTION = (ViTAttention, DeiTAttention, Dinov2Attention, Dinov2WithRegistersAttention, CLIPAttention,
              SiglipAttention)


class PruneSiglipMultiheadAttentionPoolingHead(PruningBlock, SiglipMultiheadAttentionPoolingHead):
    """SigLIP's attention-pooling head while patched: each token's attention logit gets
    ``+log(size)``, which equals attending to it repeated ``size`` times (as timm's ``map``)."""

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        B, L = hidden_state.shape[:2]
        sizes = self.vitprune_state.sizes
        mask = None
        if sizes is not None and sizes.shape == (B, L):
            heads = self.attention.num_heads
            mask = sizes.log().to(hidden_state.dtype)[:, None, :].repeat_interleave(heads, dim=0)  # (B * heads, 1, L)
        probe = self.probe.repeat(B, 1, 1)
        out = self.attention(probe, hidden_state, hidden_state, attn_mask=mask)[0]
        out = out + self.mlp(self.layernorm(out))
        return out[:, 0]


def _layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer layers (wherever the wrapper keeps it)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(isinstance(m, tuple(_LAYERS)) for m in module):
            return module
    raise TypeError(f"found no transformer layers in this {type(model).__name__}")


def _attention(layer: nn.Module) -> Dict[str, nn.Module]:
    name = "self_attn" if hasattr(layer, "self_attn") else "attention"
    return {name: getattr(layer, name)}


def _heads(layer: nn.Module) -> int:
    return _num_heads(next(iter(_attention(layer).values())))


#: The transformers release these layouts were written and tested for.
MINIMUM_TRANSFORMERS = "5.24"


def _check(model: nn.Module) -> None:
    """Refuse layers of another layout (older transformers split the attention differently).
    The heads need nothing: they read the class (and distillation) token, or weight their
    patch average by token size (DINOv2's classifier, below)."""
    import transformers

    attn = next(iter(_attention(_layers(model)[0]).values()))
    if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj")):
        raise TypeError(f"vitprune supports transformers >= {MINIMUM_TRANSFORMERS} (attention with q_proj, "
                        f"k_proj, v_proj); this is transformers {transformers.__version__}")


def _prefix(extra: int = 0) -> Callable[[nn.Module], int]:
    def prefix(model: nn.Module) -> int:
        config = vision_config(model)
        return 1 + extra + int(getattr(config, "num_register_tokens", 0) or 0)
    return prefix


def _model_class(original: Type[nn.Module], body: Optional[Any] = None) -> type:
    """The class a patched model has: its own, unless the patch changes its ``forward``
    (the classifiers below: DINOv2's pooling, ViT's and DeiT's ``class_only_last``). Keeping
    the class matters where the model records its layers' outputs itself (the backbones):
    ``transformers`` finds what it may record for ``output_hidden_states`` by the model's
    class name. The classifiers leave that to their backbone, and keep the original's name
    (``save_pretrained`` writes it as the checkpoint's architecture) under a qualified name
    of their own (``PruneViTForImageClassification``: what pickle finds in this module).
    Their ``forward`` shows the original's signature: ``Trainer`` reads it to keep the
    dataset's columns the model takes."""
    if body is None:
        return original

    patched = type(original.__name__, (body, original),
                   {"__module__": __name__, "__doc__": f"transformers ``{original.__name__}`` while patched.",
                    "forward": showing_signature(body.forward, original.forward)})
    patched.__qualname__ = f"Prune{original.__name__}"
    return patched


#: Classifiers whose head reads the prefix tokens alone (the class token; DeiT's also the
#: distillation token) of the last layer's output.
_CLASS_TOKEN_CLASSIFIERS = (ViTForImageClassification, DeiTForImageClassification,
                            DeiTForImageClassificationWithTeacher)


def _class_only_reason(model: nn.Module) -> Optional[str]:
    """Why ``class_only_last`` cannot apply to this ``transformers`` model, or ``None``."""
    if isinstance(model, _CLASS_TOKEN_CLASSIFIERS):
        return None
    if isinstance(model, (Dinov2ForImageClassification, Dinov2WithRegistersForImageClassification)):
        return "its classifier reads the mean of the last layer's patch tokens too"
    return (f"a {type(model).__name__} returns every token of its last layer; only the ViT and DeiT "
            "image classifiers read the class token alone")


def _asks(model: nn.Module, kwargs: Dict[str, Any], name: str) -> bool:
    """Whether a call asks for ``output_<name>`` (in its arguments, else the model's config)."""
    value = kwargs.get(f"output_{name}")
    if value is None:
        value = getattr(model.config, f"output_{name}", False)
    return value is not None and value is not False


if TYPE_CHECKING:
    class _HFModel(nn.Module):
        """For type checkers only: what the ``transformers`` model class that a classifier class
        below is mixed into gives it, and what ``patch`` sets."""

        vitprune_state: PruneState
        config: Any
        base_model_prefix: str
        classifier: Any
        loss_function: Any

        def forward(self, *args: Any, **kwargs: Any) -> Any: ...
else:
    _HFModel = object


class _ClassTokenClassifier(_HFModel):
    """A ViT or DeiT classifier while patched: with ``class_only_last`` its last layer computes
    the prefix tokens alone, all its head reads, unless the call asks for the hidden states
    or attentions (then every layer runs whole, and ``transformers`` records every token)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self.vitprune_state
        family = family_of(self)  # asked at every call, as timm's forward asks (a last layer quantized since)
        head_only = bool(state.config.class_only_last) and not (
            _asks(self, kwargs, "hidden_states") or _asks(self, kwargs, "attentions")
        ) and family is not None and family.class_only_refusal(self) is None
        return state.run_forward(head_only, super().forward, *args, **kwargs)


class _Dinov2Classifier(_HFModel):
    """DINOv2's classifier reads the class token and the mean of the patch tokens: the mean
    is weighted by how many patches each token stands for, as in timm's average pooling."""

    def forward(self, pixel_values: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> ImageClassifierOutput:
        backbone = getattr(self, self.base_model_prefix)
        outputs = backbone(pixel_values, attention_mask=attention_mask, **kwargs)
        tokens = outputs.last_hidden_state
        prefix = self.vitprune_state.num_prefix
        patches = tokens[:, prefix:]
        sizes = self.vitprune_state.sizes
        if sizes is not None and sizes.shape == patches.shape[:2]:
            mean = size_weighted_mean(patches, sizes)
        else:
            mean = patches.mean(dim=1)
        logits = self.classifier(torch.cat([tokens[:, 0], mean], dim=1))
        loss = None if labels is None else self.loss_function(labels, logits, self.config, **kwargs)
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions)


REFUSED.update({
    "SiglipModel": "patch its vision tower instead: vitprune.patch(model.vision_model, ...)",
    "CLIPModel": "patch its vision tower instead: vitprune.patch(model.vision_model, ...)",
})

_MODELS = [
    (ViTModel, None, _prefix()), (ViTForImageClassification, _ClassTokenClassifier, _prefix()),
    (DeiTModel, None, _prefix(1)), (DeiTForImageClassification, _ClassTokenClassifier, _prefix(1)),
    (DeiTForImageClassificationWithTeacher, _ClassTokenClassifier, _prefix(1)),
    (Dinov2Model, None, _prefix()), (Dinov2ForImageClassification, _Dinov2Classifier, _prefix()),
    (Dinov2WithRegistersModel, None, _prefix()),
    (Dinov2WithRegistersForImageClassification, _Dinov2Classifier, _prefix()),
    (CLIPVisionModel, None, _prefix()), (CLIPVisionModelWithProjection, None, _prefix()),
    (SiglipVisionModel, None, lambda model: 0),
]


def _siglip_head(model: nn.Module) -> "list[nn.Module]":
    head = getattr(model, "head", None)
    return [head] if isinstance(head, SiglipMultiheadAttentionPoolingHead) else []


PATCHED = {}
for _original, _body, _prefix_of in _MODELS:
    PATCHED[_original] = _model_class(_original, _body)
    if _body is not None:
        globals()[PATCHED[_original].__qualname__] = PATCHED[_original]  # importable by name: pickle finds it
    siglip = _original is SiglipVisionModel
    register(Family(
        model=_original, patched=PATCHED[_original],
        blocks={**_LAYERS, SiglipMultiheadAttentionPoolingHead: PruneSiglipMultiheadAttentionPoolingHead},
        attention=_ATTENTION, follows=True, attention_modules=_attention, heads=_heads, blocks_of=_layers,
        prefix_of=_prefix_of, class_token_of=(lambda model: False) if siglip else (lambda model: True),
        check=_check, extras=_siglip_head if siglip else no_extras, library="transformers",
        class_only=_class_only_reason,
        examples="ViT, DeiT, DINOv2, CLIP and SigLIP vision in transformers"))
