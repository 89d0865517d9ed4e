#!/usr/bin/env bash
# The prepared GPU check, for one call of the device tool (the machine has torch,
# transformers, rich, matplotlib and pytest, and no network): CUDA tests, then the seed's
# benchmarks on one GPU. Everything lands under $OUT (default ./gpu-out).
#   run(command="bash scripts/gpu-check.sh", timeout_s=590)
# The per-command caps sum to 575 s; runs end well before them when nothing hangs.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=python3
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/optimizer/test_cuda.py tests/ops/test_newton_schulz.py \
  tests/optimizer/test_optimizer_api.py tests/runtime/test_offload.py tests/ops/test_newton_schulz_gram.py \
  tests/qk_clip/test_qk_clip_cuda.py \
  -k "not distributed" 2>&1 | tail -15 \
  | tee "$OUT/tests.txt"
B="$PY -m shardmuon"
# Newton-Schulz per call on the seed's H200 shapes (the GPU default of bench ns): folded
# vs unfolded in bf16, and standard vs Gram (issue #23) in bf16, fp16 and fp32, with the
# errors on the three input kinds. Two runs, so that a timeout in the second keeps the first.
timeout 60 $B bench ns --presets dion --dtypes bf16,fp16,fp32 --json "$OUT/ns.json" \
  | tee "$OUT/ns.txt"
timeout 35 $B bench ns --presets deepseek-v4 --dtypes bf16,fp16 --json "$OUT/ns-dsv4.json" \
  | tee "$OUT/ns-dsv4.txt"
# One-GPU optimizer step on real-model shapes (multi-rank runs need several GPUs).
timeout 55 $B bench step --nproc 1 --layout none --model qwen3-30b-a3b --layers 4 --steps 6 \
  --json "$OUT/step-qwen3.json" | tee "$OUT/step-qwen3.txt"
# Optimizer-state offload (issue #11): the same step with the state in pinned host memory,
# streamed chunk by chunk, beside the state on the GPU.
timeout 60 $B bench step --nproc 1 --layout none --model qwen3-30b-a3b --layers 4 --steps 6 \
  --impl shardmuon --offload none,state --json "$OUT/step-offload.json" \
  | tee "$OUT/step-offload.txt"
# The whole step, standard vs Gram engine (bf16) in one run.
timeout 55 $B bench step --nproc 1 --layout none --model qwen3-30b-a3b --layers 4 --steps 6 \
  --impl shardmuon,shardmuon-gram --json "$OUT/step-gram.json" | tee "$OUT/step-gram.txt"
# AOL (issue #29): one Newton-Schulz iteration fewer, the default's step beside it.
timeout 55 $B bench step --nproc 1 --layout none --model qwen3-30b-a3b --layers 4 --steps 6 \
  --impl shardmuon --ns-preconditioner aol --json "$OUT/step-aol.json" | tee "$OUT/step-aol.txt"
# The measured "auto" (calibrated per shape class on this GPU, issue #29).
timeout 40 $B bench step --nproc 1 --layout none --model qwen3-30b-a3b --layers 4 --steps 6 \
  --impl shardmuon --ns-impl auto --json "$OUT/step-auto.json" | tee "$OUT/step-auto.txt"
timeout 30 $B bench ab --model tiny-moe --steps 5 --json "$OUT/ab.json" | tee "$OUT/ab.txt"
# The step behind the next forward (issue #32). bench step has no forward: 'held ms' is the
# time step() holds the caller, beside the sequential step. Then the tiny MoE training loop,
# sequential and overlapped: the summary's "optimizer.step() held the loop" and "the
# forward waited" are the exposed optimizer time per iteration.
timeout 45 $B bench step --nproc 1 --layout none --model qwen3-30b-a3b --layers 4 --steps 6 \
  --impl shardmuon --overlap forward --json "$OUT/step-overlap.json" | tee "$OUT/step-overlap.txt"
for overlap in none forward; do
  timeout 25 $B train --nproc 1 --steps 20 --overlap $overlap --no-progress \
    --json "$OUT/train-overlap-$overlap.json" | tee "$OUT/train-overlap-$overlap.txt"
done
