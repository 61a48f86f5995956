"""The CUDA device (torch with our Triton-language kernels): its backend (backend.py), its engine
files' exporter (export.py) and its build choice of FP8 recipe (fp8_choice.py); the FP8 weight
math and the calibration it shares with tensorrt are buildlib/fp8.py, fp8_gptq.py and
calibration.py; the runtime is runtime/torch_rt.py."""
from backend.devices.cuda.backend import CudaBackend, Fp8Options
from backend.devices.cuda.record import Fp8Record

__all__ = ["CudaBackend", "Fp8Options", "Fp8Record"]
