"""CUDA checks that CPU tests cannot make: fp16/bf16 agreement and equivalence on a GPU.

    python examples/gpu_checks.py [--device cuda]

For the shipped models on their test subsets (2,000 images), the paper's method with var
and medad and vitprune's defaults (merging in every block) at keep 0.7: whether scores and
outputs stay finite under fp16 and bf16 autocast, and which fraction of the kept patches
agrees with fp32 at every stage. Then, for a few families on random
weights, the largest difference from the unpatched model with nothing pruned, on CUDA (and,
for token-pooled ones, of the defaults (``class_only_last`` on) from the same patch without it);
whether, with float16 and bfloat16 weights, nothing reduced with every token through the last
block gives the unpatched outputs bit for bit, as on the CPU; the defaults' gradients with
and without gradient checkpointing; a batch of deit_small against each image alone
(float64); and the nothing-pruned difference for ``transformers``
ViT and SigLIP (eager and sdpa) when it is installed. Last, repeatability: how far two
calls on the same images differ for the defaults, the paper's method, dropping and token
merging (bf16 weights, batch 64; 2 off CUDA), plainly and under ``torch.use_deterministic_algorithms``,
where each must repeat bit for bit and train (merging sums tokens with ``index_add_``, whose
CUDA kernel adds atomically in no fixed order), and what that mode costs in time (11
interleaved rounds, median). Prints one line per check; exits non-zero if any output is
not finite or the half-precision, checkpointing, batch or repeatability check fails.
``--device cpu`` runs the same checks on the CPU (autocast there too), to see that the
script still runs before a GPU is at hand; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for determinism
import timm  # noqa: E402
import torch  # noqa: E402

import vitprune  # noqa: E402
from vitprune.core.config import PAPER_OPTIONS  # noqa: E402
from vitprune.core.registry import family_of  # noqa: E402
from vitprune.data import datasets  # noqa: E402
from vitprune.data import shipped as demo_models  # noqa: E402
from vitprune.commands.bench import time_interleaved  # noqa: E402
from vitprune.measure.sync import device_sync  # noqa: E402
from gpu_cuda_graph import deterministic, eager_spread, settings as graph_settings  # noqa: E402  (examples/ is first on sys.path)


#: The families of the nothing-pruned checks on the device: timm model name, create_model arguments.
FP32_FAMILIES = (("deit_small_patch16_224", {}), ("vit_base_patch16_siglip_224", {}),
                 ("vit_base_patch16_xp_224", {}), ("vit_small_patch14_reg4_dinov2", {"img_size": 224}))


def agreement(reference, got) -> float:
    """Mean over images and stages of the fraction of kept patches both runs keep."""
    fractions = [torch.isin(a[i][a[i] >= 0], b[i][b[i] >= 0]).float().mean()
                 for a, b in zip(reference, got) for i in range(len(a))]
    return torch.stack(fractions).mean().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="where to run (default: cuda)")
    device = torch.device(parser.parse_args().device)
    ok = True
    for dataset in ("fashion_mnist", "cluttered"):
        model, _ = demo_models.load_shipped(dataset)
        model = model.to(device)
        x = datasets.to_input(demo_models.load_test_subset(dataset)[0]).to(device)
        for name, options in (("var", dict(indicator="var", **PAPER_OPTIONS)),
                              ("medad", dict(indicator="medad", **PAPER_OPTIONS)),
                              ("defaults", {})):
            vitprune.patch(model, keep_rate=0.7, **options)
            with torch.no_grad():
                model(x)
                reference = [p.clone() for p in vitprune.kept_positions(model)]
                for dtype in (torch.float16, torch.bfloat16):
                    with torch.autocast(device.type, dtype=dtype):
                        out = model(x)
                    finite = bool(torch.isfinite(out).all())
                    ok &= finite
                    print(f"{dataset} {name} {dtype}: finite={finite} "
                          f"kept-set agreement with fp32 {agreement(reference, vitprune.kept_positions(model)):.4f}")
    for name, kwargs in FP32_FAMILIES:
        torch.manual_seed(0)
        model = timm.create_model(name, **kwargs).to(device).eval()
        x = torch.randn(8, 3, 224, 224, device=device)
        with torch.no_grad():
            expected = model(x)
            vitprune.patch(model, keep_rate=1.0)
            error = (model(x) - expected).abs().max().item()
        print(f"{name}: max abs difference with nothing pruned, {device.type} fp32: {error:.2e}")
        if model.global_pool == "token":  # the class token alone in the last block: the same logits
            with torch.no_grad():
                reference = vitprune.patch(model, keep_rate=0.7, class_only_last=False)(x)
                only = vitprune.patch(model, keep_rate=0.7)(x)  # on by default where it is exact
            if vitprune.get_config(model).class_only_last:
                print(f"{name}: class_only_last at keep 0.7, max abs difference from without it: "
                      f"{(only - reference).abs().max().item():.2e}")
            else:
                print(f"{name}: class_only_last is off by default here: {family_of(model).class_only(model)}")
    ok &= rounding_check(device)
    ok &= checkpointing_check(device)
    ok &= per_image_check(device)
    ok &= transformers_checks(device)
    ok &= repeatability_check(device)
    return 0 if ok else 1


def checkpointing_check(device: torch.device) -> bool:
    """Gradient checkpointing on CUDA, where autograd runs the backward (and so the blocks'
    recomputation) on a thread of its own: the defaults' gradients with and without it."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = timm.create_model("deit_small_patch16_224").to(device).train()
        vitprune.patch(model, keep_rate=0.7)
        model.set_grad_checkpointing(checkpointing)
        x = torch.randn(8, 3, 224, 224, device=device, generator=torch.Generator(device).manual_seed(1))
        model(x).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    error = max((a - b).abs().max().item() for a, b in zip(*grads))
    print(f"deit_small defaults, gradient checkpointing on {device.type}: max abs gradient difference {error:.2e}")
    return error < 1e-3


