"""Read Llama-family checkpoints (Hugging Face directory or GGUF file) into one neutral form.

Knows: config keys of Llama / SmolLM / Mistral / Qwen2 / Qwen3 / Gemma-2 / Gemma-3 / Phi-3 in
both formats, tensor naming of HF and llama.cpp, the Q/K row permutation llama.cpp's converter
applies to `llama` GGUFs, Phi-3's fused matrices (split here), how each format stores rope
scaling. Does not know: ONNX or quantized kernel layouts (graph.py, quant.py).

Every linear weight comes out as a `SourceTensor` of shape [out_features, in_features] that is
either float or still in its GGUF block encoding, so a 4-bit engine can repack blocks exactly.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backend.errors import UserError
from backend.manifest import NORMS, ModelConfig

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3", "smollm", "gemma2", "gemma3", "phi3"}
FLOAT_TYPES = {"F32", "F16", "BF16"}
BLOCK_TYPES = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
                    "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}
# Gemma's RMSNorm multiplies by (1 + w): its checkpoints' norms get the 1 added when read, as
# llama.cpp's converter does, so every engine applies plain x / rms(x) * w (manifest.ModelConfig)
_PLUS_ONE_NORMS = {"gemma2", "gemma3"}
_GEMMA = {"gemma2", "gemma3"}
# rope kinds rope_tables computes (engine_format.py); another is refused when the checkpoint is read
_ROPE_KINDS = {"linear", "llama3", "longrope"}


class CheckpointError(UserError, ValueError):
    """The checkpoint cannot be built: unsupported architecture, tensor type, or missing file."""


@dataclass
class SourceTensor:
    name: str
    qtype: str                      # "F32" | "F16" | "BF16" | one of BLOCK_TYPES
    shape: tuple[int, ...]          # logical shape, [out, in] for matrices
    raw: np.ndarray                 # float array, or uint8 [out, bytes_per_row] of GGUF blocks
    row_perm: np.ndarray | None = None   # [out] int64: row i of the result is raw row row_perm[i]

    def rows(self) -> np.ndarray:
        """Raw data with the row permutation applied (still encoded)."""
        return self.raw if self.row_perm is None else self.raw[self.row_perm]

    def float32(self) -> np.ndarray:
        """Exact dequantization to float32, in logical shape."""
        raw = self.rows()
        if self.qtype == "F32":
            out = np.asarray(raw, dtype=np.float32)
        elif self.qtype == "F16":
            out = np.asarray(raw).astype(np.float32)
        elif self.qtype == "BF16":
            out = (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            import gguf  # the reference dequantizer (ggml-quants.c semantics)
            out = gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[self.qtype])
        return np.ascontiguousarray(out.reshape(self.shape))


@dataclass
class TokenizerSource:
    tokenizer_json: str | None = None          # contents of tokenizer.json (HF)
    gguf_vocab: dict | None = None             # tokens/merges/types/pre from GGUF metadata
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, SourceTensor]   # canonical names, see _canonical_* below
    tokenizer: TokenizerSource
    source: str
    file_type: str = ""                # dominant tensor type, for the build summary
    extra: dict = field(default_factory=dict)

    def tensor(self, name: str) -> SourceTensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.source}: missing tensor {name!r}")
        return self.tensors[name]

    def bytes_per_token(self) -> int:
        """Bytes of weights a decode step reads straight from this checkpoint's tensors (as
        llama.cpp does from a GGUF): all of them, the embedding only when it is also the LM
        head (tied; otherwise one row)."""
        tied = "lm_head" not in self.tensors
        return sum(int(t.raw.nbytes) for k, t in self.tensors.items() if k != "embed" or tied)


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if path.is_dir():
        return _load_hf(path)
    if path.suffix == ".gguf" and path.exists():
        return _load_gguf(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory; expected a Hugging Face checkpoint "
                              f"directory or a .gguf file (--target)")
    raise CheckpointError(f"{path}: expected a Hugging Face checkpoint directory or a .gguf file")


# ---------------------------------------------------------------------------------------------
# Hugging Face directory: config.json + *.safetensors + tokenizer.json + tokenizer_config.json


def _load_hf(d: Path) -> Checkpoint:
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{d}: no config.json")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    mtype = cfg.get("model_type")
    arch = HF_ARCHITECTURES.get(archs[0]) or HF_MODEL_TYPES.get(mtype) or (mtype if mtype in SUPPORTED_ARCHITECTURES else None)
    if arch is None:
        raise CheckpointError(f"{d}: unsupported architecture {archs[0]!r}; supported: "
                              f"{sorted(HF_ARCHITECTURES)}")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    tok_cfg = _read_json(d / "tokenizer_config.json")
    gen_cfg = _read_json(d / "generation_config.json")
    if isinstance(gen_cfg.get("eos_token_id"), (int, list)):
        g = gen_cfg["eos_token_id"]
        eos_ids = tuple(dict.fromkeys(eos_ids + (tuple(g) if isinstance(g, list) else (g,))))
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **_hf_rope(cfg, d), **_hf_family(arch, cfg, hidden),
    )
    tensors: dict[str, SourceTensor] = {}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files")
    for f in files:
        for name, t in _read_safetensors(f).items():
            canon = _canonical_hf(name, arch)
            if canon is not None:
                tensors[canon] = t
    _split_fused(tensors, config)
    if arch in _PLUS_ONE_NORMS:
        for k, t in list(tensors.items()):
            if k == "norm" or k.rsplit(".", 1)[-1] in NORMS:      # every norm a layer program names
                tensors[k] = SourceTensor(k, "F32", t.shape, t.float32() + np.float32(1.0))
    if "lm_head" not in tensors and not config.tie_word_embeddings:
        raise CheckpointError(f"{d}: no lm_head.weight and tie_word_embeddings is false")
    tok_json = d / "tokenizer.json"
    if not tok_json.exists():
        raise CheckpointError(f"{d}: no tokenizer.json")
    template = tok_cfg.get("chat_template")
    if template is None and (d / "chat_template.jinja").exists():
        template = (d / "chat_template.jinja").read_text()
    tokenizer = TokenizerSource(
        tokenizer_json=tok_json.read_text(), chat_template=template,
        bos_token_id=config.bos_token_id, eos_token_ids=config.eos_token_ids,
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)))
    types = {t.qtype for t in tensors.values()}
    return Checkpoint(config, tensors, tokenizer, str(d), file_type="/".join(sorted(types)))


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}


_ST_DTYPES = {"F32": ("F32", np.float32), "F16": ("F16", np.float16), "BF16": ("BF16", np.uint16)}


def _read_safetensors(path: Path) -> dict[str, SourceTensor]:
    """Memory-map a .safetensors file (parsed here so BF16 needs no torch)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        qtype, dt = _ST_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        arr = data[start:end].view(dt).reshape(info["shape"])
        out[name] = SourceTensor(name, qtype, tuple(info["shape"]), arr)
    return out


