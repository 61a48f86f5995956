"""The TensorRT executor of the engine runtime (runtime/engine_rt.py): one deserialized engine
(a `.plan` of devices/tensorrt/export.py), one execution context, the KV caches as torch CUDA tensors
bound to the engine's `k_cache_i` / `v_cache_i` inputs, one stream.

A step copies the small host inputs to the device, binds every input and output address,
enqueues the engine (execute_async_v3), then writes the new nodes' KV (present_* outputs) to
their slot columns with one indexed copy per cache; logits and hidden stay on the device, the
verification's outputs (a few ints per row) come back. Needs TensorRT, torch with CUDA, and the
plugins (plugins/trt_plugins.py registers them on import).
Knows: TensorRT's execution API, device buffers. Does not know: slots (engine_rt.py), graphs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


class TrtExecutor:
    def __init__(self, plan: Path, config, num_layers: int):
        import tensorrt as trt
        import torch

        import plugins.trt_plugins  # noqa: F401  (registers specdec::tree_attention, rejection_sample)

        self.trt, self.torch = trt, torch
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(Path(plan).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {plan} (built by another TensorRT version?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = {n for n in names if self.engine.get_tensor_mode(n) == mode}
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        self.config, self.num_layers = config, num_layers
        self.device = torch.device("cuda")
        self.stream = torch.cuda.Stream(self.device)
        self.cache: list[tuple] = []

    def _dtype(self, name: str):
        t, trt = self.torch, self.trt
        return {trt.float32: t.float32, trt.float16: t.float16, trt.bfloat16: t.bfloat16, trt.int32: t.int32,
                trt.int64: t.int64, trt.bool: t.bool}[self.engine.get_tensor_dtype(name)]

    def allocate(self, slots: int, columns: int) -> None:
        shape = (slots, self.config.num_kv_heads, columns, self.config.head_dim)
        kv = self._dtype("k_cache_0")
        self.cache = [(self.torch.zeros(shape, dtype=kv, device=self.device),
                       self.torch.zeros(shape, dtype=kv, device=self.device)) for _ in range(self.num_layers)]

    def run(self, feeds: dict, wslot: np.ndarray, wcol: np.ndarray) -> dict:
        torch, ctx = self.torch, self.context
        keep = []
        with torch.cuda.stream(self.stream):
            for name, a in feeds.items():
                t = torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True).to(self._dtype(name))
                keep.append(t)
                ctx.set_input_shape(name, tuple(t.shape))
                ctx.set_tensor_address(name, t.data_ptr())
            for i, (kc, vc) in enumerate(self.cache):
                for name, c in ((f"k_cache_{i}", kc), (f"v_cache_{i}", vc)):
                    ctx.set_input_shape(name, tuple(c.shape))
                    ctx.set_tensor_address(name, c.data_ptr())
            out = {}
            for name in self.outputs:
                t = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=self._dtype(name), device=self.device)
                ctx.set_tensor_address(name, t.data_ptr())
                out[name] = t
            if not ctx.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed (see the TensorRT log above)")
            ws = torch.from_numpy(np.asarray(wslot, np.int64).reshape(-1)).to(self.device)
            wc = torch.from_numpy(np.asarray(wcol, np.int64).reshape(-1)).to(self.device)
            for i, (kc, vc) in enumerate(self.cache):
                for c, kind in ((kc, "key"), (vc, "value")):
                    new = out.pop(f"present_{kind}_{i}")
                    c[ws, :, wc] = new.reshape(-1, new.shape[2], new.shape[3]).to(c.dtype)
        self.stream.synchronize()
        return out

    def move(self, slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        torch = self.torch
        sl, s, d = (torch.from_numpy(np.asarray(x, np.int64)).to(self.device) for x in (slots, src, dst))
        with torch.cuda.stream(self.stream):
            for kc, vc in self.cache:
                for c in (kc, vc):
                    c[sl, :, d] = c[sl, :, s]
        self.stream.synchronize()

    def synchronize(self) -> None:
        """Wait for copies queued outside the executor's stream (the prefix cache's blocks)."""
        self.torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.cache = []
        self.context = None
        self.engine = None
