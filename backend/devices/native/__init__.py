"""The native CPU device: its backend (backend.py), its engine file's exporter (export.py,
blocks.py) and its build choice of wide activations (wide.py, recorded as NativeRecord); the
runtime is runtime/native.py, the kernel plugins/native/."""
from backend.devices.native.backend import NativeBackend, NativeOptions, NativeRecord

__all__ = ["NativeBackend", "NativeOptions", "NativeRecord"]
