#!/usr/bin/env python3
"""Requantize a GGUF with llama.cpp's own quantizer (llama_model_quantize), for benchmarking the
native engine on other block types of the same model (issue 26: SmolLM2 as Q4_K_M and Q8_0).

Runs inside the peer venv that benchmarks/vs_llamacpp.py builds (it has llama-cpp-python):

    benchmarks/.peer-venv/bin/python benchmarks/requantize.py IN.gguf OUT.gguf q4_k_m|q8_0

Requantization is allowed (the input is already quantized: Q4_1 for the embedded default), so
the result carries the input's rounding too; that is the file both engines then read.
"""
from __future__ import annotations

import os
import sys

import llama_cpp

FTYPES = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
          "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
          "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[2] not in FTYPES:
        print(f"usage: requantize.py IN.gguf OUT.gguf {{{'|'.join(FTYPES)}}}", file=sys.stderr)
        return 2
    src, dst, kind = argv
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), params)
    if rc != 0:
        print(f"llama_model_quantize failed ({rc})", file=sys.stderr)
        return 1
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
