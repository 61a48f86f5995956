"""Engine manifest: the JSON written by `build_engines.py` beside the engines.

It is the only truth at serve time: the runtime, the tokenizer and the Triton adapters read
shapes, formats and paths from here and never re-derive them from checkpoints.
Knows: model architecture numbers, engine files per weight format, tokenizer location, tool
versions. Does not know: anything about requests or speculation policy (see config.py).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from backend.program import (ACTIVATIONS, Attention, Features, Gate, HeadNorm, Linear, Norm, Op, Residual, Rope,
                             check)
from backend.errors import ManifestMismatch, ManifestMissing
from backend.names import Name

MANIFEST_NAME = "manifest.json"
# 4: each device's recorded choices are its own record (EngineFile.record, DraftEntry.record);
# 3: the model description (ModelConfig fields), native kinds, plugin windows; 2: cuda engines, gpu
MANIFEST_VERSION = 4
READS = (3, 4)                # a version-3 manifest's flat device fields are read into the records


class WeightFormat(Name):
    """How an engine's weights are stored; each device backend lists the formats it builds (an
    open set, backend/names.py: a new format is declared by its backend, refused where unknown by
    devices.backend_for). The constants name the formats of this tree's backends."""


WeightFormat.FP32 = WeightFormat("fp32")  # exact: every weight dequantized to float32
WeightFormat.Q4 = WeightFormat("q4")      # 4-bit MatMulNBits; GGUF blocks repacked exactly (buildlib/quant.py) (cpu)
WeightFormat.GGUF = WeightFormat("gguf")  # the GGUF's own blocks, run by our C decode step (runtime/native.py) (cpu)
WeightFormat.BF16 = WeightFormat("bf16")  # bfloat16 weights (cuda)
WeightFormat.FP8 = WeightFormat("fp8")    # float8 E4M3 by a recipe chosen at build (runtime/fp8.py; the device records it) (cuda, tensorrt)


class Device(Name):
    """Where the engines run; each device's backends (formats, export, loading) are in
    backend/devices, which also lists the devices this install knows (devices.DEVICES)."""


Device.CPU = Device("cpu")    # our C decode step over GGUF blocks (gguf), ONNX Runtime graphs (fp32, q4)
Device.CUDA = Device("cuda")  # torch + Triton kernels (runtime/torch_rt.py); on the CPU where built without a GPU
Device.TENSORRT = Device("tensorrt")  # TensorRT engines of the engine graph (runtime/engine_rt.py, trt_exec.py)


# Every norm weight a layer program may name (ModelConfig.program), in the order an engine file
# lists a layer's tensors (devices/native/export.py writes them so; buildlib/checkpoint.py converts
# Gemma's (1 + w) for these): a norm of a new name is a name here, its place in the program and its
# checkpoint names
NORMS = ("attn_norm", "hidden_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")


