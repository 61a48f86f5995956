"""Runtimes: the one place where the execution device is chosen (`load_runtime`)."""
from __future__ import annotations

from dataclasses import replace

from backend.config import RuntimeOptions
from backend.manifest import Device, EngineManifest, ModelConfig, WeightFormat
from backend.runtime.base import ForwardOutput, Runtime

__all__ = ["ForwardOutput", "Runtime", "RuntimeOptions", "load_runtime", "check_device", "check_tensorrt",
           "reference_executor", "TARGET"]

TARGET = "target"


def _rebuild(manifest: EngineManifest) -> str:
    return (f"python build_engines.py --device {manifest.device.value} --weights {','.join(manifest.engines)} "
            f"--target {manifest.source} --output <model repository>")


def reference_executor() -> bool:
    """SPECDEC_EXECUTOR=onnxruntime: a tensorrt repository's engine graph runs on ONNX Runtime's
    CPU provider with the plugins' numpy references (runtime/engine_rt.py OrtExecutor): the proof
    of the graph and the runtime on a CPU (tests, `specdec quality`), not a way to serve fast."""
    import os

    return os.environ.get("SPECDEC_EXECUTOR", "auto") == "onnxruntime"


def check_tensorrt(manifest: EngineManifest) -> None:
    """A tensorrt repository loads only where its engines were built: the same GPU model and
    TensorRT version; anything else is refused with the command that rebuilds here."""
    built = manifest.gpu
    if built is None:
        raise RuntimeError(f"{manifest.root} holds the engine-ready ONNX only (built without TensorRT or a "
                           f"GPU): build the engines on the serving GPU with `{_rebuild(manifest)}`")
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
    if (here, f"{major}.{minor}", trt.__version__) != (built["name"], built["compute_capability"], built["tensorrt"]):
        raise RuntimeError(f"the engines in {manifest.root} were built for {built['name']} (sm "
                           f"{built['compute_capability']}) with TensorRT {built['tensorrt']}; this machine "
                           f"has {here} (sm {major}.{minor}) with TensorRT {trt.__version__}: rebuild with "
                           f"`{_rebuild(manifest)}`")


def check_device(manifest: EngineManifest) -> str:
    """The torch device a cuda manifest runs on here: "cuda" on the GPU model it was built for,
    "cpu" for a build made without a GPU (on a machine without one); anything else is refused
    with the command that rebuilds for this machine."""
    import torch

    here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    built = manifest.gpu
    if built is None:
        if here is not None:
            raise RuntimeError(f"the engines in {manifest.root} were built without a GPU; this "
                               f"machine has {here}: rebuild here with `{_rebuild(manifest)}`")
        return "cpu"
    if here is None:
        raise RuntimeError(f"the engines in {manifest.root} were built for {built['name']} "
                           f"(sm {built['compute_capability']}); this machine has no CUDA device")
    major, minor = torch.cuda.get_device_capability(0)
    if here != built["name"] or f"{major}.{minor}" != built["compute_capability"]:
        raise RuntimeError(f"the engines in {manifest.root} were built for {built['name']} "
                           f"(sm {built['compute_capability']}); this machine has {here} "
                           f"(sm {major}.{minor}): rebuild with `{_rebuild(manifest)}`")
    return "cuda"


def load_runtime(manifest: EngineManifest, fmt: WeightFormat | str | None = None, *,
                 engine: str = TARGET, options: RuntimeOptions | None = None,
                 feature_layers: tuple[int, ...] | None = None) -> Runtime:
    """A runtime over one engine of `manifest`: the target in weight format `fmt` (default: the
    manifest's), or a draft engine by its manifest name (`--draft PATH` -> "model",
    `--draft self:N` -> "selfN", `--draft eagle:DIR` -> "eagle"). The manifest's device picks
    the runtime: ONNX Runtime (cpu), torch with the Triton kernels (cuda), or the TensorRT
    engines of the engine graph (tensorrt). feature_layers: the target's EAGLE-3 feature layers
    instead of the engine's (training a head: the native and torch runtimes take any; an ONNX
    graph has its own built in)."""
    options = options or RuntimeOptions()
    features: tuple[int, ...] = ()       # EAGLE-3's target layers (ONNX graphs have them built in)
    if engine == TARGET:
        ef = manifest.engine(fmt)
        path, cfg, layers, pad = manifest.resolve(ef.path), manifest.model, ef.num_layers, ef.pad_single_token
        features = ef.feature_layers if feature_layers is None else tuple(feature_layers)
        if features != ef.feature_layers and ef.weights is not WeightFormat.GGUF and manifest.device is not Device.CUDA:
            raise ValueError(f"the {ef.weights.value} engine outputs the features of layers {list(ef.feature_layers)}, "
                             f"not {list(features)}: its graph has them built in (use the gguf engine)")
    else:
        if engine not in manifest.drafts:
            raise KeyError(f"draft {engine!r} was not built; built: {sorted(manifest.drafts) or 'none'}")
        d = manifest.drafts[engine]
        if d.kind == "eagle":
            cfg = replace(manifest.model, vocab_size=int(d.extra["draft_vocab_size"]), num_layers=1)
        else:
            cfg = ModelConfig.from_json(d.extra["model"]) if "model" in d.extra else manifest.model
        path, layers, pad = manifest.resolve(d.path), d.num_layers, bool(d.extra.get("pad_single_token", False))
        if d.extra.get("weights") == WeightFormat.GGUF.value:
            from backend.runtime.native import NativeRuntime

            return NativeRuntime(path, cfg, layers, manifest.max_seq_len, options)
    if manifest.device is Device.TENSORRT:
        from backend.runtime.engine_rt import EngineRuntime, OrtExecutor

        if reference_executor():
            ex = OrtExecutor(path, cfg, layers, options.threads or 1)
        else:
            from backend.engine_format import plan_path
            from backend.runtime.trt_exec import TrtExecutor

            check_tensorrt(manifest)
            ex = TrtExecutor(plan_path(path), cfg, layers)
        return EngineRuntime(ex, cfg, layers, manifest.max_seq_len, options)
    if manifest.device is Device.CUDA:
        from backend.runtime.torch_rt import TorchRuntime

        return TorchRuntime(path, cfg, layers, manifest.max_seq_len, options, check_device(manifest),
                            feature_layers=features)
    if engine == TARGET and ef.weights is WeightFormat.GGUF:
        from backend.runtime.native import NativeRuntime

        return NativeRuntime(path, cfg, layers, manifest.max_seq_len, options, features)
    from backend.runtime.ort import OrtRuntime

    return OrtRuntime(path, cfg, layers, manifest.max_seq_len, options, pad_single_token=pad)
