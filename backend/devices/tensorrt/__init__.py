"""The TensorRT device: its backend (backend.py) and exporter (export.py: the engine graph of
buildlib/graph.py with plugin nodes, plans); FP8 by the cuda device's recipe and choice
(devices/cuda); the runtimes are runtime/engine_rt.py and trt_exec.py."""
from backend.devices.tensorrt.backend import TensorrtBackend, reference_executor

__all__ = ["TensorrtBackend", "reference_executor"]
