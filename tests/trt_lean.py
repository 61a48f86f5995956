"""TensorRT's plugin API without a GPU, for tests: where the full `tensorrt` package is absent
(its libraries come from NVIDIA's own index, not PyPI), TensorRT's lean runtime
(`tensorrt-lean-cu12`, from PyPI, in the dev extra) carries the same `plugin` module. This
makes `import tensorrt` and `import tensorrt.plugin` resolve to it, with placeholders for the
two builder-only names the plugin module refers to in annotations. The lean runtime has no
builder and no ONNX parser: what it proves is registration (TensorRT validates the signatures,
creates the plugins and infers their output types), not an engine. Use it in a subprocess:
it replaces `tensorrt` for the whole process.
"""
import enum
import sys

import numpy.typing  # noqa: F401  (tensorrt.plugin refers to np.typing without importing it)


def load() -> str:
    """Make `tensorrt` importable -> which one ("tensorrt x.y" or "tensorrt-lean x.y")."""
    try:
        import tensorrt

        return f"tensorrt {tensorrt.__version__}"
    except ImportError:
        pass
    import tensorrt_lean as trt

    if not hasattr(trt, "ITensor"):
        trt.ITensor = type("ITensor", (), {})
    if not hasattr(trt, "TensorFormat"):
        trt.TensorFormat = enum.IntEnum("TensorFormat", {"LINEAR": 0})
    sys.modules["tensorrt"] = trt
    import tensorrt_lean.plugin as trtp

    sys.modules["tensorrt.plugin"] = trtp
    trt.plugin = trtp
    return f"tensorrt-lean {trt.__version__}"
