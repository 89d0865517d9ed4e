#!/usr/bin/env bash
# The prepared GPU check, for one call of the device tool (the machine has torch,
# transformers, rich, matplotlib and pytest, and no network): CUDA tests, then the seed's
# benchmarks on one GPU.
#   run(command="bash scripts/gpu-check.sh", timeout_s=480)
# Every figure lands in a work folder that is packed into $OUT/gpu-results.tgz after each
# step (the device tool brings back at most 8 files; a timeout keeps what was done), and
# the whole log in $OUT/log.txt. The per-step caps sum to 745 s; the whole run took 330 s
# on an H200 (2026-12-04), so timeout_s=480 leaves room: a step that hangs loses the steps
# after it, never the archive of those before.
# Dry run on a CPU (the flags, not the figures):
#   GPU_CHECK_MODEL=tiny-moe GPU_CHECK_LAYERS=2 GPU_CHECK_NS_SHAPES=4x64x128 \
#     GPU_CHECK_STEPS=2 OUT=/tmp/gpu-dry bash scripts/gpu-check.sh
# ONLY=name1,name2 runs only those steps (a rerun of what failed).
# dion itself (samsja/dion, prime-rl's pin 3c4bce5) for the head-to-head: a source tree given
# as GPU_CHECK_DION_SRC (a folder holding dion/, e.g. `git archive 3c4bce5 dion | tar -x -C
# .dion-src` from a clone made where the network is, named in the run's carry); never
# vendored into the repository.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
RES=$(mktemp -d)
MODEL=${GPU_CHECK_MODEL:-qwen3-30b-a3b}
LAYERS=${GPU_CHECK_LAYERS:-4}
STEPS=${GPU_CHECK_STEPS:-6}
BIG_LAYERS=${GPU_CHECK_BIG_LAYERS:-2}  # 4 layers did not build within the cap on the H200
STEP_IMPLS=${GPU_CHECK_STEP_IMPLS:-shardmuon,shardmuon-gram,shardmuon-unfolded,adamw}
NS_SHAPES=${GPU_CHECK_NS_SHAPES:-}
ONLY=${ONLY:-}
DION_SRC=${GPU_CHECK_DION_SRC:-}
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=python3
# The device's image has no pydantic (train's config needs it): carry it as wheels in .whl
# (python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .whl pydantic pydantic_core annotated-types typing-inspection, at
# the versions of the dev install) and name .whl in the run's carry.
if ! $PY -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
B="$PY -m shardmuon"
exec > >(tee -a "$OUT/log.txt") 2>&1

# step NAME CAP COMMAND...: run one step under a time cap, its output in NAME.txt, then
# pack everything so far.
step() {
  local name=$1 cap=$2
  shift 2
  if [[ -n "$ONLY" && ",$ONLY," != *",$name,"* ]]; then return; fi
  echo "=== $name (cap ${cap}s) $(date +%T)"
  local start=$SECONDS
  timeout "$cap" "$@" 2>&1 | tee "$RES/$name.txt"
  echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - start)) s"
  tar czf "$OUT/gpu-results.tgz" -C "$RES" .
}

$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" \
  | tee "$RES/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv 2>/dev/null | tee -a "$RES/env.txt"

# -k: the gloo worlds' tests ("distributed" in their names) stay out; the NCCL ones
# (test_cuda_distributed.py, whose module name matches too) stay in. test_cuda.py holds the
# caller-streamed offload's memory bound (test_a_caller_streamed_offload_holds_one_chunk_
# above_the_model: peak device memory above the model <= one chunk's state + transients).
step tests 150 $PY -m pytest -q -p no:cacheprovider -rA tests/optimizer/test_cuda.py \
  tests/optimizer/test_cuda_distributed.py \
  tests/ops/test_newton_schulz.py tests/optimizer/test_optimizer_api.py tests/runtime/test_offload.py \
  tests/ops/test_newton_schulz_gram.py tests/qk_clip/test_qk_clip_cuda.py \
  tests/ops/test_fused_normalize.py tests/ops/test_fused_update.py tests/ops/test_fused_momentum.py \
  tests/ops/test_gram_ready.py tests/ops/test_fused_aol.py tests/ops/test_fused_adamw.py tests/runtime/test_graphs.py tests/bench/test_launch_budget.py \
  -k "not distributed or test_cuda_distributed"
