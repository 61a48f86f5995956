"""Build step the pyproject cannot express: the native CPU decode step (plugins/native/: the model
forward in forward.c over the kernels of kernels.h), a plain shared library loaded with ctypes by
backend/runtime/native.py; beside it, the same source built for the lower paths this CPU can also
run, so every path runs and is tested bitwise against the others on one machine
(tests/test_native_isa.py): plugins._native_avx2, 256 bits without VNNI (the path of AVX2-only
CPUs: AMD Zen 1-3, Intel before Ice Lake / Alder Lake), wherever the CPU has more; and
plugins._native_avx_vnni, 256 bits with AVX-VNNI, where the CPU has it beside AVX-512 (Sapphire
Rapids, Zen 5). SPECDEC_ISA=avx2 / avx-vnni loads them. AMX tiles are chosen at run time inside
the main one (plugins/native/amx.h).

Compiled for the installing machine's CPU (-march=native, as llama.cpp builds by default): the
serving machine is the one that installs. Optional: without a C compiler with OpenMP the install
still succeeds and the gguf engine format reports what is missing when used.
"""
import platform
from pathlib import Path

from setuptools import Extension, setup

flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c11"]
lower = {}        # module suffix -> the flags that take the main build down to that path
if platform.machine() in ("x86_64", "AMD64"):
    # AMX tiles are used only where the library asks Linux for them at run time (plugins/native/amx.h,
    # target attributes): the compiler itself must not emit tile instructions anywhere else.
    flags += ["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    cpu = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    # kernels.c picks its integer dot by __AVX512VNNI__ / __AVXVNNI__: without both, dot4 is
    # AVX2's maddubs + madd (perf-notes section 34)
    if "avx512f" in cpu or "avx_vnni" in cpu:
        lower["avx2"] = ["-mno-avx512f", "-mno-avxvnni"]
    if "avx512f" in cpu and "avx_vnni" in cpu:
        lower["avx_vnni"] = ["-mno-avx512f"]

native = ["plugins/native/forward.c", "plugins/native/kernels.c", "plugins/native/attention.c"]
depends = ["plugins/native/kernels.h", "plugins/native/simd.h", "plugins/native/amx.h"]
modules = [Extension(f"plugins._native{'_' + name if name else ''}", sources=native, depends=depends,
                     extra_compile_args=flags + more, extra_link_args=["-fopenmp"], optional=True)
           for name, more in {"": [], **lower}.items()]
setup(ext_modules=modules)
