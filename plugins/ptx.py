"""Ahead-of-time PTX of every kernel the GPU runtime launches (plugins/kernels.py and the fused
step's plugins/fused.py), for CI's compile check on a machine without a GPU. The TensorRT
plugins' kernels compile through kernels.compile_plugin.
Knows: Triton's compiler, the kernels' signature tables. Does not know: runtimes.
"""
from __future__ import annotations

import triton

from plugins import fused, kernels


def compile_ptx(name: str, arch: int = 90, **variant) -> tuple[str, str]:
    """PTX of one kernel for sm_<arch>, compiled on this machine (an explicit target needs no
    GPU) -> (ptx text, kernel symbol name). Not in an interpreted process: its kernels are
    interpreter functions (run it in a process without TRITON_INTERPRET)."""
    assert not kernels.interpreted(), "compile_ptx needs a process without TRITON_INTERPRET=1"
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, consts = {**kernels.signatures(**variant), **fused.signatures(**variant)}[name]
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32))
    return compiled.asm["ptx"], compiled.metadata.name
