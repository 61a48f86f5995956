"""Runtimes: the one place where the execution device is chosen (`load_runtime`)."""
from __future__ import annotations

from backend.manifest import Device, EngineManifest, ModelConfig, WeightFormat
from backend.runtime.base import ForwardOutput, Runtime

__all__ = ["ForwardOutput", "Runtime", "load_runtime", "load_draft_runtime"]


def load_runtime(manifest: EngineManifest, fmt: WeightFormat | str | None = None,
                 threads: int | None = None, spinning: bool = True) -> Runtime:
    """The target engine of `manifest` in weight format `fmt` (default: the manifest's)."""
    ef = manifest.engine(fmt)
    if manifest.device is not Device.CPU:
        raise ValueError(f"engine device {manifest.device.value!r} has no runtime in this build")
    from backend.runtime.ort import OrtRuntime

    return OrtRuntime(manifest.resolve(ef.path), manifest.model, ef.num_layers, manifest.max_seq_len,
                      threads=threads, spinning=spinning, pad_single_token=ef.pad_single_token)


def load_draft_runtime(manifest: EngineManifest, name: str, threads: int | None = None,
                       spinning: bool = True) -> Runtime:
    """A draft model's engine (`--draft PATH` or `--draft self:N` at build time)."""
    if name not in manifest.drafts:
        raise KeyError(f"draft {name!r} was not built; built: {sorted(manifest.drafts) or 'none'}")
    d = manifest.drafts[name]
    from backend.runtime.ort import OrtRuntime

    cfg = ModelConfig.from_json(d.extra["model"]) if "model" in d.extra else manifest.model
    return OrtRuntime(manifest.resolve(d.path), cfg, d.num_layers, manifest.max_seq_len,
                      threads=threads, spinning=spinning,
                      pad_single_token=bool(d.extra.get("pad_single_token", False)))
