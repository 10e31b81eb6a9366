"""What a patched model class adds to its timm class (each family's patched class mixes
these in; swapped in by class like the blocks).

Changed methods, which differ from timm's only while a forward pruned something:

- ``pool`` (``forward_head`` for BEiT and relpos, which average inline): average pooling
  weights every token by the number of original patches it stands for
  (``PruneState.sizes``; the fusion token holds all it merged), so the pooled feature
  stays a mean over patches. Attention pooling (``global_pool="map"``) gets the same
  weighting as an additive ``log(size)`` on its attention logits, which equals attending
  to that token repeated ``size`` times. Token, max and no pooling are unchanged.
- ``forward``: with ``class_only_last``, the last block computes the prefix tokens alone
  (``PruneState.head_only``), all a ``global_pool="token"`` head reads; a direct
  ``forward_features`` or ``forward_intermediates`` computes every token.
- ``forward_features`` (and ``forward_intermediates``'s final features) records on the
  returned tensor the token sizes that produced it, so ``forward_head`` pools any
  features with their own sizes, whatever ran in between or on other threads.
- ``forward_intermediates``: returns NCHW maps of the overlapped grid with
  ``overlap_stride``. Blocks at or after the first pruning stage leave fewer tokens than
  the grid has patches, so their NCHW maps are those tokens spread back over the grid
  (``vitprune.unmerge``: each patch the features of the token that holds it); ``"NLC"``
  returns the tokens themselves.

``timm_class_only_reason`` says whether a timm model's head reads the prefix tokens alone
and its last block can compute them alone (``Family.class_only`` of the ViT, Eva and relative-position families).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NoReturn

import torch
from timm.models._features import feature_take_indices

from ..core.config import kept_tokens
from ..core.registry import family_of, original_block_class, timm_blocks
from ..core.state import enter
from ..core.tokens import is_compiling
from .signature import showing_signature


if TYPE_CHECKING:
    from ..core.state import PruneState

    class _TimmModel(torch.nn.Module):
        """For type checkers only: what the timm model class that a patched class mixes these
        classes into gives them, and what ``patch`` sets."""

        vitprune_state: PruneState
        num_prefix_tokens: int
        global_pool: Any
        attn_pool: Any
        patch_embed: Any
        blocks: Any
        fc_norm: Any
        head_drop: Any
        head: Any

        def forward_features(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...

        def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor: ...

        def forward_intermediates(self, *args: Any, **kwargs: Any) -> Any: ...

        def pool(self, x: torch.Tensor, pool_type: "str | None" = None) -> torch.Tensor: ...

        def _vitprune_sizes(self, x: torch.Tensor) -> "torch.Tensor | None": ...
else:
    _TimmModel = object


#: The attribute ``forward_features`` sets on the features it returns: their token sizes.
SIZES_ATTR = "_vitprune_sizes"

#: The methods of :class:`PrunedModel` that take ``(*args, **kwargs)`` and hand them to timm's:
#: each patched class shows timm's signature for them (``signature.showing_signature``).
_SHOWN_SIGNATURES = ("forward", "forward_features", "forward_intermediates")


def _token_head_reason(model: Any) -> "str | None":
    """Why ``model``'s head may read more than its prefix tokens (a sentence), or ``None``
    when it reads them alone (timm's ``global_pool="token"``, no attention pool): the first
    condition of ``class_only_last`` (``Family.class_only``) for timm's models."""
    attn_pool = getattr(model, "attn_pool", None)
    if attn_pool is not None:  # timm runs it whatever global_pool says
        pooling = f"an attention pool ({type(attn_pool).__name__})"
    elif model.global_pool != "token":
        pooling = f"global_pool={model.global_pool!r}"
    else:
        return None
    return (f"the head must read the class token alone (global_pool='token'), but this model pools "
            f"with {pooling}, which reads every token of the last block")


def timm_class_only_reason(model: Any, blocks: "tuple[type, ...]", attention: str,
                           accepts: "Callable[[torch.nn.Module], bool]") -> "str | None":
    """Why ``class_only_last`` cannot apply to a timm model (a sentence), or ``None``: its head
    must read the prefix tokens alone (:func:`_token_head_reason`), its last block be of one of
    ``blocks`` (original classes), and that block's ``attn`` be one ``accepts`` takes
    (``attention`` describes those, for the message)."""
    head = _token_head_reason(model)
    if head is not None:
        return head
    last = timm_blocks(model)[-1]
    kind, attn = original_block_class(last), getattr(last, "attn", None)
    if kind not in blocks:
        return f"the last block must be a timm {' or '.join(b.__name__ for b in blocks)}, but it is a {kind.__name__}"
    if attn is None or not accepts(attn):
        found = "no attention module" if attn is None else f"a {type(attn).__name__}"
        return f"the last block's attention must be {attention}, but it has {found}"
    return None


def size_weighted_mean(tokens: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Mean over the token axis of ``(B, n, C)`` tokens, each counted ``sizes`` ``(B, n)`` times."""
    weights = sizes.to(tokens.dtype).unsqueeze(-1)
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1)


def _mark(features: torch.Tensor, sizes: "torch.Tensor | None") -> torch.Tensor:
    """Record ``sizes`` on ``features`` (eager only: traced graphs pool in-graph)."""
    if not is_compiling() and isinstance(features, torch.Tensor):
        setattr(features, SIZES_ATTR, sizes)
    return features


class PrunedModel(_TimmModel):
    """What every patched model class adds to its timm class (see the module docs)."""

    #: The parameters of the timm class's ``forward_intermediates`` after ``self``, in order, and
    #: the defaults of those that have one: read once per class (``inspect`` does not compile;
    #: the forward binds its arguments by these).
    _vitprune_intermediates_names: "tuple[str, ...]" = ()
    _vitprune_intermediates_defaults: Dict[str, Any] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        timm_class = super(PrunedModel, cls)
        for name in _SHOWN_SIGNATURES:  # these take (*args, **kwargs): show timm's parameters
            original = getattr(timm_class, name, None)
            if original is not None:
                setattr(cls, name, showing_signature(getattr(cls, name), original))
        method = getattr(timm_class, "forward_intermediates", None)
        if method is not None:
            parameters = list(inspect.signature(method).parameters.values())[1:]
            cls._vitprune_intermediates_names = tuple(p.name for p in parameters)
            cls._vitprune_intermediates_defaults = {p.name: p.default for p in parameters if p.default is not p.empty}

    def _vitprune_sizes(self, x: torch.Tensor) -> "torch.Tensor | None":
        """The token sizes of features ``x``: those recorded on it by ``forward_features`` (also
        where a compiled caller is given them: a compiled ``forward_head``); else, while tracing,
        those of the forward being traced (features made in the graph carry no record); ``None``
        when every token is one patch.

        Raises:
            ValueError: ``x`` does not come from ``forward_features`` (a copy, say) and this
                thread's last forward left tokens of this count with unequal sizes, so
                ``x``'s sizes cannot be known.
        """
        state = self.__dict__.get("vitprune_state")
        if hasattr(x, SIZES_ATTR):  # dynamo reads (and guards on) an input's attribute
            return getattr(x, SIZES_ATTR)
        sizes = None if state is None else state.sizes
        if sizes is None or sizes.shape != (x.shape[0], x.shape[1] - self.num_prefix_tokens):
            return None
        if not is_compiling() and bool((sizes != 1).any()):
            raise ValueError(
                "vitprune: these features did not come from this model's forward_features (or "
                "forward_intermediates), so the number of patches each token stands for is unknown "
                "and size-weighted pooling would guess; pass forward_features' output itself to "
                "forward_head, or call the model on the images"
            )
        return sizes

    def __prepare_scriptable__(self) -> NoReturn:  # torch.jit.script calls this first
        raise TypeError(
            "vitprune: a patched model cannot be compiled by torch.jit.script (its forward keeps "
            "Python state per call); use torch.compile, torch.export or torch.onnx.export, or "
            "vitprune.unpatch the model first"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """timm's ``forward``; with ``class_only_last``, its last block computes the prefix
        tokens alone while the head reads the class token alone (checked at every call: a
        model whose pooling changed, or whose last block was quantized, since ``patch`` runs
        the whole block, exactly)."""
        state = self.vitprune_state
        family = family_of(self) if state.config.class_only_last else None
        head_only = family is not None and family.class_only_refusal(self) is None
        return state.run_forward(head_only, super().forward, *args, **kwargs)

    def forward_features(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return enter(self._vitprune_forward_features, *args, **kwargs)

    def _vitprune_forward_features(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        state = self.vitprune_state
        if not state.in_forward:  # called directly: every token, through every block
            state.head_only = False
        features = super().forward_features(*args, **kwargs)
        return _mark(features, state.sizes)

    def pool(self, x: torch.Tensor, pool_type: "str | None" = None) -> torch.Tensor:
        return enter(self._vitprune_pool, x, pool_type)

    def _vitprune_pool(self, x: torch.Tensor, pool_type: "str | None") -> torch.Tensor:
        sizes = self._vitprune_sizes(x)
        pool_type = self.global_pool if pool_type is None else pool_type
        weighted = self.attn_pool is not None or pool_type in ("avg", "avgmax")
        if sizes is None or not weighted:
            return super().pool(x, pool_type)
        P = self.num_prefix_tokens
        include = self._vitprune_pool_prefix()
        tokens = x if include else x[:, P:]
        if include:
            sizes = torch.cat([sizes.new_ones(sizes.shape[0], P), sizes], dim=1)
        if self.attn_pool is not None:
            return self.attn_pool(tokens, attn_mask=sizes.log().to(x.dtype)[:, None, None, :])
        mean = size_weighted_mean(tokens, sizes)
        return mean if pool_type == "avg" else 0.5 * (tokens.amax(dim=1) + mean)

    def _vitprune_pool_prefix(self) -> bool:
        """Whether pooling reads the prefix tokens too (timm's ``pool_include_prefix``)."""
        return bool(getattr(self, "pool_include_prefix", False))

    def forward_intermediates(self, *args: Any, **kwargs: Any) -> Any:
        return enter(self._vitprune_forward_intermediates, *args, **kwargs)

    def _vitprune_forward_intermediates(self, *args: Any, **kwargs: Any) -> Any:
        names, defaults = self._vitprune_intermediates_names, self._vitprune_intermediates_defaults
        options: Dict[str, Any] = {**defaults, **dict(zip(names, args)), **kwargs}
        if (len(args) > len(names) or any(name in kwargs for name in names[:len(args)])
                or any(name not in options for name in names)):
            return super().forward_intermediates(*args, **kwargs)  # Python's own TypeError for the call
        state = self.vitprune_state
        state.head_only = False  # every token, through every block
        images = options["x"]
        height, width = self.patch_embed.dynamic_feat_size(tuple(images.shape[-2:]))
        grid = int(height), int(width)
        first = self._vitprune_first_pruning_block(grid[0] * grid[1])
        take, _ = feature_take_indices(len(self.blocks), options["indices"])
        blocks = sorted(set(int(i) for i in take))  # the order timm appends them in
        spread = options["output_fmt"] == "NCHW" and first is not None and bool(blocks) and blocks[-1] >= first
        if spread:  # the reduced blocks' tokens are no grid: take tokens, spread them back over it
            options["output_fmt"] = "NLC"
        state.wants_groups = spread  # compiled and traced forwards record them too
        try:
            out = super().forward_intermediates(**options)
        finally:
            state.wants_groups = False
        final = out.get("image_features") if isinstance(out, dict) else out[0] if isinstance(out, tuple) else None
        if isinstance(final, torch.Tensor):
            _mark(final, state.sizes)
        if spread:
            out = _spread_intermediates(self, out, blocks, grid)
        return out

    def _vitprune_first_pruning_block(self, n: int) -> "int | None":
        """The first block that drops tokens of ``n`` patches, or ``None``."""
        for index, rate in zip(*self.vitprune_state.config.schedule()):
            if kept_tokens(rate, n) < n:  # until a stage prunes, every stage sees all n patches
                return index
        return None


def _spread_intermediates(model: Any, out: Any, blocks: "list[int]", grid: "tuple[int, int]") -> Any:
    """timm's ``forward_intermediates`` output ``out`` (NLC, of ``blocks`` in order) with every
    intermediate spread back over the ``grid`` of patches (``vitprune.unmerge``) as an NCHW map,
    in the same structure: a dict, ``(final, maps)``, or the maps alone; each map paired with
    its prefix tokens where they were."""
    from ..core.unmerge import unmerge  # not at the top: core.patching imports this package

    def to_map(tokens: torch.Tensor, block: int) -> torch.Tensor:
        patches = unmerge(model, tokens, block)
        return patches.reshape(patches.shape[0], *grid, -1).permute(0, 3, 1, 2).contiguous()

    def convert(taken: List[Any]) -> List[Any]:
        return [(to_map(t[0], b), t[1]) if isinstance(t, tuple) else to_map(t, b) for t, b in zip(taken, blocks)]

    if isinstance(out, dict):
        return {**out, "image_intermediates": convert(out["image_intermediates"])}
    if isinstance(out, tuple):
        return out[0], convert(out[1])
    return convert(out)


class MeanPoolingHead(_TimmModel):
    """For models whose ``forward_head`` averages inline (BEiT, relpos): the same, size-weighted."""

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return enter(self._vitprune_forward_head, x, pre_logits)

    def _vitprune_forward_head(self, x: torch.Tensor, pre_logits: bool) -> torch.Tensor:
        sizes = self._vitprune_sizes(x)
        if sizes is None or self.global_pool != "avg":
            return super().forward_head(x, pre_logits)
        x = size_weighted_mean(x[:, self.num_prefix_tokens:], sizes)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)