@dataclass(frozen=True)
class ModelConfig:
    """The model description: one decoder architecture as data, read by every implementation (the
    ONNX graph, the torch model, the native kernel's flags, the head trainer). The Llama layer is
    the default; what another family changes is a field here, implemented once per engine where
    that engine needs it (docs/architecture.md, "Where a change goes": a new architecture).

    Norms are stored plain (y = x / rms(x) * w): a checkpoint that keeps Gemma's (1 + w) is
    converted when it is read (buildlib/checkpoint.py), as llama.cpp's converter does."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False          # q/k/v projections carry a bias (Qwen2)
    # HF rope_scaling dict, or None: "linear" {factor}, "llama3" {factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings}, "longrope" {short_factor, long_factor,
    # original_max_position_embeddings, attention_factor} (Phi-3; engine_format.rope_tables)
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    activation: str = "silu"              # the gated MLP's: "silu" (SwiGLU) | "gelu_tanh" (GeGLU, Gemma)
    qk_norm: bool = False                 # q and k RMS-normed per head before rotary (Gemma-3, Qwen3)
    post_norms: bool = False              # norms on the attention and MLP outputs too (Gemma 2/3)
    sliding_window: int = 0               # keys at positions > pos - window, on the layers below
    layer_types: tuple[str, ...] = ()     # per layer "full" | "sliding"; () with a window: all sliding
    rope_local_theta: float | None = None  # rope base of the sliding layers (Gemma-3: 10k), no scaling
    embed_scale: float = 1.0              # the input embedding's multiplier (Gemma: sqrt(hidden))
    attn_scale: float | None = None       # q's multiplier; None: 1/sqrt(head_dim)
    final_logit_softcap: float = 0.0      # logits = cap tanh(logits / cap) (Gemma-2); 0: none
    attn_logit_softcap: float = 0.0       # the same on attention scores (Gemma-2); 0: none
    # per-dimension divisors [head_dim / 2] of rope's frequencies (llama.cpp's rope_freqs tensor:
    # how a GGUF stores Llama-3.1's scaling); (): none. Global layers only, as rope_scaling
    rope_freq_factors: tuple[float, ...] = ()

    ACTIVATIONS = ACTIVATIONS

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert self.head_dim % 2 == 0, self.head_dim
        assert self.activation in self.ACTIVATIONS, self.activation
        assert not self.layer_types or len(self.layer_types) == self.num_layers, self.layer_types
        assert set(self.layer_types) <= {"full", "sliding"}, self.layer_types
        assert len(self.rope_freq_factors) in (0, self.head_dim // 2), (len(self.rope_freq_factors), self.head_dim)

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        """Attention's multiplier of q."""
        return self.attn_scale if self.attn_scale is not None else 1.0 / float(self.head_dim) ** 0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window; 0: it attends to every earlier position."""
        if not self.sliding_window:
            return 0
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding" else 0

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` uses the sliding layers' own rope base (rope_local_theta)."""
        return self.rope_local_theta is not None and self.window(layer) > 0

    def features(self) -> list[str]:
        """What this model uses beyond the Llama layer, by name (FEATURES: each engine backend
        declares which of these it implements, devices/base.py EngineBackend.model_features)."""
        return [name for name, used in FEATURES.items() if used(self)]

    def program(self, layer: int, tap: bool = False, eagle3: bool = False) -> tuple[Op, ...]:
        """Layer `layer` as every engine runs it: its steps in order (backend/program.py). tap: the
        stream entering it is one of the engine's feature outputs (EngineFile.feature_layers);
        eagle3: an EAGLE-3 head's layer, whose attention reads [norm(embedding), norm(feature)].
        The one reading of this description per layer: no engine reads the fields a layer uses."""
        h, nh, nkv, d, inter = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        post = lambda name: name if self.post_norms else None
        ops = [Features()] if tap else []
        ops += [Norm("attn_norm", "hidden_norm" if eagle3 else None),
                Linear("qkv", ("q", "k", "v"), (nh + 2 * nkv) * d, self.attention_bias)]
        if self.qk_norm:
            ops.append(HeadNorm())
        ops += [Rope("local" if self.local_rope(layer) else "global"),
                Attention(self.window(layer), self.attn_logit_softcap, self.scale),
                Linear("o", ("o",), h), Residual(post("post_attn_norm")),
                Norm("mlp_norm"), Linear("gate_up", ("gate", "up"), 2 * inter),
                Gate(self.activation), Linear("down", ("down",), h),
                Residual(post("post_mlp_norm"))]
        return check(tuple(ops), NORMS)

    def programs(self, num_layers: int | None = None, taps: tuple[int, ...] = (),
                 eagle3: bool = False) -> tuple[tuple[Op, ...], ...]:
        """The first `num_layers` layers' programs (all: None); taps: the feature layers."""
        n = self.num_layers if num_layers is None else num_layers
        return tuple(self.program(i, i in taps, eagle3) for i in range(n))

    def llama_layer(self, **changes) -> "ModelConfig":
        """This model's numbers on the plain Llama layer (every feature above cleared; rope keeps
        the global base and scaling): an EAGLE head's layer, whatever family its target is
        (buildlib/heads/eagle.py, train/eagle_model.py), with `changes` (the head's own shape)."""
        plain = dict(activation="silu", qk_norm=False, post_norms=False, sliding_window=0, layer_types=(),
                     rope_local_theta=None, embed_scale=1.0, attn_scale=None, final_logit_softcap=0.0,
                     attn_logit_softcap=0.0)
        if changes.get("head_dim", self.head_dim) != self.head_dim:
            plain["rope_freq_factors"] = ()     # a GGUF's per-dimension factors fit the target's head dim only
        return dataclasses.replace(self, **{**plain, **changes})

    def eagle_head(self, head: dict, vocab_size: int) -> "ModelConfig":
        """An EAGLE head's description for this target (`head`: its config, DraftEntry.head): a
        Llama layer (whatever the target's family: the EAGLE heads published and ours are Llama
        layers reading the target's raw embedding rows and features) of the head's own shape, at
        the target's width and global rope. The build records it in the head's manifest entry."""
        return self.llama_layer(vocab_size=int(vocab_size), num_layers=1, tie_word_embeddings=False,
                                attention_bias=False, num_heads=int(head["num_heads"]),
                                num_kv_heads=int(head["num_kv_heads"]), head_dim=int(head["head_dim"]),
                                intermediate_size=int(head["intermediate_size"]),
                                rms_norm_eps=float(head.get("rms_norm_eps", self.rms_norm_eps)),
                                rope_theta=float(head.get("rope_theta") or self.rope_theta))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["rope_freq_factors"] = list(self.rope_freq_factors)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["rope_freq_factors"] = tuple(d.get("rope_freq_factors", ()))
        return cls(**d)


