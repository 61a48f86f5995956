"""The device seam: what one engine backend (a device and the runtime that executes its engine
files) owns, from the build to the loaded runtime.

Knows: the contract every backend keeps (formats and defaults, target and draft export, what
the build records about the machine, whether the build can run what it built, the "can this
machine run it" check, loading a runtime). Does not know: any particular device (devices/*/),
the decode algorithm, drafting policy.

A backend is one object (devices/<name>/backend.py: native, onnx, cuda, tensorrt; each folder
also holds the device's exporter and build choices) listed once in devices/__init__.py's
BACKENDS. The build (build/pipeline.py) and `load_runtime` reach every device through it, so a
new device is its folder (backend, exporter, options), its runtime file (runtime/X.py) and a
registry line.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, TypeVar

from backend.config import RuntimeOptions
from backend.manifest import FEATURES, Device, DraftEntry, EngineFile, EngineManifest, ModelConfig, WeightFormat


@dataclass(frozen=True)
class BuildOptions:
    """A backend's own build options, declared by it (EngineBackend.options): a frozen dataclass
    whose fields are its `specdec build` flags (`--field-name`; the field's metadata gives "help"
    and "choices"), checked when made (__post_init__ raises UserError naming the flag). The build
    hands each backend its own; two backends may share one class (cuda and tensorrt: FP8), whose
    flags are added once (devices.OPTIONS lists each class once)."""

    @classmethod
    def add_args(cls, parser) -> None:
        for f in fields(cls):
            parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata.get("help"),
                                choices=f.metadata.get("choices"))

    @classmethod
    def from_args(cls, args):
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


Options = TypeVar("Options", bound=BuildOptions)


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
    options: tuple[BuildOptions, ...] = ()  # the backends' own options as given (the rest: defaults)

    def option(self, cls: type[Options]) -> Options:
        """The build's options of class `cls` (a backend's declared class), its defaults where not given."""
        return next((o for o in self.options if type(o) is cls), None) or cls()


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
    # (manifest.FEATURES, each engine interpreting ModelConfig.plan): a model using anything
    # else is refused before a build; every backend here implements them all
    model_features: frozenset[str] = frozenset(FEATURES)
    options: type[BuildOptions] | None = None   # its build options (flags), read with ctx.option

    def unsupported(self, model) -> list[str]:
        """The model description's features this backend's engines do not implement."""
        return sorted(set(model.features()) - self.model_features)

    def missing(self) -> str | None:
        """Why this install cannot build or run this backend's engines (one line), or None."""
        return None

    def versions(self) -> dict[str, str]:
        """What of this install the manifest's tool_versions records (the native kernel's ISA)."""
        return {}

    def build_bytes(self, ck, fmt: WeightFormat) -> int | None:
        """The memory building (and checking) an engine of `fmt` from checkpoint `ck` needs at its
        peak, where that grows past the file it reads (a default build leaves out a format that
        does not fit the machine: pipeline.py); None: about the checkpoint's own size."""
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
