"""Every model name of timm's ViT modules through vitprune, on random weights: what to run
on each new timm release.

    python examples/timm_sweep.py --out docs/timm_sweep.md

Each model is built with ``--depth`` blocks where its constructor takes ``depth`` (its own
depth otherwise; a setting given per block of its own depth, :data:`PER_BLOCK`, is taken
from evenly spaced blocks), at its own input size, and checked for:

- refusal: ``patch`` raises ``TypeError``/``ValueError`` before touching the model (its
  output unchanged after the refusal);
- keep 1.0: the patched model's output equals the unpatched one (largest absolute error);
- the defaults and the paper's method at keep 0.7 run and give finite outputs;
- ``unpatch`` restores the output exactly, the state dict and the class;
- analytic FLOPs against fvcore's products (its count without the norms, which the
  analytic count leaves out), unpruned and at both configurations, where the model is at
  most ``--fvcore-max-width`` wide (tracing the widest takes minutes each).

With ``--variants`` it sweeps :data:`VARIANTS` instead: a few models, each built with one
constructor option at a time away from timm's defaults (registers, pooling, norms, rope and
relative-bias settings), which no model name builds.

    python examples/timm_sweep.py --variants --out docs/timm_variants.md

Writes one JSON line per model to ``--jsonl`` and a summary table to ``--out``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import timm
import torch
from timm.models import _registry

import vitprune
from vitprune.core.config import PAPER_OPTIONS
from vitprune.measure.flops import count_flops

#: timm modules whose models are ViTs vitprune patches or names as refused.
MODULES = ("vision_transformer", "deit", "eva", "beit", "vision_transformer_relpos", "vision_transformer_hybrid",
           "vision_transformer_sam", "naflexvit")
#: Largest relative gap between the analytic count and fvcore's products that passes.
FLOP_GAP = 0.01
CONFIGS = {"defaults": {"keep_rate": 0.7}, "paper": {"indicator": "var", "keep_rate": 0.7, **PAPER_OPTIONS}}

_NO_CLASS = dict(class_token=False, global_pool="avg")
_TOKEN = dict(class_token=True, global_pool="token")
#: Per model, constructor options one at a time away from timm's defaults (``--variants``):
#: what the model names alone never build. A BEiT with a shared relative bias failed only here.
VARIANTS: Dict[str, List[Dict[str, Any]]] = {
    "deit_tiny_patch16_224": [
        _NO_CLASS, dict(reg_tokens=2), dict(reg_tokens=2, no_embed_class=True), dict(_NO_CLASS, reg_tokens=4),
        dict(pre_norm=True), dict(fc_norm=True), dict(global_pool="avg"), dict(global_pool="avgmax"),
        dict(global_pool="max"), dict(global_pool="map"), dict(global_pool=""), dict(qk_norm=True),
        dict(init_values=0.1), dict(dynamic_img_size=True), dict(dynamic_img_size=True, dynamic_img_pad=True),
        dict(pos_embed="none"), dict(final_norm=False), dict(proj_bias=False), dict(qkv_bias=False),
        dict(scale_attn_norm=True), dict(scale_mlp_norm=True), dict(norm_layer="rmsnorm"),
    ],
    "vit_small_patch16_rope_224": [
        dict(use_rot_pos_emb=False), dict(use_abs_pos_emb=True), dict(num_reg_tokens=2), dict(global_pool="avg"),
        dict(global_pool="map"), _NO_CLASS, dict(swiglu_mlp=True), dict(scale_mlp=True), dict(scale_attn_inner=True),
        dict(qkv_fused=False), dict(dynamic_img_size=True), dict(init_values=0.1), dict(rope_type="mixed"),
        dict(rope_type="dinov3"), dict(qk_norm=True), dict(use_post_norm=True), dict(rope_grid_indexing="xy"),
    ],
    "beit_base_patch16_224": [
        dict(use_abs_pos_emb=True), dict(use_rel_pos_bias=False), dict(use_rel_pos_bias=False, use_abs_pos_emb=True),
        dict(use_shared_rel_pos_bias=True), dict(use_shared_rel_pos_bias=True, use_rel_pos_bias=False),
        dict(init_values=None), dict(global_pool="token"), dict(qkv_bias=False), dict(use_fc_norm=False),
        dict(global_pool=""),
    ],
    "vit_relpos_small_patch16_224": [
        dict(rel_pos_type="bias"), dict(class_token=True), _TOKEN, dict(_TOKEN, rel_pos_type="bias"),
        dict(shared_rel_pos=True), dict(init_values=0.1), dict(qk_norm=True), dict(global_pool=""),
        dict(fc_norm=False),
    ],
}


def variant_name(name: str, options: Dict[str, Any]) -> str:
    """``name(option=value, ...)``, or ``name`` without options."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in options.items())})" if options else name


