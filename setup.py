"""Build step the pyproject cannot express: the native CPU decode step (plugins/native/: the model
forward in forward.c over the kernels of kernels.h), a plain shared library loaded with ctypes by
backend/runtime/native.py; on an AVX-512 machine a 256-bit build of the same source beside it
(SPECDEC_ISA=avx2). AMX tiles are chosen at run time inside the main one (plugins/native/amx.h).

Compiled for the installing machine's CPU (-march=native, as llama.cpp builds by default): the
serving machine is the one that installs. Optional: without a C compiler with OpenMP the install
still succeeds and the gguf engine format reports what is missing when used.
"""
import platform
from pathlib import Path

from setuptools import Extension, setup

flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c11"]
narrow = []
if platform.machine() in ("x86_64", "AMD64"):
    # AMX tiles are used only where the library asks Linux for them at run time (plugins/native/amx.h,
    # target attributes): the compiler itself must not emit tile instructions anywhere else.
    flags += ["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    # the same source at 256 bits beside it: SPECDEC_ISA=avx2 loads it (backend/runtime/native.py)
    if "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False:
        narrow = ["-mno-avx512f"]

native = ["plugins/native/forward.c", "plugins/native/kernels.c", "plugins/native/attention.c"]
depends = ["plugins/native/kernels.h", "plugins/native/simd.h", "plugins/native/amx.h"]
modules = [Extension("plugins._native", sources=native, depends=depends, extra_compile_args=flags,
                     extra_link_args=["-fopenmp"], optional=True)]
if narrow:
    modules.append(Extension("plugins._native_avx2", sources=native, depends=depends,
                             extra_compile_args=flags + narrow, extra_link_args=["-fopenmp"], optional=True))
setup(ext_modules=modules)
