#!/usr/bin/env bash
# The prepared GPU check, for one call of the device tool (the machine has torch,
# transformers, rich, matplotlib and pytest, and no network): CUDA tests, then the seed's
# benchmarks on one GPU. Everything lands under $OUT (default ./gpu-out).
#   run(command="bash scripts/gpu-check.sh", timeout_s=480)
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=python3
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/optimizer/test_cuda.py tests/ops/test_newton_schulz.py \
  tests/optimizer/test_optimizer_api.py tests/runtime/test_offload.py -k "not distributed" 2>&1 | tail -15 \
  | tee "$OUT/tests.txt"
B="$PY -m shardmuon"
# Newton-Schulz per call on the seed's H200 shapes (the GPU default of bench ns).
timeout 120 $B bench ns --presets dion,deepseek-v4 --json "$OUT/ns.json" | tee "$OUT/ns.txt"
# One-GPU optimizer step on real-model shapes (multi-rank runs need several GPUs).
timeout 120 $B bench step --nproc 1 --layout none --model qwen3-30b-a3b --layers 4 --steps 6 \
  --json "$OUT/step-qwen3.json" | tee "$OUT/step-qwen3.txt"
# Optimizer-state offload (issue #11): the same step with the state in pinned host memory,
# streamed chunk by chunk, beside the state on the GPU.
timeout 150 $B bench step --nproc 1 --layout none --model qwen3-30b-a3b --layers 4 --steps 6 \
  --impl shardmuon --offload none,state --json "$OUT/step-offload.json" \
  | tee "$OUT/step-offload.txt"
timeout 60 $B bench ab --model tiny-moe --steps 5 --json "$OUT/ab.json" | tee "$OUT/ab.txt"
