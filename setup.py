"""Build step the pyproject cannot express: the native CPU decode step (plugins/native/: the model
forward in forward.c over the kernels of kernels.h), one plain shared library loaded with ctypes by
backend/runtime/native.py.

Compiled for the installing machine's CPU (-march=native, as llama.cpp builds by default): the
serving machine is the one that installs. Optional: without a C compiler with OpenMP the install
still succeeds and the gguf engine format reports what is missing when used.
"""
import platform

from setuptools import Extension, setup

flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c11"]
if platform.machine() in ("x86_64", "AMD64"):
    # AMX: this kind of VM advertises it but faults on it (benchmarks/vs_llamacpp.py); we never
    # use it, and keep the compiler from doing so either.
    flags += ["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]

native = ["plugins/native/forward.c", "plugins/native/kernels.c", "plugins/native/attention.c"]
setup(ext_modules=[Extension("plugins._native", sources=native,
                             depends=["plugins/native/kernels.h", "plugins/native/simd.h"],
                             extra_compile_args=flags, extra_link_args=["-fopenmp"], optional=True)])
