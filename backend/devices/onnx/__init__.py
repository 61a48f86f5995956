"""ONNX Runtime on the CPU: its backend (backend.py: the graph export of buildlib/graph.py, which the
tensorrt device and EAGLE heads share); the runtime is runtime/ort.py."""
from backend.devices.onnx.backend import OrtBackend, OrtRecord, export_draft_model, export_eagle, export_graph

__all__ = ["OrtBackend", "OrtRecord", "export_draft_model", "export_eagle", "export_graph"]
