"""Speed of vitprune's defaults at keep 0.7 on Hugging Face ``transformers`` ViTs (random
weights, base size, 224 x 224), against the unpruned model in the same run (interleaved,
median), one row per class, beside the ideal ratio from the analytic FLOP counts; the
README's transformers rows. Where the defaults compute the class token alone in the last layer
(``class_only_last``: the ViT and DeiT classifiers), the same patch without it is timed in the
same rounds too.

    python examples/transformers_speed.py --batch 8 --rounds 11
"""

import argparse
import copy

import torch
import transformers as T

import vitprune
from vitprune.commands.bench import time_interleaved

BASE = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=3072)
MODELS = {
    "ViTForImageClassification": lambda: T.ViTForImageClassification(T.ViTConfig(**BASE)),
    "DeiTForImageClassificationWithTeacher": lambda: T.DeiTForImageClassificationWithTeacher(T.DeiTConfig(**BASE)),
    "Dinov2ForImageClassification": lambda: T.Dinov2ForImageClassification(T.Dinov2Config(**BASE)),
    "Dinov2WithRegistersModel": lambda: T.Dinov2WithRegistersModel(T.Dinov2WithRegistersConfig(**BASE)),
    "CLIPVisionModelWithProjection": lambda: T.CLIPVisionModelWithProjection(T.CLIPVisionConfig(**BASE)),
    "SiglipVisionModel": lambda: T.SiglipVisionModel(T.SiglipVisionConfig(**BASE)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--keep-rate", type=float, default=0.7)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = parser.parse_args()
    x = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    print(f"transformers {T.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"batch {args.batch}, keep {args.keep_rate}, median of {args.rounds} interleaved rounds")
    for name in args.models:
        make = MODELS[name]
        torch.manual_seed(0)
        model = make().eval()
        pruned = vitprune.patch(copy.deepcopy(model), keep_rate=args.keep_rate)
        models = {"unpruned": model, "pruned": pruned}
        if vitprune.get_config(pruned).class_only_last:  # also timed without it, in the same rounds
            models["whole last layer"] = vitprune.patch(copy.deepcopy(model), keep_rate=args.keep_rate,
                                                        class_only_last=False)

        def step(m):
            def run():
                with torch.inference_mode():
                    m(x)
            return run
        seconds = time_interleaved({key: step(m) for key, m in models.items()}, args.rounds, warmup=2,
                                   sync=lambda: None, progress=False)
        for key, label in (("pruned", name), ("whole last layer", "  with class_only_last=False")):
            if key in models:
                speedup = seconds["unpruned"] / seconds[key]
                ideal = vitprune.analytic_flops(model) / vitprune.analytic_flops(models[key])
                print(f"{label:<40} speedup {speedup:.2f}x  FLOP ratio {ideal:.2f}x  ({speedup / ideal:.0%} of it)")


if __name__ == "__main__":
    main()
