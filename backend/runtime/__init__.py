"""Runtimes: the one place where the execution device is chosen (`load_runtime`)."""
from __future__ import annotations

from dataclasses import replace

from backend.config import RuntimeOptions
from backend.manifest import Device, EngineManifest, ModelConfig, WeightFormat
from backend.runtime.base import ForwardOutput, Runtime

__all__ = ["ForwardOutput", "Runtime", "RuntimeOptions", "load_runtime", "TARGET"]

TARGET = "target"


def load_runtime(manifest: EngineManifest, fmt: WeightFormat | str | None = None, *,
                 engine: str = TARGET, options: RuntimeOptions | None = None) -> Runtime:
    """A runtime over one engine of `manifest`: the target in weight format `fmt` (default: the
    manifest's), or a draft engine by its manifest name (`--draft PATH` -> "model",
    `--draft self:N` -> "selfN", `--draft eagle:DIR` -> "eagle")."""
    options = options or RuntimeOptions()
    if manifest.device is not Device.CPU:
        raise ValueError(f"engine device {manifest.device.value!r} has no runtime in this build")
    from backend.runtime.ort import OrtRuntime

    if engine == TARGET:
        ef = manifest.engine(fmt)
        return OrtRuntime(manifest.resolve(ef.path), manifest.model, ef.num_layers, manifest.max_seq_len,
                          options, pad_single_token=ef.pad_single_token)
    if engine not in manifest.drafts:
        raise KeyError(f"draft {engine!r} was not built; built: {sorted(manifest.drafts) or 'none'}")
    d = manifest.drafts[engine]
    if d.kind == "eagle":
        cfg = replace(manifest.model, vocab_size=int(d.extra["draft_vocab_size"]), num_layers=1)
    else:
        cfg = ModelConfig.from_json(d.extra["model"]) if "model" in d.extra else manifest.model
    return OrtRuntime(manifest.resolve(d.path), cfg, d.num_layers, manifest.max_seq_len, options,
                      pad_single_token=bool(d.extra.get("pad_single_token", False)))
