#!/usr/bin/env bash
# The GPU checks and speed table, in one command on a CUDA machine:
#   bash examples/gpu_bench.sh [OUT_DIR]
# First examples/gpu_checks.py (fp16/bf16 kept-set agreement and CUDA equivalence) and
# examples/gpu_host_time.py (host enqueue time against forward time); examples/gpu_cuda_graph.py
# (each setting replayed from a CUDA graph against eager, batch 256 and 1); then deit_small and
# vit_base at bf16 autocast, batch 256, inference: eager with the defaults, var, medad and
# token merging; the defaults' method in every second and every third block at the
# defaults' FLOPs; deit_small at 384 pixels, batch 64 and 1; eager and torch.compile side
# by side with var; compile times; last, the defaults compiled. Correctness comes first so
# that a run cut short by a time limit still has it.
# Each step's output is written to OUT_DIR (default docs/bench) as it runs; a failing step
# is reported and the rest still run, and the exit status is non-zero if any failed. Runs
# from a source checkout without installing (python -m vitprune). It writes 16 files; where
# only a few can come back, set GPU_BENCH_TAR=FILE: OUT_DIR is packed into that one .tgz after
# every step, so a run stopped by a time limit still returns every step that finished.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/docs/bench}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"  # a relative OUT_DIR is the caller's, as before
[ -z "${GPU_BENCH_TAR:-}" ] || GPU_BENCH_TAR="$(cd "$(dirname "$GPU_BENCH_TAR")" && pwd)/$(basename "$GPU_BENCH_TAR")"
cd "$root"
# the checkout's vitprune for the example scripts too (python examples/x.py puts examples/ first on sys.path)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
failed=0
pack() { [ -z "${GPU_BENCH_TAR:-}" ] || tar czf "$GPU_BENCH_TAR" -C "$out" .; }
step() { echo "== $*" >&2; "$@" || { echo "FAILED ($?): $*" >&2; failed=1; }; pack; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu_name.txt"
python -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__)" | tee -a "$out/gpu_name.txt"
step bash -o pipefail -c "python examples/gpu_checks.py | tee '$out/gpu_checks.txt'"
step bash -o pipefail -c "python examples/gpu_host_time.py | tee '$out/gpu_host_time.txt'"
step bash -o pipefail -c "python examples/gpu_cuda_graph.py | tee '$out/gpu_cuda_graph.txt'"
common=(--device cuda --dtype bf16 --batch 256 --rounds 10 --warmup 3 --no-progress)
for model in deit_small_patch16_224 vit_base_patch16_224; do
  step python -m vitprune bench --model "$model" "${common[@]}" --keep-rates 1.0 0.7 --indicators default var medad --baseline merge --out "$out/gpu_${model}_eager.json"
done
# The defaults' method in fewer, larger steps, at the defaults' FLOPs (keep rates from
# fit_keep_rate for these stages, the same for both models): every second block, every third.
for model in deit_small_patch16_224 vit_base_patch16_224; do
  step python -m vitprune bench --model "$model" "${common[@]}" --keep-rates 0.842857 --indicators default --stages 1,3,5,7,9 --out "$out/gpu_${model}_every2.json"
  step python -m vitprune bench --model "$model" "${common[@]}" --keep-rates 0.748 --indicators default --stages 2,5,8 --out "$out/gpu_${model}_every3.json"
done
# At 384 pixels (576 patches), where on the CPU the defaults came closer to their FLOP ratio
# at batch 1 (docs/speed.md): deit_small, eager, batch 64 and batch 1.
for batch in 64 1; do
  step python -m vitprune bench --model deit_small_patch16_224 --img-size 384 --device cuda --dtype bf16 --batch "$batch" --rounds 10 --warmup 3 --no-progress --keep-rates 0.7 --indicators default var --baseline merge --out "$out/gpu_deit_small_384_b${batch}.json"
done
for model in deit_small_patch16_224 vit_base_patch16_224; do
  step python -m vitprune bench --model "$model" "${common[@]}" --keep-rates 1.0 0.7 --indicators var --compile both --out "$out/gpu_${model}_compiled.json"
done
# How long compiling takes on the GPU: the unpruned model and the defaults with their step as
# one opaque operator (examples/compile_time.py; each in a fresh process, 150 s at most each).
# If the opaque step compiles where the defaults never finished, the step's code generation
# is what stalls them.
step python examples/compile_time.py --device cuda --batch 256 --settings unpruned "defaults, opaque step" --timeout 150 --json "$out/gpu_compile_time.json"
# Last, as the slowest to compile (a dozen token counts; over 200 s on a fresh H200 in three tries):
# the defaults compiled, deit_small only.
step python -m vitprune bench --model deit_small_patch16_224 "${common[@]}" --keep-rates 0.7 --indicators default --compile both --out "$out/gpu_deit_small_patch16_224_compiled_defaults.json"
exit "$failed"
