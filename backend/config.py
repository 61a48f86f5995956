"""Typed configuration: per-request sampling parameters and per-server speculation settings.

Config flows one way: CLI -> BuildConfig (builder/pipeline.py) -> EngineManifest -> ServeConfig.
Request parameters are plain Python scalars, converted once at the Triton boundary
(triton_io.py) and validated once (sequence.validate_request, which calls
SamplingParams.validate). Client mistakes raise `RequestError`, which names the field
and is mapped to Triton INVALID_ARG.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from backend.names import Name


class RequestError(ValueError):
    """A client mistake; `field` names the offending input."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class _DrafterKinds(type):
    """Iterating DrafterKind lists the registered kinds, as iterating an Enum lists its members."""

    def __iter__(cls):
        return iter(cls.registered())


class DrafterKind(Name, metaclass=_DrafterKinds):
    """A drafter's name, as a request's `drafter` input and the server's default name it.

    Behaves as a str Enum (one object per name, compared with `is`; DrafterKind("x") raises
    ValueError for a name nobody registered; `.value` is the name) but is open: a drafter kind
    defined elsewhere registers its name (draft_kinds/, `DrafterKind.register`), so a new kind
    needs no edit here (backend/names.py)."""

    strict = True


DrafterKind.NONE = DrafterKind.register("none")                    # plain decoding
DrafterKind.PROMPT_LOOKUP = DrafterKind.register("prompt-lookup")  # n-gram match in prompt + generated text
DrafterKind.DRAFT_MODEL = DrafterKind.register("draft-model")      # separate draft model or self-draft (first N layers)
DrafterKind.EAGLE = DrafterKind.register("eagle")                  # trained feature-level draft head
DrafterKind.LOOKUP_EAGLE = DrafterKind.register("lookup+eagle")    # prompt lookup when it matches, else the EAGLE head
DrafterKind.MEDUSA = DrafterKind.register("medusa")                # Medusa heads on the target's last hidden state (a chain)
DrafterKind.SUFFIX = DrafterKind.register("suffix")                # suffix decoding: this request's and earlier requests' texts
DrafterKind.AUTO = DrafterKind.register("auto")                    # the server's default drafter


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0         # 0 = greedy
    top_k: int = 0                   # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_tokens_limit: int | None = None) -> "SamplingParams":
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise RequestError("temperature", f"must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p < 1.0):
            raise RequestError("min_p", f"must be in [0, 1), got {self.min_p}")
        if self.max_tokens < 1:
            raise RequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise RequestError("max_tokens", f"must be <= {max_tokens_limit}, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise RequestError("random_seed", f"must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop_strings):
            raise RequestError("stop_words", "empty stop string")
        return self


@dataclass(frozen=True)
class SpecConfig:
    """How a server speculates (defaults for requests that do not say)."""

    auto_drafter: DrafterKind = DrafterKind.AUTO   # what a request's "auto" means; AUTO = the
                                                   # server's best measured (suffix, else prompt-lookup)
    num_draft_tokens: int | None = None     # None = adaptive (cost model + acceptance)
    max_draft_tokens: int = 8               # per-request overrides are clamped to this
    max_tree_nodes: int = 16                # verified nodes per sequence per step (root excluded)
    prompt_lookup_min_ngram: int = 2
    prompt_lookup_max_ngram: int = 4
    prompt_lookup_width: int = 2            # alternative continuations (tree branches)
    suffix_global_tokens: int = 1 << 16     # suffix drafter: tokens of earlier requests it keeps
    draft_model: str | None = None          # manifest draft name for DRAFT_MODEL
    draft_width: int = 1                    # siblings per depth for the draft model's tree
    eagle_depth: int = 5                    # EAGLE-2 tree: expansion steps
    eagle_topk: int = 4                     # EAGLE-2 tree: children per expanded node / frontier size
    eagle_gate: bool = True                 # confidence gating (drafters/eagle.py `level_gate`): stop
                                            # growing the tree where the head is unsure

    def resolve(self, kind: DrafterKind) -> DrafterKind:
        return self.auto_drafter if kind is DrafterKind.AUTO else kind


@dataclass(frozen=True)
class RuntimeOptions:
    """How a server runs its engines; every runtime it loads (target and drafts) gets the same."""

    threads: int | None = None              # CPU threads (None: SPECDEC_THREADS or min(2, cores))
    spinning: bool = True                   # CPU threads spin between forwards
    max_sequences: int | None = None        # KV slots of the torch and native runtimes (None: 64; torch on CPU 16)
    cuda_graphs: bool = True                # torch runtime on a GPU: replay the decode step


@dataclass(frozen=True)
class RemoteDraft:
    """A draft node to draft with (drafters/remote.py) instead of a local draft model or head."""

    url: str                                # host:port of the node's tritonserver (gRPC)
    kind: DrafterKind = DrafterKind.DRAFT_MODEL      # what the node runs: draft-model or eagle
    timeout_s: float = 0.2                  # deadline of one call; beyond it the step falls back
    retry_s: float = 0.5                    # first back-off after a failure (doubles, <= 30 s)


PREFIX_CACHE_MB = 1024     # the prefix cache's default budget (model parameter prefix_cache_mb)


@dataclass(frozen=True)
class ServeConfig:
    engine_dir: str
    weight_format: str | None = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_batch: int = 32                     # sequences verified in one forward
    prefill_chunk: int = 512
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    remote_draft: RemoteDraft | None = None
    prefix_cache_mb: float = PREFIX_CACHE_MB    # KV of shared prompt prefixes kept for reuse (0: off)
