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
KINDS = {"q4": 1, "q8": 2}   # kernels.h SD_Q4_1, SD_Q8_0


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


def repack(kind: str, d: np.ndarray, m: np.ndarray | None, ints: np.ndarray) -> np.ndarray:
    """Source blocks -> the kernel's layout [N/16, nb, 320 | 544] uint8 (N padded to 16 with zero rows)."""
    n, k = ints.shape
    assert k % QBLOCK == 0, f"input width {k} is not a multiple of {QBLOCK}"
    pad = (-n) % LANES
    if pad:
        z = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
        d, ints = z(d), z(ints)
        m = None if m is None else z(m)
    g, nb = (n + pad) // LANES, k // QBLOCK
    lanes = lambda a: np.ascontiguousarray(a.reshape(g, LANES, nb).transpose(0, 2, 1)).view(np.uint8).reshape(g, nb, 2 * LANES)
    x = ints.reshape(g, LANES, nb, QBLOCK).transpose(0, 2, 1, 3)          # [G, nb, lane, 32]
    if kind == "q4":
        x = x.astype(np.uint8)
        lo, hi = x[..., :16].reshape(g, nb, LANES, 4, 4), x[..., 16:].reshape(g, nb, LANES, 4, 4)
        qs = (lo | (hi << 4)).transpose(0, 1, 3, 2, 4).reshape(g, nb, 4 * 4 * LANES)   # [chunk c][lane][4]
        return np.ascontiguousarray(np.concatenate([lanes(d), lanes(m), qs], axis=-1))
    u = (x.astype(np.int16) + 128).astype(np.uint8).reshape(g, nb, LANES, 8, 4)
    qs = u.transpose(0, 1, 3, 2, 4).reshape(g, nb, 8 * 4 * LANES)
    return np.ascontiguousarray(np.concatenate([lanes(d), qs], axis=-1))


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


def rope_tables(cfg: ModelConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, head_dim/2], computed in float32 as transformers does."""
    d = cfg.head_dim
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64)
                                                        .astype(np.float32) / np.float32(d))))
    inv_freq = inv_freq.astype(np.float32)
    pos = np.arange(max_positions, dtype=np.float32)
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        pos = pos / np.float32(rs["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rs)
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")
    freqs = np.outer(pos, inv_freq).astype(np.float32)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def _llama3_inv_freq(inv_freq: np.ndarray, rs: dict) -> np.ndarray:
    factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)
