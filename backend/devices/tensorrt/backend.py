"""TensorRT engines of the engine graph (runtime/engine_rt.py, trt_exec.py): the ONNX graph
with our kernels as plugins, compiled into plans on the serving GPU.

Knows: the engine-graph export and plan compilation (export.py), that a plan runs
only on the GPU and TensorRT version it was built with, and the reference executor
(SPECDEC_EXECUTOR=onnxruntime: the same graph on ONNX Runtime's CPU provider with the plugins'
numpy references, the proof of graph and runtime on a CPU). Does not know: the decode algorithm.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from backend.devices.base import EngineBackend, EngineRef, rebuild_command
from backend.devices.cuda.backend import Fp8Options
from backend.devices.cuda.record import Fp8Record
from backend.manifest import Device, WeightFormat


def reference_executor() -> bool:
    """SPECDEC_EXECUTOR=onnxruntime: a tensorrt repository's engine graph runs on ONNX Runtime's
    CPU provider with the plugins' numpy references (runtime/engine_rt.py OrtExecutor): the proof
    of the graph and the runtime on a CPU (tests, `specdec quality`), not a way to serve fast."""
    return os.environ.get("SPECDEC_EXECUTOR", "auto") == "onnxruntime"


@dataclass
class _BuildState:
    """What one tensorrt build keeps between its steps (BuildContext.state): the GPU and TensorRT
    it runs on, or what is missing for plans; the targets' FP8 input scales and recipe, which the
    drafts reuse."""

    gpu: dict | None = None
    missing: str | None = None
    act: dict | None = None
    recipe: object = None                   # runtime/fp8.py Recipe


class TensorrtBackend(EngineBackend):
    name = "tensorrt"
    device = Device.TENSORRT
    formats = (WeightFormat.FP32, WeightFormat.FP8)
    defaults = (WeightFormat.FP8,)
    options = Fp8Options                    # the GPU runtime's FP8 recipe, chosen the same way
    record = Fp8Record

    @staticmethod
    def _state(ctx) -> _BuildState:
        if ctx.state is None:
            ctx.state = _BuildState()
        return ctx.state

    def environment(self, ctx):
        from backend.devices.tensorrt import export

        state = self._state(ctx)
        state.gpu, state.missing = export.environment()
        return state.gpu

    def export_targets(self, ctx, formats):
        from backend.devices.tensorrt import export

        state = self._state(ctx)
        engines, timings, state.act, state.recipe = export.export_all(
            ctx.ck, formats, ctx.max_seq_len, ctx.engine_dir, ctx.tokenizer_json, ctx.log, ctx.features,
            ctx.option(Fp8Options).fp8_recipe)
        return engines, timings

    def export_layers(self, ctx, n, serving):
        from backend.devices.tensorrt import export

        state = self._state(ctx)
        return export.export_layers(ctx.ck, n, serving, state.act, ctx.max_seq_len, ctx.engine_dir, ctx.log,
                                    state.recipe)

    def export_model(self, ctx, path, serving):
        from backend.devices.tensorrt import export

        return export.export_draft_model(path, ctx.ck, serving, ctx.max_seq_len, ctx.engine_dir,
                                         ctx.tokenizer_json, ctx.log, self._state(ctx).recipe)

    def export_head(self, ctx, head, serving):
        from backend.devices.tensorrt import export

        return export.export_head(head, ctx.ck, serving, ctx.max_seq_len, ctx.engine_dir, ctx.tokenizer_json,
                                  ctx.log, self._state(ctx).recipe)

    def finish(self, ctx, engines, drafts):
        """Plans for every written graph, where this machine has a GPU and TensorRT's builder."""
        from backend.devices.tensorrt import export
        from backend.kv_slots import SCRATCH_COLUMNS

        state = self._state(ctx)
        if state.missing:
            ctx.log(f"engine-ready ONNX written, no TensorRT engine built: {state.missing}")
            return
        gpu = state.gpu
        ctx.log(f"GPU: {gpu['name']} (sm {gpu['compute_capability']}), TensorRT {gpu['tensorrt']}")
        for x in [*engines.values(), *drafts.values()]:
            if x.path.endswith(".onnx"):
                export.build_plan(ctx.engine_dir / x.path, ctx.max_seq_len, ctx.max_batch_size,
                                      ctx.max_batch_size + 1, ctx.max_seq_len + SCRATCH_COLUMNS, ctx.log)

    def measurable(self, gpu):
        return gpu is not None or reference_executor()

    def check_here(self, manifest) -> str:
        """A plan loads only where it was built: the same GPU model and TensorRT version;
        anything else is refused with the command that rebuilds here. The reference executor
        runs anywhere."""
        if reference_executor():
            return "cpu"
        built = manifest.gpu
        if built is None:
            raise RuntimeError(f"{manifest.root} holds the engine-ready ONNX only (built without TensorRT or a "
                               f"GPU): build the engines on the serving GPU with `{rebuild_command(manifest)}`")
        try:
            import tensorrt as trt
            import torch
        except ImportError as exc:
            raise RuntimeError(f"the engines in {manifest.root} need TensorRT {built['tensorrt']} and torch "
                               f"({exc}); install them with pip install -e '.[tensorrt]'") from None
        here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        if here is None:
            raise RuntimeError(f"the engines in {manifest.root} were built for {built['name']}; this machine "
                               f"has no CUDA device")
        major, minor = torch.cuda.get_device_capability(0)
        if (here, f"{major}.{minor}", trt.__version__) != (built["name"], built["compute_capability"],
                                                             built["tensorrt"]):
            raise RuntimeError(f"the engines in {manifest.root} were built for {built['name']} (sm "
                               f"{built['compute_capability']}) with TensorRT {built['tensorrt']}; this machine "
                               f"has {here} (sm {major}.{minor}) with TensorRT {trt.__version__}: rebuild with "
                               f"`{rebuild_command(manifest)}`")
        return "cuda"

    def load(self, manifest, ref: EngineRef, options):
        from backend.runtime.engine_rt import EngineRuntime, OrtExecutor

        if reference_executor():
            ex = OrtExecutor(ref.path, ref.config, ref.num_layers, options.threads or 1)
        else:
            from backend.engine_format import plan_path
            from backend.runtime.trt_exec import TrtExecutor

            self.check_here(manifest)
            ex = TrtExecutor(plan_path(ref.path), ref.config, ref.num_layers)
        return EngineRuntime(ex, ref.config, ref.num_layers, manifest.max_seq_len, options)
