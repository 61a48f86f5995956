"""GGUF tensors as the native kernel's weight blocks (plugins/native/kernels.h): which kernel
kind a source tensor becomes, and the blocked matrix of one or more row-concatenated tensors.

Every GGUF block type the kernel reads is kept as it is (its integers, f16 scales and packed
sub-block scales, only rearranged by 16 rows): Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, and
Q4_0 as Q4_1 with m = -8d (exact in f16). Other tensors (floats, other GGUF types) are
dequantized and quantized to Q8_0 blocks (round to nearest, scale amax/127 in f16).

Knows: GGUF block layouts, the kernel's layout (engine_format.repack). Does not know: the engine
file (export.py), the kernel, the runtime.
"""
from __future__ import annotations

import numpy as np

from backend.buildlib.checkpoint import SourceTensor
from backend.engine_format import BLOCK_BYTES, BLOCK_ELEMS, LANES, f16_bits, q8_blocks, repack

# GGUF type -> kernel kind (engine_format.KINDS), for the types the kernel reads as they are
_KIND = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8", "Q5_0": "q5_0", "Q5_1": "q5_1",
         "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def kind_of(t: SourceTensor) -> str:
    """The kernel kind (engine_format.KINDS) the tensor becomes alone: its own GGUF type's, or
    q8 for the others (floats too)."""
    return _KIND.get(t.qtype, "q8")


def _f16(blk: np.ndarray, at: int) -> np.ndarray:
    """The f16 bits at byte `at` of each block [N, nb, bytes] -> [N, nb] uint16."""
    return np.ascontiguousarray(blk[:, :, at:at + 2]).view(np.uint16)[..., 0]


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 qh bytes per block [N, nb, 4] -> [N, nb, 32] bits (element j: bit j)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _source_blocks(t: SourceTensor) -> tuple[str, dict]:
    """-> kind, the repack arguments: d [N, nb] f16 bits, m [N, nb] f16 bits (q4, q5_1: the
    offset; q4_k, q5_k: dmin) or None, ints [N, K] (q8: int8; otherwise u >= 0, element order),
    scales (K-quants: GGUF's 12 packed bytes [N, K/256, 12] for q4_k/q5_k, int8 [N, K/256, 16]
    for q6_k) or None."""
    n = t.shape[0]
    if t.qtype not in _KIND:
        d, ints = q8_blocks(t.float32())
        return "q8", dict(d=d, m=None, ints=ints)
    kind = _KIND[t.qtype]
    blk = np.ascontiguousarray(t.rows(), np.uint8).reshape(n, -1, _BLOCK_BYTES[t.qtype])
    nb = blk.shape[1]
    if t.qtype == "Q8_0":
        return kind, dict(d=_f16(blk, 0), m=None, ints=np.ascontiguousarray(blk[:, :, 2:34]).view(np.int8).reshape(n, -1))
    if t.qtype in ("Q4_0", "Q4_1"):
        d = _f16(blk, 0)
        if t.qtype == "Q4_1":
            m, qs = _f16(blk, 2), blk[:, :, 4:20]
        else:                                   # Q4_0: w = d (u - 8) = d u + (-8 d), exact in f16
            m, qs = f16_bits(d.view(np.float16) * np.float16(-8.0)), blk[:, :, 2:18]
        u = np.concatenate([qs & 15, qs >> 4], axis=-1)        # element j and j+16 share byte j
        return kind, dict(d=d, m=m, ints=u.reshape(n, -1))
    if t.qtype in ("Q5_0", "Q5_1"):
        at = 2 if t.qtype == "Q5_0" else 4
        m = _f16(blk, 2) if t.qtype == "Q5_1" else None
        qh, qs = blk[:, :, at:at + 4], blk[:, :, at + 4:at + 20]
        u = np.concatenate([qs & 15, qs >> 4], axis=-1) | (_fifth_bits(qh) << 4)
        return kind, dict(d=_f16(blk, 0), m=m, ints=u.reshape(n, -1))
    if t.qtype in ("Q4_K", "Q5_K"):
        scales = np.ascontiguousarray(blk[:, :, 4:16])
        qs = blk[:, :, -128:].reshape(n, nb, 4, 1, 32)                  # sub-blocks 2i, 2i+1 share 32 bytes
        u = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, nb, 8, 32)
        if t.qtype == "Q5_K":                    # qh[l] bit j: the fifth bit of element l of sub-block j
            qh = blk[:, :, 16:48]
            u = u | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1) << 4)
        return kind, dict(d=_f16(blk, 0), m=_f16(blk, 2), ints=u.reshape(n, -1), scales=scales)
    # Q6_K: ql [128], qh [64], scales [16] int8, d. Per half of 128: element 32k + l has the low
    # nibble of ql[64 half + 32 (k & 1) + l] (k >= 2: high nibble) and bits 2k of qh[32 half + l]
    ql = blk[:, :, :128].reshape(n, nb, 2, 1, 2, 32)                   # [half, ., k & 1, l]
    lo = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(n, nb, 2, 4, 32)   # k = 2 (k >> 1) + (k & 1)
    qh = blk[:, :, 128:192].reshape(n, nb, 2, 1, 32)
    hi = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]) & 3
    u = lo | (hi << 4)
    scales = np.ascontiguousarray(blk[:, :, 192:208]).view(np.int8)
    return kind, dict(d=_f16(blk, 208), m=None, ints=u.reshape(n, -1), scales=scales)


def layout(parts: list[SourceTensor]) -> tuple[str, tuple[int, int, int]]:
    """What matrix(parts) will return, without reading a block: its kind and the shape of its data
    [rows / 16, cols / block, block bytes] (the engine file's index is written before the data)."""
    kinds = {kind_of(p) for p in parts}
    kind = kinds.pop() if len(kinds) == 1 else "q8"
    rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[1]
    return kind, (-(-rows // LANES), cols // BLOCK_ELEMS[kind], BLOCK_BYTES[kind])


def matrix(parts: list[SourceTensor]) -> tuple[str, np.ndarray, int, int]:
    """Row-concatenated source tensors as one blocked matrix -> kind, data, rows (padded), cols.
    Parts of different kinds (a Q8_0 part beside Q4_1 parts) all become Q8_0 (exact for the
    Q8_0 parts)."""
    src = [_source_blocks(p) for p in parts]
    if len({s[0] for s in src}) > 1:
        src = [_source_blocks(SourceTensor(p.name, "F32", p.shape, p.float32())) if s[0] != "q8" else s
               for p, s in zip(parts, src)]
    kind = src[0][0]
    cat = lambda key: None if src[0][1].get(key) is None else np.concatenate([s[1][key] for s in src])
    data = repack(kind, cat("d"), cat("m"), cat("ints"), scales=cat("scales"))
    return kind, data, data.shape[0] * LANES, parts[0].shape[1]
