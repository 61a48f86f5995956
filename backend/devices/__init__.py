"""The device seam: every engine backend, and the one place a runtime is chosen (`load_runtime`).

Knows: the backends (BACKENDS: one object per device and runtime, devices/base.py's contract),
which backend owns a (device, weight format), its build options, how a manifest's engine or
draft resolves to a file, model numbers and the backend's own record. Does not know: what a
backend does inside (devices/<name>/: each device's backend, exporter, build choices and record).

Layering: this wing imports what devices' builds share (backend/buildlib: export) and the
runtimes (loading); neither of those imports it, and the runtimes never import the build
(engine-file readers both share live in backend/engine_format.py). Above it: the drafter kinds, the build's
orchestration (backend/builder), the assembly and the tools (tests/test_layering.py).
"""
from __future__ import annotations

from backend.config import RuntimeOptions
from backend.devices.base import BuildContext, BuildOptions, DeviceRecord, EngineBackend, EngineRef
from backend.devices.cuda import CudaBackend
from backend.devices.native import NativeBackend
from backend.devices.onnx import OrtBackend
from backend.devices.tensorrt import TensorrtBackend, reference_executor
from backend.manifest import Device, EngineManifest, WeightFormat

__all__ = ["BACKENDS", "DEVICES", "FORMATS", "OPTIONS", "BuildContext", "BuildOptions", "DeviceRecord",
           "EngineBackend", "EngineRef", "TARGET", "backend_for", "check_here", "default_weights", "formats",
           "load_runtime", "reference_executor"]

# One line per backend; on a device with several, the first whose formats include a format owns it,
# and default builds list the available ones' defaults in this order (the first format serves).
BACKENDS: tuple[EngineBackend, ...] = (NativeBackend(), OrtBackend(), CudaBackend(), TensorrtBackend())

TARGET = "target"

# the devices and weight formats this install knows, in BACKENDS order (the CLI's choices)
DEVICES: tuple[Device, ...] = tuple(dict.fromkeys(b.device for b in BACKENDS))
FORMATS: tuple[WeightFormat, ...] = tuple(dict.fromkeys(f for b in BACKENDS for f in b.formats))
# the backends' build option classes, each once (`specdec build` adds their flags)
OPTIONS: tuple[type[BuildOptions], ...] = tuple(dict.fromkeys(b.options for b in BACKENDS if b.options))


def formats(device: Device) -> tuple[WeightFormat, ...]:
    """Every weight format a build for `device` can make."""
    seen: list[WeightFormat] = []
    for b in BACKENDS:
        if b.device == device:
            seen += [f for f in b.formats if f not in seen]
    return tuple(seen)


def backend_for(device: Device, fmt: WeightFormat | str) -> EngineBackend:
    fmt = WeightFormat(fmt)
    known = tuple(dict.fromkeys(b.device for b in BACKENDS))
    if device not in known:
        raise ValueError(f"device {Device(device).value!r} has no backend in this install "
                         f"(devices: {', '.join(d.value for d in known)})")
    for b in BACKENDS:
        if b.device == device and fmt in b.formats:
            return b
    raise ValueError(f"weight format {fmt.value!r} is not one of --device {device.value} "
                     f"(formats: {', '.join(f.value for f in formats(device))})")


def default_weights(device: Device) -> tuple[WeightFormat, ...]:
    """The formats a build makes when --weights is not given; the first one serves. On a CPU the
    GGUF blocks on our own kernel (fastest, batch invariant by construction: perf-notes §12),
    where the install compiled it, then fp32 and q4 on ONNX Runtime."""
    out: list[WeightFormat] = []
    for b in BACKENDS:
        if b.device == device and b.missing() is None:
            out += [f for f in b.defaults if f not in out]
    return tuple(out)


def check_here(manifest: EngineManifest) -> str:
    """Raise RuntimeError (with the rebuild command) where this machine cannot run the manifest's
    serving engine; else the torch device name it runs on."""
    return backend_for(manifest.device, manifest.default_format).check_here(manifest)


def load_runtime(manifest: EngineManifest, fmt: WeightFormat | str | None = None, *,
                 engine: str = TARGET, options: RuntimeOptions | None = None,
                 feature_layers: tuple[int, ...] | None = None):
    """A runtime over one engine of `manifest`: the target in weight format `fmt` (default: the
    manifest's), or a draft engine by its manifest name (`--draft PATH` -> "model",
    `--draft self:N` -> "selfN", `--draft eagle:DIR` -> "eagle"), on the backend that owns the
    manifest's device and the engine's format. feature_layers: the target's EAGLE-3 feature
    layers instead of the engine's (training a head: the native and torch runtimes take any; an
    ONNX graph has its own built in)."""
    options = options or RuntimeOptions()
    if engine == TARGET:
        ef = manifest.engine(fmt)
        backend = backend_for(manifest.device, ef.weights)
        features = ef.feature_layers if feature_layers is None else tuple(feature_layers)
        if features != ef.feature_layers and not backend.any_feature_layers:
            raise ValueError(f"the {ef.weights.value} engine outputs the features of layers {list(ef.feature_layers)}, "
                             f"not {list(features)}: its graph has them built in (use the gguf engine)")
        ref = EngineRef(manifest.resolve(ef.path), manifest.model, ef.num_layers, features, backend.record.of(ef))
        return backend.load(manifest, ref, options)
    if engine not in manifest.drafts:
        raise KeyError(f"draft {engine!r} was not built; built: {sorted(manifest.drafts) or 'none'}")
    d = manifest.drafts[engine]
    cfg = d.model or manifest.model      # an EAGLE head's own shape is in its entry (the build writes it)
    if d.kind == "eagle" and d.model is None:          # a manifest written before the build recorded it
        cfg = manifest.model.eagle_head(d.head, d.draft_vocab_size)
    backend = backend_for(manifest.device, d.weights or manifest.default_format)
    ref = EngineRef(manifest.resolve(d.path), cfg, d.num_layers, record=backend.record.of(d))
    return backend.load(manifest, ref, options)
