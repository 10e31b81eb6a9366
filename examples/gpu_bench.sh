#!/usr/bin/env bash
# The GPU speed table, in one command on a CUDA machine (about 6-8 minutes on one H200):
#   bash examples/gpu_bench.sh [OUT_DIR]
# deit_small and vit_base, bf16 autocast, batch 256, inference; eager with var and medad,
# then eager and torch.compile side by side with var; then examples/gpu_checks.py
# (fp16/bf16 kept-set agreement and CUDA equivalence). Writes one JSON per table to OUT_DIR (default docs/bench),
# and prints the tables; copy them into README with the date and the GPU's name.
set -euo pipefail
out="${1:-docs/bench}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu_name.txt"
python -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__)" | tee -a "$out/gpu_name.txt"
common=(--device cuda --dtype bf16 --batch 256 --keep-rates 1.0 0.7 --rounds 10 --warmup 3 --no-progress)
for model in deit_small_patch16_224 vit_base_patch16_224; do
  vitprune bench --model "$model" "${common[@]}" --indicators default var medad --out "$out/gpu_${model}_eager.json"
  vitprune bench --model "$model" "${common[@]}" --indicators var --compile both --out "$out/gpu_${model}_compiled.json"
done
python examples/gpu_checks.py | tee "$out/gpu_checks.txt"
python examples/gpu_host_time.py | tee "$out/gpu_host_time.txt"
