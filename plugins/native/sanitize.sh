#!/usr/bin/env bash
# The native decode step under AddressSanitizer + UndefinedBehaviorSanitizer (issue 31).
#
#   bash plugins/native/sanitize.sh [pytest args...]     # default: the native suites below
#
# Builds the kernel (plugins/native/*.c) with the install's flags plus -fsanitize=address,undefined
# (at -O1, frame pointers kept) and SD_POISON_WORKSPACE (every forward first fills its reused
# workspace with 0xff bytes, so a read of scratch left by an earlier forward shows as NaN and fails
# the bitwise tests) into work/sanitize/, loads it instead of plugins/_native*.so
# (SPECDEC_NATIVE_LIB, backend/runtime/native.py) in a Python that has libasan/libubsan preloaded
# (the interpreter itself is not instrumented), and runs the suites that drive the kernel: ragged
# rows, trees, every drafter, seeded sampling, cancelled and stopped rows, slot reuse, the ctypes
# bounds checks, the EAGLE-3 feature layers, every block kind, wide activations, attention at head
# sizes 32-256, the AMX tile path where the CPU has it (as the default, SPECDEC_ISA=auto, and
# forced on every row count). Fails on any
# sanitizer report (a report aborts the process; any log file left in work/sanitize/logs also
# fails the run) or any failed test.
# About 1 min on 2 cores (perf-notes §14).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=work/sanitize
rm -rf "$OUT/logs" && mkdir -p "$OUT/logs"
ARCH=()
if [[ $(uname -m) == x86_64 ]]; then
    ARCH=(-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
fi
gcc -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1 \
    -fopenmp -ffp-contract=off -std=c11 "${ARCH[@]}" -DSD_POISON_WORKSPACE -shared -fPIC \
    plugins/native/*.c -o "$OUT/_native_sanitized.so"

export SPECDEC_NATIVE_LIB=$PWD/$OUT/_native_sanitized.so
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
# detect_leaks=0: CPython's own allocations at exit are not ours to report
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_odr_violation=0:verify_asan_link_order=0:log_path=$PWD/$OUT/logs/asan
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$PWD/$OUT/logs/ubsan
export PYTHONFAULTHANDLER=1
if [[ $# -eq 0 ]]; then
    set -- tests/test_native.py tests/test_native_blocks.py tests/test_wide_activations.py tests/test_native_amx.py tests/test_native_attention.py \
        "tests/test_eagle3.py::test_target_engines_output_the_inputs_of_the_head_s_layers[cpu-gguf]" \
        "tests/test_eagle3.py::test_speculation_with_a_published_eagle3_head_is_lossless[cpu-gguf]"
fi
status=0
"$PY" -c "import backend.runtime.native as n; n.library(); print('sanitized kernel:', n.library()._name, n.isa())"
"$PY" -m pytest -q -p no:cacheprovider "$@" || status=$?
if compgen -G "$OUT/logs/*" > /dev/null; then
    echo "sanitizer reports:" && cat "$OUT"/logs/*
    status=1
fi
exit $status
