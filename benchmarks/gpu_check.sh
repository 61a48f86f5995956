#!/usr/bin/env bash
# The GPU checks in one run, in under 8 minutes on a machine with python3, torch and triton only
# (no network, nothing installed): the kernels compiled against their references, the runtime's
# logits against the CPU references, the verify cost curve, bf16 vs FP8 decode speed; and, when
# a GGUF and its Python dependencies (gguf, tokenizers, jinja2, safetensors) are there, the
# speculative bench with prompt lookup on real weights.
#
#   bash benchmarks/gpu_check.sh OUTDIR [path/to/model.gguf]
#
# Results: OUTDIR/kernels.json, OUTDIR/gpu_check.json, OUTDIR/spec_bench.json, and their logs.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_check_out}}
GGUF=${2:-}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee "$OUT/versions.txt"

echo "== check-kernels (compiled)"
timeout 180 $PY -m backend.cli check-kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"

echo "== the TensorRT plugins' kernels, compiled, against the references"
if $PY -c "import pytest" 2>/dev/null; then
  timeout 180 $PY -m pytest -q tests/test_kernels.py 2>&1 | tee "$OUT/kernel_tests.log"
fi

echo "== runtime logits, cost curves, decode speed"
timeout 300 $PY benchmarks/gpu_check.py --out "$OUT" ${QUICK:+--quick} 2>&1 | tee "$OUT/gpu_check.log"

if [ -n "$GGUF" ]; then
  echo "== speculative bench (prompt lookup) on $GGUF"
  if $PY -c "import gguf, tokenizers, jinja2, safetensors" 2>/dev/null; then
    timeout 240 $PY -m backend.cli build --device cuda --target "$GGUF" --weights bf16,fp8 \
        --no-invariance-check --output "$OUT/repo" 2>&1 | tail -n 20 | tee "$OUT/build.log" &&
    timeout 240 $PY -m backend.cli bench --model-repository "$OUT/repo" --drafter prompt-lookup \
        --max-new-tokens 128 --json "$OUT/spec_bench.json" 2>&1 | tail -n 20 | tee "$OUT/spec_bench.log"
  else
    echo "skipped: gguf, tokenizers, jinja2 or safetensors is not importable here" | tee "$OUT/spec_bench.log"
  fi
fi
ls -l "$OUT"