SHAPES=()
[[ -n "$NS_SHAPES" ]] && SHAPES=(--shapes "$NS_SHAPES")
# Newton-Schulz per call on the seed's H200 shapes (the GPU default of bench ns): folded
# vs unfolded in bf16, and standard vs Gram in bf16, fp16 and fp32, with the errors on the
# three input kinds; AOL's 4-step preset beside dion's.
step ns 60 $B bench ns "${SHAPES[@]}" --coefficients dion,aol --dtypes bf16,fp16,fp32 --no-progress \
  --json "$RES/ns.json"
# Where a call's time goes: folded with reused buffers vs fresh outputs vs unfolded, the
# whole call with dion's and AOL's schedules, and the divergence guard's pieces.
step pieces 60 $PY scripts/ns_gpu_pieces.py ${NS_SHAPES:+--shapes "$NS_SHAPES" --repeats 2} \
  --json "$RES/pieces.json"
STEP=(bench step --nproc 1 --layout none --model "$MODEL" --layers "$LAYERS" --steps "$STEPS" --no-progress)
# One-GPU optimizer step on real-model shapes, standard vs Gram engine vs AdamW.
step step 60 $B "${STEP[@]}" --impl "$STEP_IMPLS" --order abba \
  --json "$RES/step.json"
# The head-to-head on the same GPU, model and grads: shardmuon, dion's Muon (from
# DION_SRC) and torch.optim.Muon (its 2-D matrices), interleaved.
if [[ -n "$DION_SRC" && -d "$DION_SRC/dion" ]]; then
  step step-dion 90 env PYTHONPATH="$PYTHONPATH:$DION_SRC" $B "${STEP[@]}" \
    --impl shardmuon,dion,torch-muon --order abba --json "$RES/step-dion.json"
else
  echo "=== step-dion skipped: GPU_CHECK_DION_SRC is not a folder holding dion/"
fi
# AOL: one Newton-Schulz iteration fewer; and the measured "auto" (calibrated per shape
# class on this GPU).
step step-aol 40 $B "${STEP[@]}" --impl shardmuon --ns-preconditioner aol --json "$RES/step-aol.json"
step step-auto 40 $B "${STEP[@]}" --impl shardmuon --ns-impl auto --json "$RES/step-auto.json"
# Newton-Schulz calls replayed from CUDA graphs, interleaved: each impl's default row (the
# guarded calls captured), '+eager' (none) and '+graphs' (every call); the default engine
# and the guarded Gram (whose guard decides on the device once captured).
step step-graphs 60 $B "${STEP[@]}" --impl shardmuon,shardmuon-gram --cuda-graphs --order abba \
  --json "$RES/step-graphs.json"
# Optimizer-state offload: the state in pinned host memory, streamed chunk by chunk.
step step-offload 40 $B "${STEP[@]}" --impl shardmuon --offload state --json "$RES/step-offload.json"
# The step behind the next forward. bench step has no forward: 'held ms' is the
# time step() holds the caller, beside the sequential step.
step step-overlap 40 $B "${STEP[@]}" --impl shardmuon --overlap forward --json "$RES/step-overlap.json"
# The training loop, sequential and overlapped (interleaved): "optimizer.step() held the
# loop" plus "the forward waited" is the exposed optimizer time per iteration.
for round in 1 2; do
  for overlap in none forward; do
    step "train-$overlap-$round" 20 $B train --nproc 1 --steps 15 --overlap "$overlap" --no-progress \
      --json "$RES/train-$overlap-$round.json"
  done
done
for overlap in none forward; do
  step "train-big-$overlap" 45 $B train --nproc 1 --model "$MODEL" --layers "$BIG_LAYERS" --steps "$STEPS" \
    --overlap "$overlap" --no-progress --json "$RES/train-big-$overlap.json"
done
# torchtitan's DistMuon beside shardmuon on the same GPU, model and grads (when torchtitan and
# triton import: carry their wheels in .whl as for pydantic).
if $PY -c "import torchtitan.models.qwen3" 2>/dev/null; then
  step distmuon 60 $PY scripts/compare_distmuon.py --device cuda --worlds 1 --dim 1024 --experts 32 \
    --steps 6 --json "$RES/distmuon.json"
else
  echo "=== distmuon skipped: torchtitan (or triton) does not import here"
fi
step ab 25 $B bench ab --model tiny-moe --steps 3 --no-progress --json "$RES/ab.json"
ls -la "$RES"
