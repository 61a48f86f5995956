#!/usr/bin/env bash
# The GPU check in one run, first thing on any GPU (issues 30, 41, 49): the copy bandwidth, every
# Triton kernel compiled up front at the real shapes, the kernel tests (evidence first), the fused
# step's invariance across batch and verify widths, CUDA graphs vs eager, 8B-shape decode (bf16,
# W8A16, cuBLAS, each FP8 recipe; the W8A8 width), the verify cost, the cost curves, the spec
# bench (random weights of the embedded model's shape with its tokenizer: outputs identical to
# plain), the logits vs the CPU, check-kernels; evidence first, each step within its time of a
# 360 s budget (its share and what earlier steps left), so the device call fits 7 minutes and a
# second one fits the same session. Reads first: OUTDIR/gpu_summary.md (and .json): the code's
# commit, the command, versions, the GPU and its bandwidth, each target met or not, every step,
# the kernels each launched, the roofline, and the verdict, last. Needs python3 with torch,
# triton, numpy, safetensors, tokenizers, jinja2; no network; installs nothing. Exit 1 if a step
# failed, raised or was cut.
#
#   python benchmarks/gpu_payload.py prepare work/gpu                  # here, before the device call
#   bash benchmarks/gpu_check.sh OUTDIR work/gpu                         # on the GPU (docs/building.md)
#   bash benchmarks/gpu_check.sh --dry-run OUTDIR                        # CPU, CI: every step, the GPU's
#       code at small shapes (the kernels in Triton's interpreter); exit 1 unless every step ran it
#
# OUTDIR gets six files: gpu_summary.md, gpu_summary.json, gpu_check.log (this output), steps.log
# (the subcommands'), kernels.json, spec_bench.json.
set -u
ARGS="$*"
cd "$(dirname "$0")/.."
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
OUT=${1:?usage: gpu_check.sh [--dry-run] OUTDIR [CARRY]}
CARRY=${2:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
export GPU_CHECK_COMMAND="bash benchmarks/gpu_check.sh $ARGS"
if [ -z "$CARRY" ] && [ ${#DRY[@]} -gt 0 ]; then     # the dry run prepares what a device call carries
  CARRY=$(mktemp -d)/carry
  $PY benchmarks/gpu_payload.py prepare "$CARRY" > /dev/null || exit 1
fi
$PY -u benchmarks/gpu_check.py --out "$OUT" "${DRY[@]}" ${CARRY:+--carry "$CARRY"} ${GGUF:+--gguf "$GGUF"} \
    ${BUDGET:+--budget "$BUDGET"} ${STEPS:+--steps "$STEPS"} 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