#: Constructor options that hold one entry per block of the model's own depth, each read back
#: from a block (Sapiens2's key/value heads: full in the first and last blocks, grouped between).
PER_BLOCK = {"num_kv_heads": lambda block: block.attn.num_kv_heads}


def per_block_options(name: str, depth: int) -> Dict[str, tuple]:
    """The :data:`PER_BLOCK` options for ``depth`` blocks: the entries of ``depth`` evenly
    spaced blocks of the model at its own depth (built on the meta device: no weights), so
    the first and the last block are among them."""
    with torch.device("meta"):
        blocks = list(timm.create_model(name, pretrained=False, num_classes=10).blocks)
    picked = [blocks[round(i * (len(blocks) - 1) / max(depth - 1, 1))] for i in range(depth)]
    options = {}
    for option, read in PER_BLOCK.items():
        try:
            options[option] = tuple(read(block) for block in picked)
        except AttributeError:  # blocks without it: the model does not take the option
            continue
    return options


def build(name: str, depth: int, options: Optional[Dict[str, Any]] = None) -> tuple:
    """The model (eval, 10 classes, ``options`` passed to its constructor), the depth it
    was built with (``None``: its own) and the :func:`per_block_options` it needed."""
    options = options or {}
    try:
        return timm.create_model(name, pretrained=False, depth=depth, num_classes=10, **options).eval(), depth, {}
    except TypeError:  # a constructor that fixes its depth
        return timm.create_model(name, pretrained=False, num_classes=10, **options).eval(), None, {}
    except AssertionError:  # per-block settings of its own depth (timm asserts their length)
        per_block = per_block_options(name, depth)
        if not per_block:
            raise
        model = timm.create_model(name, pretrained=False, depth=depth, num_classes=10, **per_block, **options)
        return model.eval(), depth, per_block


def flop_ratio(model: torch.nn.Module, size: tuple) -> Any:
    """Analytic FLOPs over fvcore's products, or the analytic count's refusal."""
    try:
        analytic = vitprune.analytic_flops(model, img_size=size)
    except TypeError as error:
        return f"refused: {str(error).split(';')[-1].split(':')[0].strip()}"
    return analytic / count_flops(model, img_size=size, products_only=True)