def rounding_check(device: torch.device) -> bool:
    """Half-precision weights on ``device``: keep 1.0 in every block, every token through the
    last, against the unpatched model in float16 and bfloat16, for the families of the
    fp32 check. On the CPU every one gives timm's outputs bit for bit
    (``tests/test_families.py``); on a GPU torch picks its attention kernels by shape and
    dtype, so this shows whether the patch's calls still land on timm's."""
    ok = True
    for name, kwargs in FP32_FAMILIES:
        torch.manual_seed(0)
        base = timm.create_model(name, **kwargs).eval()
        for dtype in (torch.float16, torch.bfloat16):
            model = copy.deepcopy(base).to(device, dtype)
            x = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            with torch.no_grad():
                expected = model(x)
                vitprune.patch(model, keep_rate=1.0, stages="all", class_only_last=False)
                got = model(x)
            same = torch.equal(got, expected)
            ok &= same
            print(f"{name} {dtype} weights, nothing reduced, every token through the last, {device.type}: "
                  f"{'bit for bit' if same else f'max abs difference {(got - expected).abs().max().item():.2e}'}")
    return ok


def per_image_check(device: torch.device) -> bool:
    """A batch gives every image what it gives alone on ``device`` (float64, deit_small with
    random weights, the defaults and the paper's method at keep 0.7): the batch-of-one merge
    and the batched one, and the device's own index kernels, against each other."""
    ok = True
    torch.manual_seed(0)
    model = timm.create_model("deit_small_patch16_224").to(device, torch.float64).eval()
    x = torch.randn(4, 3, 224, 224, device=device, dtype=torch.float64)
    for name, options in (("defaults", {}), ("paper (var)", dict(indicator="var", **PAPER_OPTIONS))):
        vitprune.patch(model, keep_rate=0.7, **options)
        with torch.no_grad():
            together = model(x)
            alone = torch.cat([model(image.unsqueeze(0)) for image in x])
        error = (together - alone).abs().max().item()
        ok &= error < 1e-6
        print(f"deit_small {name}, batch of 4 against each image alone, {device.type} fp64: max abs difference {error:.2e}")
    return ok


