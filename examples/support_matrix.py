"""The support matrix in README: every timm ViT family, on random weights.

    python examples/support_matrix.py --out docs/support.md

For each family's example model: whether ``vitprune.patch`` accepts it (or the reason it
refuses), and for vitprune's defaults (``patch(model, keep_rate=...)``) and the paper's
method (``var`` at three stages, one fusion token) alike: the largest absolute difference
from the unpatched model with nothing pruned (keep rate 1.0, fp32, eval), and the measured
inference speedup at keep rate 0.7 (CPU, batch --batch, median of --rounds interleaved
rounds, the three models taking turns in one run) next to its FLOP ratio (fvcore counts).
Writes a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import timm
import torch
from tqdm.auto import tqdm

import vitprune
from vitprune.commands.bench import make_step, time_interleaved
from vitprune.core.config import PAPER_OPTIONS
from vitprune.core.grid import input_size
from vitprune.measure.flops import count_flops
from reporting import markdown_table

#: (family, example model, extra create_model arguments)
FAMILIES: List[Tuple[str, str, Dict]] = [
    ("ViT (Block)", "vit_small_patch16_224", {}),
    ("DeiT, distilled (2 prefix tokens)", "deit_small_distilled_patch16_224", {}),
    ("DeiT III (LayerScale)", "deit3_small_patch16_224", {}),
    ("ResPostBlock, no class token, avg pool", "vit_base_patch16_rpn_224", {}),
    ("ParallelThingsBlock", "vit_small_patch16_18x2_224", {}),
    ("ParallelScalingBlock (RmsNorm, qk-norm)", "vit_base_patch16_xp_224", {}),
    ("CLIP image tower", "vit_base_patch16_clip_224", {}),
    ("DINOv2", "vit_small_patch14_dinov2", {"img_size": 224}),
    ("DINOv2 with registers", "vit_small_patch14_reg4_dinov2", {"img_size": 224}),
    ("hybrid (ResNet stem)", "vit_small_r26_s32_224", {}),
    ("FlexiViT", "flexivit_small", {}),
    ("global average pooling", "vit_base_patch16_gap_224", {}),
    ("SigLIP, average pooling", "vit_base_patch16_siglip_gap_224", {}),
    ("SigLIP, attention pool (map)", "vit_base_patch16_siglip_224", {}),
    ("EVA-02 (rope, SwiGLU)", "eva02_small_patch14_224", {}),
    ("rope ViT, mixed rope", "vit_small_patch16_rope_mixed_224", {}),
    ("DINOv3 (rope, registers)", "vit_small_patch16_dinov3", {"img_size": 224}),
    ("Perception Encoder (rope, map pool)", "vit_pe_core_small_patch16_384", {"img_size": 224}),
    ("BEiT (relative position bias)", "beit_base_patch16_224", {}),
    ("ViT relpos (no class token)", "vit_relpos_small_patch16_224", {}),
    ("ViT relpos, res-post blocks", "vit_relpos_medium_patch16_rpn_224", {}),
    ("NaFlexVit", "naflexvit_base_patch16_gap", {}),
    ("Hiera", "hiera_tiny_224", {}),
    ("XCiT", "xcit_nano_12_p16_224", {}),
    ("SAM image encoder", "samvit_base_patch16", {"img_size": 256}),
    ("CaiT", "cait_xxs24_224", {}),
    ("Swin", "swin_tiny_patch4_window7_224", {}),
]


#: The two methods of the matrix: name, and the options ``patch`` gets besides the keep rate.
METHODS: Dict[str, Dict] = {"defaults": {}, "paper": {"indicator": "var", **PAPER_OPTIONS}}


def measure(name: str, kwargs: Dict, batch: int, rounds: int) -> Dict:
    """Error at keep 1.0 and speedup at keep 0.7 of each of :data:`METHODS` on one model, or
    why ``patch`` refuses it (a method that refuses a model the other accepts is an error)."""
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs).eval()
    pruned, refusals = {}, {}
    for method, options in METHODS.items():
        try:
            pruned[method] = vitprune.patch(copy.deepcopy(model), keep_rate=0.7, **options)
        except TypeError as error:
            refusals[method] = str(error).split("; supported:")[0].split(": ", 1)[-1]
    if refusals:
        if pruned:
            raise RuntimeError(f"{name}: {sorted(pruned)} accept it, {sorted(refusals)} refuse it: {refusals}")
        return {"supported": False, "reason": next(iter(refusals.values()))}
    x = torch.randn(batch, 3, *input_size(model, kwargs.get("img_size")), generator=torch.Generator().manual_seed(1))
    result: Dict = {"supported": True, "source": pruned["paper"].vitprune_state.row_source}
    unpruned_flops = count_flops(model)
    with torch.no_grad():
        reference = model(x)
        for method, options in METHODS.items():
            equal = vitprune.patch(copy.deepcopy(model), keep_rate=1.0, **options)
            result[method] = {"error": (equal(x) - reference).abs().max().item(),
                              "ideal": unpruned_flops / count_flops(pruned[method])}
    steps = {"unpruned": make_step(model, x, "infer", torch.float32)}
    steps.update({method: make_step(pruned[method], x, "infer", torch.float32) for method in METHODS})
    seconds = time_interleaved(steps, rounds=rounds, warmup=1, sync=lambda: None, progress=False)
    for method in METHODS:
        result[method]["speedup"] = seconds["unpruned"] / seconds[method]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=None, help="example model names to run (default: all)")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args()
    chosen = [f for f in FAMILIES if args.only is None or f[1] in args.only]
    rows = []
    for family, name, kwargs in tqdm(chosen, desc="families", file=sys.stderr):
        result = measure(name, kwargs, args.batch, args.rounds)
        if result["supported"]:
            source = "class token row" if result["source"] == "cls" else "mean received attention"
            cells = [f"{result[method]['error']:.1e}" for method in METHODS]
            cells += [f"{result[method]['speedup']:.2f}x (FLOPs {result[method]['ideal']:.2f}x)" for method in METHODS]
            rows.append([family, f"`{name}`", f"yes ({source})", *cells])
        else:
            rows.append([family, f"`{name}`", "no: " + result["reason"].replace("|", "/"),
                         *["-"] * (2 * len(METHODS))])
    command = "python " + " ".join(sys.argv)
    table = markdown_table(["family", "example model", "supported (the paper's scores from)",
                            *[f"max abs error, keep 1.0, {method}" for method in METHODS],
                            *[f"speedup at keep 0.7, {method}" for method in METHODS]], rows)
    text = (f"Command: `{command}` ({torch.get_num_threads()} CPU threads, batch {args.batch}, "
            f"torch {torch.__version__}, timm {timm.__version__}, random weights)\n\n{table}\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
