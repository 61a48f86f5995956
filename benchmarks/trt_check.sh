#!/usr/bin/env bash
# The TensorRT checks in one run, on a GPU machine with TensorRT (pip install -e '.[tensorrt]'):
# build the engines of the embedded model (or a given checkpoint) in fp32 and FP8 with a
# self-draft, then the speculative bench against plain decoding on them, FP8 quality against
# fp32, and the serving test on the real tritonserver. Nothing here has run yet: no machine with
# TensorRT was available to the sessions that wrote it (docs/building.md, "GPU deployment (TensorRT)").
#
#   bash benchmarks/trt_check.sh OUTDIR [TARGET]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-trt_check_out}
TARGET=${2:-}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
$PY -c "import tensorrt, torch; print('tensorrt', tensorrt.__version__, torch.cuda.get_device_name(0))" \
  | tee "$OUT/versions.txt" || exit 2
echo "== build (TensorRT engines, fp8 + fp32, self-draft)"
$PY build_engines.py --device tensorrt --weights fp8,fp32 ${TARGET:+--target "$TARGET"} --draft self:4 \
  --output "$OUT/repo" 2>&1 | tee "$OUT/build.log"
ls -la "$OUT/repo/specdec/engine" | tee -a "$OUT/build.log"
echo "== speculative bench (prompt lookup, then the self-draft), greedy, identical outputs checked"
$PY -m backend.cli bench --model-repository "$OUT/repo" --drafter prompt-lookup --json "$OUT/bench_lookup.json" \
  2>&1 | tee "$OUT/bench_lookup.log"
$PY -m backend.cli bench --model-repository "$OUT/repo" --drafter draft-model --json "$OUT/bench_self.json" \
  2>&1 | tee "$OUT/bench_self.log"
echo "== FP8 quality against fp32"
$PY -m backend.cli quality --model-repository "$OUT/repo" --format fp8 --reference fp32 --json "$OUT/quality.json" \
  2>&1 | tail -3 | tee "$OUT/quality.log"
