"""The device seam: what one engine backend (a device and the runtime that executes its engine
files) owns, from the build to the loaded runtime.

Knows: the contract every backend keeps (formats and defaults, target and draft export, what
the build records about the machine, whether the build can run what it built, the "can this
machine run it" check, loading a runtime). Does not know: any particular device (devices/*.py),
the decode algorithm, drafting policy.

A backend is one object (devices/native.py, onnx.py, cuda.py, tensorrt.py) listed once in
devices/__init__.py's BACKENDS. The build (build/pipeline.py) and `load_runtime` reach every
device through it, so a new device is its backend file, its runtime file (runtime/X.py) and a
registry line.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from backend.config import RuntimeOptions
from backend.manifest import Device, DraftEntry, EngineFile, EngineManifest, ModelConfig, WeightFormat


@dataclass
class BuildContext:
    """What every export step of one build shares: the target checkpoint, the engine folder,
    the EAGLE-3 feature layers the target engines output, and `state` a backend keeps between
    its steps (TensorRT's FP8 activation scales, from the targets to the drafts)."""

    ck: object                              # build.checkpoint.Checkpoint of the target
    engine_dir: Path
    tokenizer_json: Path
    max_seq_len: int
    max_batch_size: int
    log: Callable[..., None]
    quiet: bool = False
    features: tuple[int, ...] = ()
    state: dict = field(default_factory=dict)
    fp8_recipe: str = "auto"                # FP8: "auto" (chosen by measured quality) or a recipe's name
    wide_activations: tuple[str, ...] | str | None = None   # gguf: the wide families; None: measured and
                                                            # priced; wide_choice.FIDELITY: measured


@dataclass(frozen=True)
class EngineRef:
    """One engine of a manifest, resolved for loading: the file, its model numbers and layers."""

    path: Path
    config: ModelConfig
    num_layers: int
    pad_single_token: bool = False
    feature_layers: tuple[int, ...] = ()    # EAGLE-3 layers the forward outputs (target only)
    wide_activations: tuple[str, ...] = ()  # the native kernel's wide matrix families (target only)


class EngineBackend(ABC):
    """The contract. The abstract methods are what every device must do (a backend missing one
    cannot be instantiated, so the registry fails at import); the others have the CPU's answer."""

    name: str = ""
    device: Device
    formats: tuple[WeightFormat, ...] = ()      # weight formats whose engines it builds and runs
    defaults: tuple[WeightFormat, ...] = ()     # built when --weights is not given
    any_feature_layers: bool = False            # runs any EAGLE-3 feature layers (not baked in a graph)
    # what its engines implement of the model description beyond the Llama layer
    # (manifest.ModelConfig.features): a model using anything else is refused before a build
    model_features: frozenset[str] = frozenset()

    def unsupported(self, model) -> list[str]:
        """The model description's features this backend's engines do not implement."""
        return sorted(set(model.features()) - self.model_features)

    def missing(self) -> str | None:
        """Why this install cannot build or run this backend's engines (one line), or None."""
        return None

    def environment(self, ctx: BuildContext) -> dict | None:
        """The accelerator the build records in the manifest (`gpu`), None on a CPU."""
        return None

    @abstractmethod
    def export_targets(self, ctx: BuildContext, formats: tuple[WeightFormat, ...]
                       ) -> tuple[dict[str, EngineFile], dict[str, float]]:
        """The target in each of `formats` -> ({format: EngineFile}, {format: seconds})."""

    # Drafts, each beside the serving engine -> (manifest name, DraftEntry); the drafter kinds
    # (backend/draft_kinds) parse `--draft` and call these.
    @abstractmethod
    def export_layers(self, ctx: BuildContext, n: int, serving: EngineFile) -> tuple[str, DraftEntry]:
        """The target's first `n` layers and head (a self-draft)."""

    @abstractmethod
    def export_model(self, ctx: BuildContext, path: str, serving: EngineFile) -> tuple[str, DraftEntry]:
        """A separate draft model (a checkpoint with the target's vocabulary)."""

    @abstractmethod
    def export_head(self, ctx: BuildContext, head: Path, serving: EngineFile) -> tuple[str, DraftEntry]:
        """An EAGLE head (any layout build/heads/formats.py reads) as a 1-layer engine."""

    def finish(self, ctx: BuildContext, engines: dict[str, EngineFile], drafts: dict[str, DraftEntry]) -> None:
        """After every export: device compilation of the written files (TensorRT plans)."""

    def measurable(self, gpu: dict | None) -> bool:
        """Whether the build machine runs what it built (batch invariance, the cost model)."""
        return True

    def check_here(self, manifest: EngineManifest) -> str:
        """Raise RuntimeError (with the rebuild command) where this machine cannot run the
        manifest's engines; else the torch device name they run on ("cpu" off CUDA)."""
        return "cpu"

    @abstractmethod
    def load(self, manifest: EngineManifest, ref: EngineRef, options: RuntimeOptions):
        """A runtime.Runtime over one engine file."""


def rebuild_command(manifest: EngineManifest) -> str:
    return (f"python build_engines.py --device {manifest.device.value} --weights {','.join(manifest.engines)} "
            f"--target {manifest.source} --output <model repository>")