# What a model may use beyond the Llama layer, declared once: name -> whether a description uses it
# (ModelConfig.features; a backend implements these unless it says otherwise, devices/base.py)
FEATURES: dict[str, Callable[[ModelConfig], bool]] = {
    "gelu_tanh": lambda c: c.activation == "gelu_tanh",
    "qk_norm": lambda c: c.qk_norm,
    "post_norms": lambda c: c.post_norms,
    "sliding_window": lambda c: bool(c.sliding_window),
    "local_rope": lambda c: c.rope_local_theta is not None,
    "embed_scale": lambda c: c.embed_scale != 1.0,
    "attn_scale": lambda c: c.attn_scale is not None,
    "final_logit_softcap": lambda c: bool(c.final_logit_softcap),
    "attn_logit_softcap": lambda c: bool(c.attn_logit_softcap),
}


@dataclass(frozen=True)
class EngineFile:
    """One compiled decoder graph."""

    path: str                 # relative to the manifest's directory
    weights: WeightFormat
    num_layers: int           # < model.num_layers for a self-draft made of the first N layers
    size_bytes: int
    # True when a T-token verify forward gives bitwise the logits of T single steps (measured
    # at build time by builder/check.py); decides whether greedy speculation is token-identical.
    batch_invariant: bool | None = None
    weight_bytes_per_token: int | None = None   # weights one decode step reads
    # EAGLE-3 features: the residual stream entering each of these layers is appended to the
    # forward's `hidden` output after the final-norm features (vLLM's aux-layer indexing: 0 is
    # the embedding, j the output of layer j-1); empty unless an EAGLE-3 head was built
    feature_layers: tuple[int, ...] = ()
    # what the engine's device backend chose for it and must read back (its FP8 recipe, its wide
    # activations, ...): the backend's own record (devices/base.py DeviceRecord; each backend's
    # `record` class types it), kept here as plain JSON this file never reads; None: nothing chosen
    record: dict | None = None


@dataclass(frozen=True)
class DraftEntry:
    """A drafter that needs files: a separate draft model, a self-draft, an EAGLE head, Medusa
    heads, or a registered kind's (backend/draft_kinds). Typed fields for what the runtimes and
    drafters read; `head` is a head's own configuration as its format defines it."""

    kind: str                 # "model" | "self" | "cross-vocab" (a draft model with its own
                              # vocabulary) | "eagle" | "medusa" | a registered kind's entry kind
    path: str                 # engine file (relative), or head directory
    num_layers: int = 0
    source: str = ""          # where it came from (checkpoint path or head dir)
    weights: str | None = None            # its engine's weight format; None: the manifest's default
    record: dict | None = None            # its engine's device record (EngineFile.record)
    model: ModelConfig | None = None      # a separate draft model's own description
    head: dict | None = None              # a head's configuration (EAGLE: its config.json without
                                          # training history; Medusa: num_heads, num_layers)
    vocab_path: str | None = None         # EAGLE: draft vocabulary -> target ids (.npy, relative);
                                          # cross-vocab: the vocabulary map (vocab_map.VocabMap, .npz)
    fc_path: str | None = None            # EAGLE-3: the fc over the target's features (.npy, relative)
    tokenizer_path: str | None = None     # cross-vocab: the draft's own tokenizer.json (relative)
    coverage: dict | None = None          # cross-vocab: the map's coverage (VocabMap.coverage)

    @property
    def draft_vocab_size(self) -> int:
        """An EAGLE head's vocabulary (its LM head's rows)."""
        return int(self.head["draft_vocab_size"])

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_json() if self.model else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> "DraftEntry":
        d = _with_record(cls, d)
        if d.get("model"):
            d["model"] = ModelConfig.from_json(d["model"])
        return cls(**d)