def _hf_rope(cfg: dict, d: Path) -> dict:
    """rope_theta, rope_scaling and the sliding layers' base from an HF config: transformers 5's
    `rope_parameters` (one dict, or one per layer type) or the older top-level keys."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        full, local = rp["full_attention"], rp.get("sliding_attention")
    else:
        full, local = (rp if isinstance(rp, dict) else {}), None
    theta = float(full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in full.items() if k != "rope_theta"} if rp else cfg.get("rope_scaling")
    partial = float((scaling or {}).get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise CheckpointError(f"{d}: rotary embedding on part of each head (partial_rotary_factor {partial}) "
                              f"is not supported")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        scaling = None
    elif kind == "longrope" or "short_factor" in scaling:
        scaling = _hf_longrope(cfg, scaling)     # Phi-3's config reads "su" and "yarn" as longrope
    elif kind not in _ROPE_KINDS:
        raise CheckpointError(f"{d}: rope scaling {kind!r} is not supported (supported: {sorted(_ROPE_KINDS)})")
    out = {"rope_theta": theta, "rope_scaling": scaling}
    if local is not None or cfg.get("rope_local_base_freq") is not None:
        out["rope_local_theta"] = float((local or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    return out


def _hf_longrope(cfg: dict, rs: dict) -> dict:
    """Long-rope as ModelConfig keeps it, the same from either format: both factor lists, the
    original context and the attention factor, in float32 as transformers computes them
    (_compute_longrope_parameters: original_max_position_embeddings from the top level first;
    factor max_position_embeddings / original unless given; attention factor sqrt(1 + ln(factor) /
    ln(original)) unless given, 1 for factor <= 1)."""
    original = int(cfg.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
                   or cfg["max_position_embeddings"])
    factor = float(rs.get("factor") or cfg["max_position_embeddings"] / original)
    attention = rs.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return _longrope(rs["short_factor"], rs["long_factor"], original, attention)


def _longrope(short, long, original: int, attention: float) -> dict:
    f32 = lambda xs: [float(x) for x in np.asarray(xs, np.float32)]
    return {"rope_type": "longrope", "short_factor": f32(short), "long_factor": f32(long),
            "original_max_position_embeddings": int(original), "attention_factor": float(np.float32(attention))}


def _hf_family(arch: str, cfg: dict, hidden: int) -> dict:
    """What an architecture adds to the Llama layer, from its HF config (manifest.ModelConfig)."""
    out: dict = {}
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    types = cfg.get("layer_types")
    if window and types:
        out["sliding_window"] = int(window)
        out["layer_types"] = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
    elif window and arch in ("mistral", "phi3"):
        out["sliding_window"] = int(window)
    if arch == "qwen3":
        out["qk_norm"] = True
    if arch in _GEMMA:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise CheckpointError(f"{arch} activation {act!r} is not supported (gelu_pytorch_tanh)")
        out.update(activation="gelu_tanh", qk_norm=arch == "gemma3", post_norms=True,
                   embed_scale=float(np.float32(hidden ** 0.5)),
                   attn_scale=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim")) ** -0.5,
                   final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
                   # read for Gemma-3 too, as its config documents it, although transformers'
                   # Gemma-3 attention ignores it (real Gemma-3 configs set it to null)
                   attn_logit_softcap=float(cfg.get("attn_logit_softcapping") or 0.0))
    return out


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    # Phi-3's fused matrices, split by _split_fused: q, k, v rows; gate rows, then up rows
    "self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up",
}
# Gemma names its norms after where they sit: its post_attention_layernorm norms the attention's
# output, pre_feedforward_layernorm is Llama's post_attention_layernorm
_HF_GEMMA_NORMS = {"post_attention_layernorm.weight": "post_attn_norm",
                   "pre_feedforward_layernorm.weight": "mlp_norm",
                   "post_feedforward_layernorm.weight": "post_mlp_norm"}


def _canonical_hf(name: str, arch: str = "llama") -> str | None:
    if name == "model.embed_tokens.weight":
        return "embed"
    if name == "model.norm.weight":
        return "norm"
    if name == "lm_head.weight":
        return "lm_head"
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        i, rest = parts[2], ".".join(parts[3:])
        table = {**_HF_LAYER_NAMES, **(_HF_GEMMA_NORMS if arch in _GEMMA else {})}
        if rest in table:
            return f"layers.{i}.{table[rest]}"
        if rest.endswith("rotary_emb.inv_freq"):
            return None
    raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")


# ---------------------------------------------------------------------------------------------
# GGUF file (llama.cpp)

_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
    "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "post_attention_norm": "post_attn_norm",
    "post_ffw_norm": "post_mlp_norm", "attn_qkv": "qkv",
}
# tensors outside the layers that describe rope (they go into ModelConfig): Llama-3.1's scaling as
# per-dimension divisors, Phi-3's long-rope factor sets
_GGUF_ROPE_TENSORS = {"rope_freqs.weight": "rope_freqs", "rope_factors_long.weight": "long_factor",
                      "rope_factors_short.weight": "short_factor"}


def _load_gguf(path: Path) -> Checkpoint:
    from backend.buildlib.gguf_file import read_gguf

    fields, gguf_tensors = read_gguf(path)

    def meta(key, default=None):
        return fields.get(key, default)

    def need(key):
        v = meta(key)
        if v is None:
            raise CheckpointError(f"{path.name}: GGUF metadata {key!r} is missing; the file is incomplete "
                                  f"or was not written by llama.cpp's converter")
        return v

    arch = meta("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path.name}: unsupported architecture {arch!r}; supported: "
                              f"{sorted(SUPPORTED_ARCHITECTURES)}")
    heads = int(need(f"{arch}.attention.head_count"))
    hidden = int(need(f"{arch}.embedding_length"))
    tokens = meta("tokenizer.ggml.tokens")
    tensors: dict[str, SourceTensor] = {}
    rope: dict[str, np.ndarray] = {}
    types: dict[str, int] = {}
    for t in gguf_tensors:
        qtype = t.type_name
        if t.name in _GGUF_ROPE_TENSORS:
            rope[_GGUF_ROPE_TENSORS[t.name]] = SourceTensor(t.name, qtype, (int(t.dims[0]),), t.data).float32()
            continue
        canon = _canonical_gguf(t.name)
        if canon is None:
            continue
        if qtype not in FLOAT_TYPES and qtype not in BLOCK_TYPES:
            raise CheckpointError(f"{path.name}: tensor {t.name} has quantization type {qtype}, "
                                  f"which is not supported (supported: "
                                  f"{sorted(FLOAT_TYPES | BLOCK_TYPES)})")
        shape = tuple(int(x) for x in reversed(t.dims))  # GGUF lists ne0 (inner) first
        tensors[canon] = SourceTensor(canon, qtype, shape, t.data)
        types[qtype] = types.get(qtype, 0) + 1
    num_kv = int(meta(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta(f"{arch}.attention.key_length", hidden // heads))
    vocab = int(meta(f"{arch}.vocab_size", len(tokens) if tokens else 0))
    eos = meta("tokenizer.ggml.eos_token_id")
    eot = meta("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need(f"{arch}.feed_forward_length")),
        num_layers=int(need(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta(f"{arch}.context_length", 2048)),
        tie_word_embeddings="lm_head" not in tensors,
        attention_bias="layers.0.q_bias" in tensors,
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        **_gguf_rope(path, arch, meta, rope, head_dim),
        **_gguf_family(arch, meta, hidden, heads, head_dim, int(need(f"{arch}.block_count"))),
    )
    if arch == "phi3":           # its ffn_up holds gate and up (llama.cpp's LLM_FFN_SWIGLU halves)
        for key in [k for k in tensors if k.endswith(".up")]:
            tensors[key[:-len("up")] + "gate_up"] = tensors.pop(key)
    _split_fused(tensors, config)
    if arch in ("llama", "mistral", "smollm"):
        # llama.cpp's converter interleaves Q/K rows for its rotary layout; undo it so the
        # HF "rotate_half" formulation applies (convert_hf_to_gguf.py LlamaModel.permute).
        for i in range(config.num_layers):
            for name, nh in (("q", config.num_heads), ("k", config.num_kv_heads)):
                for suffix in ("", "_bias"):
                    key = f"layers.{i}.{name}{suffix}"
                    if key in tensors:
                        tensors[key].row_perm = _unpermute_rows(nh, config.head_dim)
    if tokens is None:
        raise CheckpointError(f"{path.name}: no tokenizer in GGUF metadata")
    tokenizer = TokenizerSource(
        gguf_vocab={
            "model": meta("tokenizer.ggml.model"), "pre": meta("tokenizer.ggml.pre"),
            "tokens": list(tokens), "merges": list(meta("tokenizer.ggml.merges") or []),
            "token_types": [int(x) for x in meta("tokenizer.ggml.token_type")],
            # SentencePiece ("llama"): merge priorities come from the scores
            "scores": [float(x) for x in (meta("tokenizer.ggml.scores") or [])],
            "add_space_prefix": bool(meta("tokenizer.ggml.add_space_prefix", True)),
            "unknown_token_id": meta("tokenizer.ggml.unknown_token_id"),
        },
        chat_template=meta("tokenizer.chat_template"),
        bos_token_id=config.bos_token_id, eos_token_ids=eos_ids,
        add_bos_token=bool(meta("tokenizer.ggml.add_bos_token", False)))
    dominant = max(types.items(), key=lambda kv: kv[1])[0]
    return Checkpoint(config, tensors, tokenizer, str(path), file_type=dominant)


def _gguf_rope(path: Path, arch: str, meta, rope: dict[str, np.ndarray], head_dim: int) -> dict:
    """rope_scaling and rope_freq_factors from a GGUF, as convert_hf_to_gguf.py stores them:
    linear scaling in metadata; Llama-3.1's as the rope_freqs tensor (per-dimension divisors);
    Phi-3's long-rope as its two factor tensors, the original context and the attention factor
    (computed as the converter does where the file lacks it)."""
    rot = meta(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise CheckpointError(f"{path.name}: rotary embedding on {rot} of each head's {head_dim} dimensions "
                              f"(partial rotary) is not supported")
    out: dict = {"rope_scaling": None}
    if meta(f"{arch}.rope.scaling.type") == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(meta(f"{arch}.rope.scaling.factor"))}
    if "rope_freqs" in rope:
        out["rope_freq_factors"] = tuple(float(x) for x in rope["rope_freqs"])
    if "long_factor" in rope:
        ctx = int(meta(f"{arch}.context_length", 2048))
        original = int(meta(f"{arch}.rope.scaling.original_context_length", ctx))
        attention = meta(f"{arch}.rope.scaling.attn_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(ctx / original) / math.log(original)) if ctx > original else 1.0
        out["rope_scaling"] = _longrope(rope["short_factor"], rope["long_factor"], original, attention)
    return out


def _gguf_family(arch: str, meta, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """What an architecture adds to the Llama layer, from GGUF metadata. What the file does not
    store, llama.cpp hard-codes per architecture (src/llama-model.cpp load_hparams), and so do we:
    Gemma-3's sliding layers (five of every six), their rope base (10k) and q's scale
    (1/sqrt(key_length); the 27B's differs and is refused); Gemma-2's sliding layers (the even
    ones), its q's scale (1/sqrt(key_length); the 27B's, 46 layers, 1/sqrt(hidden / heads)) and,
    where the file lacks them, its window (4096) and soft-caps (50 on scores, 30 on logits)."""
    out: dict = {}
    window = meta(f"{arch}.attention.sliding_window")
    if arch == "qwen3":
        out["qk_norm"] = True
    if arch == "gemma2":
        out.update(activation="gelu_tanh", post_norms=True, embed_scale=float(np.float32(hidden ** 0.5)),
                   attn_scale=float(hidden // heads if layers == 46 else head_dim) ** -0.5,
                   final_logit_softcap=float(meta(f"{arch}.final_logit_softcapping", 30.0)),
                   attn_logit_softcap=float(meta(f"{arch}.attn_logit_softcapping", 50.0)))
        window = meta(f"{arch}.attention.sliding_window", 4096)
        if window:
            out.update(sliding_window=int(window),
                       layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(layers)))
    elif arch == "gemma3":
        if layers == 62:
            raise CheckpointError("gemma3 27B (its attention scale is not stored in the GGUF) is not supported")
        out.update(activation="gelu_tanh", qk_norm=True, post_norms=True, rope_local_theta=10000.0,
                   embed_scale=float(np.float32(hidden ** 0.5)), attn_scale=float(head_dim) ** -0.5,
                   final_logit_softcap=float(meta(f"{arch}.final_logit_softcapping", 0.0) or 0.0))
        if window:
            out.update(sliding_window=int(window),
                       layer_types=tuple("full" if i % 6 == 5 else "sliding" for i in range(layers)))
    elif window:
        out["sliding_window"] = int(window)
    return out


def _canonical_gguf(name: str) -> str | None:
    if name == "token_embd.weight":
        return "embed"
    if name == "output_norm.weight":
        return "norm"
    if name == "output.weight":
        return "lm_head"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        i, base, kind = parts[1], parts[2], parts[3]
        if base in _GGUF_LAYER_NAMES:
            canon = _GGUF_LAYER_NAMES[base]
            return f"layers.{i}.{canon}" + ("_bias" if kind == "bias" else "")
    raise CheckpointError(f"unexpected tensor {name!r} in GGUF")


def _split_fused(tensors: dict[str, SourceTensor], cfg: ModelConfig) -> None:
    """Phi-3's fused matrices as the parts every engine reads: qkv -> q, k, v (rows of num_heads,
    num_kv_heads and num_kv_heads heads), gate_up -> gate, up (halves). In place. A split by rows
    is exact in either format: a GGUF block runs along a row."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for key in [k for k in tensors if k.endswith((".qkv", ".gate_up"))]:
        t = tensors.pop(key)
        prefix = key.rsplit(".", 1)[0]
        if key.endswith(".qkv"):
            if t.shape[0] != q + 2 * kv:
                raise CheckpointError(f"tensor {t.name}: {t.shape[0]} rows, expected q, k and v's {q + 2 * kv}")
            parts = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        else:
            if t.shape[0] != 2 * cfg.intermediate_size:
                raise CheckpointError(f"tensor {t.name}: {t.shape[0]} rows, expected gate and up's "
                                      f"{2 * cfg.intermediate_size}")
            parts = {"gate": (0, cfg.intermediate_size), "up": (cfg.intermediate_size, 2 * cfg.intermediate_size)}
        for name, (a, b) in parts.items():
            key = f"{prefix}.{name}"
            tensors[key] = SourceTensor(key, t.qtype, (b - a,) + t.shape[1:], t.rows()[a:b])


def _unpermute_rows(num_heads: int, head_dim: int) -> np.ndarray:
    """Row order that maps llama.cpp's interleaved rotary rows back to HF's half-split rows."""
    idx = np.arange(num_heads * head_dim)
    return idx.reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
