"""Runtimes: execute one engine file's forward over the KV slots (runtime/base.py's Runtime).

Which runtime runs which engine is the device seam's choice (backend/devices: `load_runtime`);
the runtimes never import the build (backend/builder, backend/buildlib), and serving reaches
them only through the protocol (tests/test_layering.py)."""
from __future__ import annotations

from backend.config import RuntimeOptions
from backend.runtime.base import ForwardOutput, Runtime

__all__ = ["ForwardOutput", "Runtime", "RuntimeOptions"]
