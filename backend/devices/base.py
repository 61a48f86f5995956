"""The device seam: what one engine backend (a device and the runtime that executes its engine
files) owns, from the build to the loaded runtime.

Knows: the contract every backend keeps (formats and defaults, target and draft export, what
the build records about the machine, the typed record of what a backend chose per engine, whether
the build can run what it built, the "can this machine run it" check, loading a runtime). Does
not know: any particular device (devices/*/), the decode algorithm, drafting policy.

A backend is one object (devices/<name>/backend.py: native, onnx, cuda, tensorrt; each folder
also holds the device's exporter and build choices) listed once in devices/__init__.py's
BACKENDS. The build (builder/pipeline.py) and `load_runtime` reach every device through it, so a
new device is its folder (backend, exporter, options, record), its runtime file (runtime/X.py)
and a registry line.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from backend.config import RuntimeOptions
from backend.manifest import FEATURES, Device, DraftEntry, EngineFile, EngineManifest, ModelConfig, WeightFormat

if TYPE_CHECKING:                        # the build's type only: serving loads no checkpoint reader
    from backend.buildlib.checkpoint import Checkpoint


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


@dataclass(frozen=True)
class DeviceRecord:
    """What a backend chose for one engine and reads back when it loads it (the native kernel's
    wide activations, an FP8 recipe, ONNX Runtime's single-token padding), declared by it
    (EngineBackend.record): a frozen dataclass of JSON-able fields, written by its exporter into
    the manifest (EngineFile.record, DraftEntry.record: `to_json()`, plain data the manifest never
    reads) and handed back typed to its `load` (EngineRef.record). A new device with a choice of
    its own edits no shared file (tests/test_layering.py's toy device records one)."""

    def to_json(self) -> dict:
        return {f.name: list(v) if isinstance(v, tuple) else v
                for f in fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_json(cls, d: dict | None):
        """The record of an entry's JSON (None: nothing chosen, the defaults); a tuple field
        comes back a tuple."""
        tuples = {f.name for f in fields(cls) if isinstance(f.default, tuple)}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in (d or {}).items()})

    @classmethod
    def of(cls, entry: EngineFile | DraftEntry):
        """The record of a manifest's engine or draft, typed by this class."""
        return cls.from_json(entry.record)


@dataclass
class BuildContext:
    """What every export step of one build shares: the target checkpoint, the engine folder,
    the EAGLE-3 feature layers the target engines output, and `state` a backend keeps between
    its steps, typed by it (TensorRT's: its GPU and FP8 plan, from the targets to the drafts)."""

    ck: Checkpoint                          # the target
    engine_dir: Path
    tokenizer_json: Path
    max_seq_len: int
    max_batch_size: int
    log: Callable[..., None]
    quiet: bool = False
    features: tuple[int, ...] = ()
    state: object = None
    options: tuple[BuildOptions, ...] = ()  # the backends' own options as given (the rest: defaults)

    def option(self, cls: type[Options]) -> Options:
        """The build's options of class `cls` (a backend's declared class), its defaults where not given."""
        return next((o for o in self.options if type(o) is cls), None) or cls()


@dataclass(frozen=True)
class EngineRef:
    """One engine of a manifest, resolved for loading: the file, its model numbers and layers,
    and what its backend recorded for it (typed by the backend's `record` class)."""

    path: Path
    config: ModelConfig
    num_layers: int
    feature_layers: tuple[int, ...] = ()    # EAGLE-3 layers the forward outputs (target only)
    record: DeviceRecord = DeviceRecord()


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
    record: type[DeviceRecord] = DeviceRecord   # what it records per engine (EngineRef.record at load)

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
        """An EAGLE head (any layout buildlib/heads/formats.py reads) as a 1-layer engine."""

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