@dataclass(frozen=True)
class EngineManifest:
    model: ModelConfig
    engines: dict[str, EngineFile]          # weight format value -> engine
    default_format: WeightFormat            # the format serving uses (for speculation)
    device: Device
    max_seq_len: int
    tokenizer_path: str                     # tokenizer.json, relative
    chat_template: str | None
    source: str                             # the checkpoint it was built from
    tool_versions: dict[str, str]
    drafts: dict[str, DraftEntry] = field(default_factory=dict)
    cost_model: dict | None = None          # measured forward costs (controller.CostModel)
    gpu: dict | None = None                 # cuda: the GPU built for (name, compute_capability,
                                            # library versions); None: built on a CPU
    source_bytes_per_token: int | None = None   # weights a step reads from the checkpoint itself
                                            # (what llama.cpp streams for the same GGUF)
    version: int = MANIFEST_VERSION
    root: Path | None = None                # directory the manifest was loaded from (not saved)

    def engine(self, fmt: WeightFormat | str | None = None) -> EngineFile:
        key = WeightFormat(fmt or self.default_format).value
        if key not in self.engines:
            raise KeyError(f"engine format {key!r} was not built; built: {sorted(self.engines)}")
        return self.engines[key]

    def resolve(self, rel: str) -> Path:
        assert self.root is not None, "manifest was not loaded from disk"
        return (self.root / rel).resolve()

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "model": self.model.to_json(),
            "engines": {k: _plain_dict(v) for k, v in self.engines.items()},
            "default_format": self.default_format.value,
            "device": self.device.value,
            "max_seq_len": self.max_seq_len,
            "tokenizer_path": self.tokenizer_path,
            "chat_template": self.chat_template,
            "source": self.source,
            "tool_versions": self.tool_versions,
            "drafts": {k: v.to_json() for k, v in self.drafts.items()},
            "cost_model": self.cost_model,
            "gpu": self.gpu,
            "source_bytes_per_token": self.source_bytes_per_token,
        }

    def save(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def with_updates(self, **changes) -> "EngineManifest":
        return dataclasses.replace(self, **changes)

    @classmethod
    def load(cls, directory: str | Path) -> "EngineManifest":
        directory = Path(directory)
        path = directory / MANIFEST_NAME if directory.is_dir() else directory
        if not path.exists():
            raise ManifestMissing(f"no engine manifest at {path}; run `specdec build` first "
                                  f"(or point --model-repository at a built repository)")
        d = json.loads(path.read_text())
        if d.get("version") not in READS:
            raise ManifestMismatch(f"{path}: manifest version {d.get('version')} is not one this specdec reads "
                                   f"({', '.join(map(str, READS))}); rebuild the engines with `specdec build`")
        engines = {k: EngineFile(**{**v, "weights": WeightFormat(v["weights"]),
                                    "feature_layers": tuple(v.get("feature_layers", ()))})
                   for k, v in ((k, _with_record(EngineFile, v)) for k, v in d["engines"].items())}
        return cls(
            model=ModelConfig.from_json(d["model"]),
            engines=engines,
            default_format=WeightFormat(d["default_format"]),
            device=Device(d["device"]),
            max_seq_len=int(d["max_seq_len"]),
            tokenizer_path=d["tokenizer_path"],
            chat_template=d.get("chat_template"),
            source=d.get("source", ""),
            tool_versions=d.get("tool_versions", {}),
            drafts={k: DraftEntry.from_json(v) for k, v in d.get("drafts", {}).items()},
            cost_model=d.get("cost_model"),
            gpu=d.get("gpu"),
            source_bytes_per_token=d.get("source_bytes_per_token"),
            root=path.parent.resolve(),
        )


def _with_record(cls, d: dict) -> dict:
    """An engine's or draft's JSON with its device's choices under `record`: a version-3 manifest
    kept them as flat fields of the shared types (fp8, wide_activations, activations,
    pad_single_token); whatever is not a field of `cls` and holds a value goes into the record as
    it was named, and the device's record class reads it (devices/*: DeviceRecord.from_json)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if "record" in d or set(d) <= names:           # version 4 (an unknown field still fails)
        return dict(d)
    kept = {k: v for k, v in d.items() if k in names}
    old = {k: v for k, v in d.items() if k not in names and v not in (None, False, [], {})}
    return {**kept, "record": kept.get("record") or old or None}


def _plain_dict(obj) -> dict:
    d = dataclasses.asdict(obj)
    return {k: (v.value if isinstance(v, Name) else v) for k, v in d.items()}
