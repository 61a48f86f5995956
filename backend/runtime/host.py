"""What a runtime answers for its host side where its device has nothing of its own (the Runtime
protocol's kernel_path and host_matmul): ONNX Runtime, torch, the engine runtime and the toy.

The host product is the native kernel's blocked matmul on the calling thread where the install
compiled the kernel, numpy elsewhere: numpy's OpenBLAS starts threads of its own for each
few-row product, which fight the engine's threads for the cores (perf-notes §13). The native
runtime answers for itself, on its own OpenMP pool (runtime/native.py).
Knows: which host product exists here. Does not know: engines, drafters.
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def host_matmul(w: np.ndarray, threads: int = 1) -> Callable[[np.ndarray], np.ndarray]:
    """x [n, K] -> x W^T [n, N] for W [N, K] (float32), repacked once here, not per call."""
    from backend.runtime import native

    w = np.asarray(w, np.float32)
    if native.compiled():
        blocked = native.BlockedMatrix(w)
        return lambda x: blocked(x, threads)
    return lambda x: x @ w.T


class HostSide:
    """The protocol's host side of a runtime whose device names no kernel path."""

    kernel_path: str | None = None

    def host_matmul(self, w: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        return host_matmul(w)