def check(name: str, depth: int, fvcore_max_width: int, options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    torch.manual_seed(0)
    label = variant_name(name, options or {})
    try:
        model, built_depth, per_block = build(name, depth, options)
    except Exception as error:  # noqa: BLE001 -- timm cannot build it so (settings of its own depth)
        return {"name": label, "unbuilt": f"{type(error).__name__}: {error}"}
    record: Dict[str, Any] = {"name": label, "class": type(model).__name__, "depth": built_depth}
    if per_block:
        record["per_block"] = {option: list(values) for option, values in per_block.items()}
    size = tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
    x = torch.randn(2, *size)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    width = getattr(model, "embed_dim", getattr(model, "num_features", 0))
    counts = width <= fvcore_max_width
    with torch.no_grad():
        reference = model(x)
        if counts:
            record["flops_unpruned"] = flop_ratio(model, size[1:])
        try:
            vitprune.patch(model, keep_rate=1.0)
        except (TypeError, ValueError) as error:
            record["refused"] = f"{type(error).__name__}: {error}"
            record["untouched"] = type(model).__module__.startswith("timm") and torch.equal(model(x), reference)
            return record
        record["keep1_error"] = float((model(x) - reference).abs().max())
        for label, options in CONFIGS.items():
            vitprune.patch(model, **options)
            record[f"{label}_finite"] = bool(torch.isfinite(model(x)).all())
            if counts:
                record[f"flops_{label}"] = flop_ratio(model, size[1:])
        vitprune.unpatch(model)
        after = model.state_dict()
        record["unpatch_error"] = float((model(x) - reference).abs().max())
        record["unpatch_state"] = set(after) == set(state) and all(torch.equal(state[k], after[k]) for k in state)
        record["unpatch_class"] = type(model).__module__.startswith("timm") and not vitprune.is_patched(model)
    return record


def flop_counts(record: Dict[str, Any]) -> List[Any]:
    """A record's analytic-over-fvcore ratios (floats) and analytic refusals (strings)."""
    return [value for key, value in record.items() if key.startswith("flops_")]


def passed(record: Dict[str, Any], tolerance: float) -> Optional[bool]:
    """Whether a patched model met every check (``None`` for a refused one)."""
    if "refused" in record:
        return None
    ratios = [v for v in flop_counts(record) if isinstance(v, float)]
    return (record["keep1_error"] <= tolerance and record["defaults_finite"] and record["paper_finite"]
            and record["unpatch_error"] == 0 and record["unpatch_state"] and record["unpatch_class"]
            and all(abs(r - 1) < FLOP_GAP for r in ratios))


def summary(records: List[Dict[str, Any]], modules: List[str], command: str, tolerance: float,
            variants: bool = False) -> str:
    """The markdown summary; with ``variants`` records of :data:`VARIANTS` (titled and counted
    as such, and listed by name: the names say which option each one changed)."""
    unit = "variants (one constructor option each)" if variants else "model names"
    patched = [r for r in records if "keep1_error" in r]
    refused = [r for r in records if "refused" in r]
    errors = [r for r in records if "error" in r]
    unbuilt = [r for r in records if "unbuilt" in r]
    failed = [r for r in patched if not passed(r, tolerance)]
    ratios = [v for r in patched for v in flop_counts(r) if isinstance(v, float)]
    uncounted = sorted({r["name"] for r in patched for v in flop_counts(r) if isinstance(v, str)})
    lines = [
        f"# {'timm ViT variants' if variants else 'Every timm ViT model name'} through vitprune", "",
        f"Command: `{command}` (timm {timm.__version__}, torch {torch.__version__}, random weights, fp32, CPU).", "",
        f"- **{len(records)} {unit}** of timm's modules {', '.join(f'`{m}`' for m in modules)}.",
        f"- **{len(patched)} patched**; of those, {len(patched) - len(failed)} pass every check: keep 1.0 equal to "
        f"the unpatched model within {tolerance:g} (largest error "
        f"{max((r['keep1_error'] for r in patched), default=math.nan):.1e}), the defaults and the paper's method "
        f"finite at keep 0.7, `unpatch` exact (output, state dict, class)"
        + (f", analytic FLOPs within {FLOP_GAP * 100:g} % of fvcore's products, norms left out ({len(ratios)} "
           f"counts, ratios {min(ratios):.4f} to {max(ratios):.4f})" if ratios else "") + ".",
        f"- **{len(refused)} refused** before the model is touched "
        f"({sum(bool(r.get('untouched')) for r in refused)} checked unchanged after the refusal).",
        f"- **{len(errors)} raised an unexpected error.**",
    ]
    per_block = [r for r in records if "per_block" in r]
    if per_block:
        names = ", ".join(f"`{r['name']}` ({', '.join(f'{k}={tuple(v)}' for k, v in r['per_block'].items())})"
                          for r in per_block)
        lines.append(f"- Built at the sweep's depth with the per-block settings of evenly spaced blocks of "
                     f"their own depth, first and last among them: {names}.")
    if unbuilt:
        names = ", ".join(f"`{r['name']}`" for r in unbuilt)
        lines.append(f"- Not built by timm at the sweep's depth, so not checked here: {names} (the first one's "
                     f"error: {unbuilt[0]['unbuilt']}).")
    if uncounted:
        lines.append(f"- Analytic FLOPs refused (fvcore only): {', '.join(f'`{n}`' for n in uncounted)}.")
    counted = [r["name"] for r in refused if any(isinstance(v, float) for v in flop_counts(r))]
    if counted:  # a formula for blocks vitprune does not know can only be right by chance
        names = ", ".join(f"`{n}`" for n in counted)
        lines.append(f"- **Analytic FLOPs counted on a model `patch` refuses:** {names}.")
    for title, group in (("Failed a check", failed), ("Unexpected errors", errors)):
        if group:
            lines += ["", f"## {title}", ""] + [f"- `{r['name']}`: {r.get('error', r)}" for r in group]
    reasons: Dict[str, List[str]] = {}
    for r in refused:
        reasons.setdefault(r["refused"].split(": ", 1)[-1].split("; supported:")[0], []).append(r["name"])
    lines += ["", "## Refused, by reason", ""] if reasons else []
    lines += [f"- {reason} ({len(names)}: {', '.join(f'`{n}`' for n in names)})" for reason, names in reasons.items()]
    if variants:
        lines += ["", "## Variants", ""] + [f"- `{r['name']}`" for r in records]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="*", default=list(MODULES), help="timm model modules to sweep")
    parser.add_argument("--names", nargs="*", default=["*"], help="model name patterns (fnmatch) within the modules")
    parser.add_argument("--depth", type=int, default=4, help="blocks per model, where the constructor takes it")
    parser.add_argument("--fvcore-max-width", type=int, default=1024, help="widest model whose FLOPs fvcore traces")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest keep-1.0 error that passes")
    parser.add_argument("--variants", action="store_true",
                        help="sweep VARIANTS (one constructor option at a time) instead of every model name")
    parser.add_argument("--jsonl", type=Path, default=Path("timm_sweep.jsonl"))
    parser.add_argument("--out", type=Path, default=None, help="markdown summary")
    args = parser.parse_args()
    wanted = [n for n in (VARIANTS if args.variants else timm.list_models())
              if _registry._model_to_module.get(n) in args.modules and any(fnmatch.fnmatch(n, p) for p in args.names)]
    runs = [(n, options) for n in wanted for options in VARIANTS[n]] if args.variants else [(n, {}) for n in wanted]
    records = []
    with args.jsonl.open("w") as jsonl:
        for name, options in runs:
            start = time.perf_counter()
            try:
                record = check(name, args.depth, args.fvcore_max_width, options)
            except Exception:  # noqa: BLE001 -- a sweep records every failure and goes on
                record = {"name": variant_name(name, options),
                          "error": traceback.format_exc(limit=-3).strip().splitlines()[-1]}
            record["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps(record), file=jsonl, flush=True)
            print(record["name"], "refused" if "refused" in record else "error" if "error" in record else "ok",
                  flush=True)
            records.append(record)
    if args.out is not None:
        command = " ".join(["python examples/timm_sweep.py", *sys.argv[1:]])
        modules = ([m for m in args.modules if any(_registry._model_to_module.get(n) == m for n in wanted)]
                   if args.variants else args.modules)  # variants: only the modules of the models swept
        args.out.write_text(summary(records, modules, command, args.tolerance, args.variants))


if __name__ == "__main__":
    main()
