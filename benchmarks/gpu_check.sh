#!/usr/bin/env bash
# The GPU check in one run, first thing on any GPU: the copy bandwidth, kernels compiled against
# their references, runtime logits vs the CPU, tree-verify invariance, CUDA graphs vs eager (same
# prompts, 0 expected), the verify cost curve, FP8 recipes in hardware and their decode speed vs
# bf16 (Triton and cuBLAS linears), each timed step's bytes, GB/s, fraction of bandwidth and
# launches, the speculative bench on a real GGUF (after a warm-up pass), the plugin kernel tests;
# each step within its share of a 420 s budget (the shares add up to it: < 8 min). Reads first:
# OUTDIR/gpu_summary.md (and .json): machine, versions, each check's value, target, pass/fail and
# for a failure the file and function to look at; the roofline of every timed step. Needs python3
# with torch, triton, numpy; no network; installs nothing. Exit 1 if a step failed or raised.
#
#   bash benchmarks/gpu_check.sh OUTDIR [model.gguf | stem of its parts]     # on the GPU
#   bash benchmarks/gpu_check.sh --dry-run OUTDIR [model.gguf]               # CPU, CI: every step,
#       small shapes, the embedded GGUF by default; exit 1 unless every step was exercised
#
# A GGUF over 64 MiB travels in parts (benchmarks/gpu_payload.py; the plan: docs/building.md).
set -u
cd "$(dirname "$0")/.."
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
OUT=${1:?usage: gpu_check.sh [--dry-run] OUTDIR [model.gguf]}
GGUF=${2:-}
PY=${PYTHON:-python3}
if [ -z "$GGUF" ] && [ ${#DRY[@]} -gt 0 ]; then
  GGUF=$($PY -c "from backend.build.embedded import default_gguf; print(default_gguf())") || exit 1
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
exec $PY benchmarks/gpu_check.py --out "$OUT" "${DRY[@]}" ${GGUF:+--gguf "$GGUF"} ${BUDGET:+--budget "$BUDGET"} \
    ${STEPS:+--steps "$STEPS"}