def repeatability_check(device: torch.device, batch: Optional[int] = None) -> bool:
    """Two calls of deit_small (random bf16 weights) on the same images: the largest difference,
    plainly and under ``torch.use_deterministic_algorithms`` (which must be 0, with a training
    forward and backward that runs), for the defaults, the paper's method, dropping and token
    merging at the defaults' FLOPs. ``batch``: 64 on CUDA, 2 elsewhere (a CPU run only checks
    that the script runs, and a CPU without bfloat16 units takes minutes a setting at 8)."""
    batch = batch or (64 if device.type == "cuda" else 2)
    torch.manual_seed(0)
    base = timm.create_model("deit_small_patch16_224").to(device, torch.bfloat16).eval()
    shared = graph_settings(base)  # the CUDA-graph script's, at keep 0.7
    settings = {name: shared[name] for name in ("defaults", "paper (var)", "token merging")}
    settings["drop"] = vitprune.patch(copy.deepcopy(base), keep_rate=0.7, reduction="drop")
    x = torch.randn(batch, 3, 224, 224, device=device, dtype=torch.bfloat16)
    ok = True
    for name, model in settings.items():
        plain = eager_spread(model, x)
        try:
            with deterministic():
                fixed = eager_spread(model, x)
                model.train()
                model(x[:8]).float().square().mean().backward()
            trains = "and trains"
        except RuntimeError as error:  # an operator with no deterministic kernel
            fixed, trains = float("nan"), f"failed: {error}"
        finally:
            model.eval()
        ok &= fixed == 0.0
        print(f"deit_small {name}, bf16 batch {batch} on {device.type}, two calls on the same images: largest "
              f"difference {plain:.3g}; under deterministic algorithms {fixed:.3g} {trains}; "
              f"{deterministic_cost(model, x):.3f}x the plain forward's time there")
    return ok


def deterministic_cost(model: torch.nn.Module, x: torch.Tensor, rounds: int = 11) -> float:
    """Median time of ``model``'s inference forward under deterministic algorithms over its
    plain time, interleaved."""
    def plain() -> None:
        with torch.inference_mode():
            model(x)

    def fixed() -> None:
        with deterministic():
            plain()

    seconds = time_interleaved({"plain": plain, "deterministic": fixed}, rounds, warmup=2,
                               sync=device_sync(x.device), progress=False)
    return seconds["deterministic"] / seconds["plain"]


def transformers_checks(device: torch.device) -> bool:
    """Base-size ``transformers`` ViT and SigLIP tower on ``device`` (random weights), for each
    attention implementation: the difference from the unpatched model with nothing pruned,
    and whether keep 0.7 stays finite under bf16 autocast. Skipped without transformers."""
    try:
        import transformers as T
    except ImportError:
        print("transformers: not installed, skipped")
        return True
    base = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072)
    ok = True
    for make in (lambda: T.ViTForImageClassification(T.ViTConfig(**base)),
                 lambda: T.SiglipVisionModel(T.SiglipVisionConfig(**base))):
        for implementation in ("eager", "sdpa"):
            torch.manual_seed(0)
            model = make().to(device).eval()
            model.config._attn_implementation = implementation
            x = torch.randn(8, 3, 224, 224, device=device)
            with torch.no_grad():
                expected = _main(model(x))
                vitprune.patch(model, keep_rate=1.0)
                error = (_main(model(x)) - expected).abs().max().item()
                vitprune.patch(model, keep_rate=0.7)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    finite = bool(torch.isfinite(_main(model(x))).all())
            ok &= finite
            print(f"{type(model).__name__} {implementation}: max abs difference with nothing pruned, {device.type} fp32: "
                  f"{error:.2e}; keep 0.7 bf16 finite={finite}")
    return ok


def _main(output) -> torch.Tensor:
    return output.logits if getattr(output, "logits", None) is not None else output.pooler_output


if __name__ == "__main__":
    sys.exit(main())
