"""The engine files' formats and the model arithmetic that the build (the writer) and the
runtimes (the readers) share, so that neither imports the other: the native kernel's blocked
layout and file (plugins/native/kernels.h), the TensorRT plan's name beside its ONNX file, rotary tables.
Knows: numpy, ModelConfig, the kernel's block layout. Does not know: checkpoints, graphs, runtimes.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backend.manifest import ModelConfig

LANES = 16                # outputs interleaved per block (kernels.h LANES)
QBLOCK = 32
ALIGN = 64
QK_K = 256                # elements per K-quant super-block (kernels.h QK_K)
# kernels.h SD_Q4_1, SD_Q8_0, SD_Q5_0, SD_Q5_1, SD_Q4_K, SD_Q5_K, SD_Q6_K (kernel_abi's order)
KINDS = {"q4": 1, "q8": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7}
BLOCK_ELEMS = {"q4": QBLOCK, "q8": QBLOCK, "q5_0": QBLOCK, "q5_1": QBLOCK,      # inputs per block
               "q4_k": QK_K, "q5_k": QK_K, "q6_k": QK_K}
BLOCK_BYTES = {"q4": LANES * (QBLOCK // 2 + 4),     # 16 rows x (16 nibble bytes, d, m)
               "q8": LANES * (QBLOCK + 2),          # 16 rows x (32 int8, d)
               "q5_0": LANES * 22,                  # 16 rows x GGUF's block: d, 4 bytes of 5th bits, 16 nibble bytes
               "q5_1": LANES * 24,                  # ... and m
               "q4_k": LANES * 144,                 # 16 rows x (d, dmin, 12 scale bytes, 128 nibble bytes)
               "q5_k": LANES * 176,                 # ... and 32 bytes of 5th bits
               "q6_k": LANES * 210}                 # 16 rows x (d, 16 int8 scales, 64 bytes of high 2 bits, 128 nibble bytes)


def kernel_abi() -> dict[str, int]:
    """The layout constants the kernel reports (kernels.c kernel_abi), in its order: what the
    blocks this module writes assume."""
    out = {"LANES": LANES, "QBLOCK": QBLOCK}
    for kind, kid in KINDS.items():
        out[f"{kind} id"] = kid
        out[f"{kind} block bytes"] = BLOCK_BYTES[kind]
    return out


def _f16_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float16).view(np.uint16)


def f16_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float16).view(np.uint16)


def q8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float matrix [N, K] as Q8_0 blocks -> d [N, K/32] f16 bits, ints [N, K] int8 (round to
    nearest, scale amax/127 in f16, as llama.cpp's quantize)."""
    n, k = w.shape
    blocks = np.asarray(w, np.float32).reshape(n, k // QBLOCK, QBLOCK)
    d16 = (np.abs(blocks).max(-1) / np.float32(127.0)).astype(np.float16)
    d32 = d16.astype(np.float32)
    q = np.rint(blocks / np.where(d32 > 0, d32, 1.0)[..., None])
    return d16.view(np.uint16), np.clip(q, -127, 127).astype(np.int8).reshape(n, k)


def repack(kind: str, d: np.ndarray, m: np.ndarray | None, ints: np.ndarray,
           scales: np.ndarray | None = None) -> np.ndarray:
    """Source blocks -> the kernel's layout [N/16, K/block, BLOCK_BYTES[kind]] uint8 (N padded to
    16 with zero rows). d [N, K/block] f16 bits; m the same (q4, q5_1: the offset; q4_k, q5_k:
    dmin) or None; ints [N, K] the elements' integers (q8: int8; q4: u in [0, 16); q5_*: [0, 32);
    q4_k: [0, 16); q5_k: [0, 32); q6_k: [0, 64)); scales (K-quants) [N, K/256, 12] uint8 as the
    GGUF packs them (q4_k, q5_k) or [N, K/256, 16] int8 (q6_k)."""
    n, k = ints.shape
    assert k % BLOCK_ELEMS[kind] == 0, f"input width {k} is not a multiple of {BLOCK_ELEMS[kind]}"
    pad = (-n) % LANES
    if pad:
        z = lambda a: None if a is None else np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
        d, m, ints, scales = z(d), z(m), z(ints), z(scales)
    if kind in ("q4_k", "q5_k"):
        return _repack_k(kind == "q5_k", d, m, scales, ints)
    if kind == "q6_k":
        return _repack_q6_k(d, scales, ints)
    g, nb = (n + pad) // LANES, k // QBLOCK
    x = ints.reshape(g, LANES, nb, QBLOCK).transpose(0, 2, 1, 3)          # [G, nb, lane, 32]
    if kind in ("q4", "q5_0", "q5_1"):
        x = x.astype(np.uint8)
        lo, hi = x[..., :16].reshape(g, nb, LANES, 4, 4) & 15, x[..., 16:].reshape(g, nb, LANES, 4, 4) & 15
        qs = (lo | (hi << 4)).transpose(0, 1, 3, 2, 4).reshape(g, nb, 4 * 4 * LANES)   # [chunk c][lane][4]
        if kind == "q4":
            return np.ascontiguousarray(np.concatenate([_lanes(d), _lanes(m), qs], axis=-1))
        planes = _bit_planes((x >> 4).reshape(g, nb, LANES, 8, 4).transpose(0, 1, 3, 2, 4))   # [G, nb, 8, 8]
        head = [_lanes(d)] if kind == "q5_0" else [_lanes(d), _lanes(m)]
        return np.ascontiguousarray(np.concatenate(head + [planes.reshape(g, nb, 64), qs], axis=-1))
    u = (x.astype(np.int16) + 128).astype(np.uint8).reshape(g, nb, LANES, 8, 4)
    qs = u.transpose(0, 1, 3, 2, 4).reshape(g, nb, 8 * 4 * LANES)
    return np.ascontiguousarray(np.concatenate([_lanes(d), qs], axis=-1))


def _lanes(a: np.ndarray) -> np.ndarray:
    """[N, nb] uint16 (f16 bits) -> [N/16, nb, 32] bytes: per block the 16 lanes' values."""
    n, nb = a.shape
    return np.ascontiguousarray(a.reshape(n // LANES, LANES, nb).transpose(0, 2, 1)).view(np.uint8) \
        .reshape(n // LANES, nb, 2 * LANES)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """[..., LANES, 4] of 0/1 -> [..., 8] bytes: bit 4 lane + e (kernels.h's bit planes)."""
    flat = np.ascontiguousarray(bits, np.uint8).reshape(bits.shape[:-2] + (4 * LANES,))
    return np.packbits(flat, axis=-1, bitorder="little")


def _nibble_pairs(u: np.ndarray, g: int, ns: int) -> np.ndarray:
    """u [N, K] in [0, 16) -> [G, ns, 2048] bytes: per 64 inputs (two 32-element blocks, low and
    high nibbles) 8 chunks [lane][4] (kernels.h Q4_K qs, Q6_K ql)."""
    x = np.asarray(u, np.uint8).reshape(g, LANES, ns, QK_K // 64, 2, 8, 4)
    b = x[:, :, :, :, 0] | (x[:, :, :, :, 1] << 4)                      # [G, lane, ns, pair, c, e]
    return np.ascontiguousarray(b.transpose(0, 2, 3, 4, 1, 5)).reshape(g, ns, QK_K // 64 * 8 * LANES * 4)


def _repack_k(q5: bool, d: np.ndarray, dmin: np.ndarray, scales: np.ndarray, ints: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: [G, ns, d | dmin | scales [3 words][lane] | (q5: qh [8 sub-blocks][8 planes]) | qs]."""
    n, k = ints.shape
    g, ns = n // LANES, k // QK_K
    sc = np.asarray(scales, np.uint8).reshape(g, LANES, ns, 3, 4).transpose(0, 2, 3, 1, 4).reshape(g, ns, 3 * LANES * 4)
    u = np.asarray(ints, np.uint8)
    parts = [_lanes(d), _lanes(dmin), sc]
    if q5:
        bits = (u >> 4).reshape(g, LANES, ns, 8, 8, 4).transpose(0, 2, 3, 4, 1, 5)   # [G, ns, j, c, lane, e]
        parts.append(_bit_planes(bits).reshape(g, ns, 8 * 8 * 8))
    parts.append(_nibble_pairs(u & 15, g, ns))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


def _repack_q6_k(d: np.ndarray, scales: np.ndarray, ints: np.ndarray) -> np.ndarray:
    """Q6_K: [G, ns, d | scales [16 sub-blocks][lane] | qh [8 blocks][2 halves][lane][4] | ql]."""
    n, k = ints.shape
    g, ns = n // LANES, k // QK_K
    sc = np.asarray(scales).view(np.uint8).reshape(g, LANES, ns, 16).transpose(0, 2, 3, 1).reshape(g, ns, 16 * LANES)
    u = np.asarray(ints, np.uint8)
    h2 = (u >> 4).reshape(g, LANES, ns, 8, 2, 4, 4)                       # [.., block, half, k, e]
    qh = h2[..., 0, :] | (h2[..., 1, :] << 2) | (h2[..., 2, :] << 4) | (h2[..., 3, :] << 6)
    qh = np.ascontiguousarray(qh.transpose(0, 2, 3, 4, 1, 5)).reshape(g, ns, 8 * 2 * LANES * 4)
    return np.ascontiguousarray(np.concatenate([_lanes(d), sc, qh, _nibble_pairs(u & 15, g, ns)], axis=-1))


def blocked(w: np.ndarray) -> tuple[str, np.ndarray, int, int]:
    """A float matrix [N, K] as Q8_0 blocks in the kernel's layout -> kind, data, rows (padded
    to 16), cols: for the kernel alone (runtime/native.BlockedMatrix)."""
    d, ints = q8_blocks(np.ascontiguousarray(w, np.float32))
    data = repack("q8", d, None, ints)
    return "q8", data, data.shape[0] * LANES, ints.shape[1]


def read_native(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """-> header, tensors (read-only memory maps of the file: every runtime of the process that
    opens the same engine shares its pages)."""
    path = Path(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    start = -(-(8 + n) // ALIGN) * ALIGN
    mm = np.memmap(path, np.uint8, "r")
    out = {}
    for name, t in header["tensors"].items():
        raw = mm[start + t["offset"]: start + t["offset"] + t["nbytes"]]
        out[name] = raw.view(np.float32).reshape(t["shape"]) if t["kind"] == "f32" else raw
    return header, out


def plan_path(onnx_path: Path) -> Path:
    """Where a TensorRT engine's plan lies: beside its ONNX file."""
    return Path(onnx_path).with_suffix(".plan")


def rope_tables(cfg: ModelConfig, max_positions: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, head_dim/2], computed in float32 as transformers does; local: the
    sliding layers' tables (rope_local_theta, unscaled: Gemma-3). Every engine reads these tables,
    so a rope variant is data here: per-dimension divisors (rope_freq_factors), a scaling kind
    (rope_scaling) and a factor on cos and sin (long-rope's attention factor)."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.int64)
                                                        .astype(np.float32) / np.float32(d))))
    inv_freq = inv_freq.astype(np.float32)
    pos = np.arange(max_positions, dtype=np.float32)
    if cfg.rope_freq_factors and not local:     # llama.cpp: theta_i = pos * base^(-2i/d) / factor_i
        inv_freq = (inv_freq / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    rs = {} if local else (cfg.rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        pos = pos / np.float32(rs["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rs)
    elif kind == "longrope":
        return _longrope_tables(cfg, rs, max_positions)
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3, longrope)")
    freqs = np.outer(pos, inv_freq).astype(np.float32)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def _longrope_tables(cfg: ModelConfig, rs: dict, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """Long-rope (Phi-3; transformers' _compute_longrope_parameters): inv_freq_i = 1 / (f_i *
    base^(2i/d)), f the short factors or the long ones, and cos/sin times the attention factor.

    Which set: transformers picks one per forward (long once the forward's last position is at
    or past original_max_position_embeddings; its cached keys keep the set they were rotated
    with, and its generate() drops the cache at the crossing to recompute all with the long set);
    llama.cpp and vLLM pick one per context size (the long set throughout for a context longer than
    the original, at a cost on short sequences). An engine's cache needs a fixed function of
    the position, so row p uses the short set for p < original and the long one past it. That is
    transformers exactly for every sequence within the original context, whatever context the
    engine is built for; past it, transformers' forward over its own cache, not generate()'s
    recompute (all positions long). The price: past the original context, queries rotated with
    the long set meet the first keys rotated with the short one."""
    d = cfg.head_dim
    shape = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    base = np.float32(cfg.rope_theta) ** shape
    original = int(rs["original_max_position_embeddings"])
    pos = np.arange(max_positions, dtype=np.float32)
    short, long = ((np.float32(1.0) / (np.asarray(rs[k], np.float32) * base)).astype(np.float32)
                   for k in ("short_factor", "long_factor"))
    freqs = np.where((pos >= original)[:, None], np.outer(pos, long), np.outer(pos, short)).astype(np.float32)
    scale = np.float32(rs["attention_factor"])
    return (np.cos(freqs) * scale).astype(np.float32), (np.sin(freqs) * scale).astype(np.float32)


def _llama3_inv_freq(inv_freq: np.ndarray, rs: dict) -> np.ndarray:
    factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)
