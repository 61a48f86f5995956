"""Exact translation of GGUF weight blocks into ONNX Runtime's MatMulNBits layout.

Every supported block type is first decoded to one canonical form (all arrays per output row n
and block b):

    w[n, b*bs + j] = scale[n, b] * (ints[n, b*bs + j] - 2**(bits-1)) + offset[n, b]

MatMulNBits without a zero-point input computes exactly the first term (its implicit zero point
is 2**(bits-1)); the offset term becomes a tiny fp32 correction in the graph:
    x @ w.T = MatMulNBits(x) + ReduceSum(x per block) @ offset.T
Repacking the blocks this way is lossless. Re-quantizing dequantized floats instead lost about a
third of top-1 agreement for SmolLM2 Q4_1 (../shared/reference/cpu-engine.md section 4).

Knows: GGUF block layouts (ggml-quants.c), MatMulNBits packing. Does not know: graph wiring.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# bytes per block and elements per block of each GGUF type
_BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32), "Q4_K": (144, 256),
          "Q6_K": (210, 256)}


@dataclass
class Blocks:
    bits: int                 # 4 or 8
    block_size: int           # 16 or 32 elements sharing one scale
    ints: np.ndarray          # [N, K] uint8, values in [0, 2**bits)
    scale: np.ndarray         # [N, K // block_size] float32
    offset: np.ndarray | None # [N, K // block_size] float32, None when all zero

    def dequantize(self) -> np.ndarray:
        n, k = self.ints.shape
        nb = k // self.block_size
        q = self.ints.reshape(n, nb, self.block_size).astype(np.float32) - (1 << (self.bits - 1))
        w = q * self.scale[:, :, None]
        if self.offset is not None:
            w = w + self.offset[:, :, None]
        return w.reshape(n, k).astype(np.float32)

    def scaled(self, factor: float) -> "Blocks":
        off = None if self.offset is None else (self.offset * np.float32(factor)).astype(np.float32)
        return Blocks(self.bits, self.block_size, self.ints,
                      (self.scale * np.float32(factor)).astype(np.float32), off)


def decodable(qtype: str) -> bool:
    """Whether decode_blocks repacks this GGUF type exactly."""
    return qtype in _BLOCK


def decode_blocks(qtype: str, raw: np.ndarray) -> Blocks:
    """Decode GGUF rows [N, bytes_per_row] (uint8) into canonical Blocks."""
    if qtype not in _BLOCK:
        raise ValueError(f"quantization type {qtype} is not supported for exact repacking")
    nbytes, nel = _BLOCK[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    blk = raw.reshape(n, -1, nbytes)                       # [N, nblocks, nbytes]
    return _DECODERS[qtype](blk, n)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _q4_0(blk, n):
    d = _f16(blk[:, :, 0:2])
    qs = blk[:, :, 2:18]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)       # element j and j+16 share a byte
    return Blocks(4, 32, q.reshape(n, -1), d, None)


def _q4_1(blk, n):
    d = _f16(blk[:, :, 0:2])
    m = _f16(blk[:, :, 2:4])
    qs = blk[:, :, 4:20]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    # w = d*q + m = d*(q - 8) + (m + 8d)
    return Blocks(4, 32, q.reshape(n, -1), d, (m + 8.0 * d).astype(np.float32))


def _q8_0(blk, n):
    d = _f16(blk[:, :, 0:2])
    q = blk[:, :, 2:34].view(np.int8).astype(np.int16) + 128
    return Blocks(8, 32, q.astype(np.uint8).reshape(n, -1), d, None)


def _q4_k(blk, n):
    nb = blk.shape[1]
    d = _f16(blk[:, :, 0:2])
    dmin = _f16(blk[:, :, 2:4])
    s = blk[:, :, 4:16].astype(np.uint8)                  # 12 bytes of packed 6-bit scales/mins
    sc = np.empty((n, nb, 8), np.uint8)
    mn = np.empty((n, nb, 8), np.uint8)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = blk[:, :, 16:144].reshape(n, nb, 4, 32)          # 4 chunks of 64 values
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, nb, 8, 32)   # sub-block 2c, 2c+1
    scale = d[..., None] * sc                              # [N, nb, 8]
    minv = dmin[..., None] * mn
    # w = scale*q - minv = scale*(q - 8) + (8*scale - minv)
    offset = (8.0 * scale - minv).astype(np.float32)
    return Blocks(4, 32, q.reshape(n, -1), scale.reshape(n, -1).astype(np.float32),
                  offset.reshape(n, -1))


def _q6_k(blk, n):
    nb = blk.shape[1]
    ql = blk[:, :, 0:128].reshape(n, nb, 2, 64)
    qh = blk[:, :, 128:192].reshape(n, nb, 2, 32)
    sc = blk[:, :, 192:208].view(np.int8).astype(np.float32).reshape(n, nb, 16)
    d = _f16(blk[:, :, 208:210])
    lo_a, lo_b = ql[..., :32], ql[..., 32:]
    q = np.stack([
        (lo_a & 15) | ((qh & 3) << 4),
        (lo_b & 15) | (((qh >> 2) & 3) << 4),
        (lo_a >> 4) | (((qh >> 4) & 3) << 4),
        (lo_b >> 4) | (((qh >> 6) & 3) << 4),
    ], axis=3)                                             # [N, nb, half, 4, 32], values 0..63
    # ggml: 16 sub-blocks of 16; sub-block index = half*8 + quarter*2 + (l >= 16)
    q = q.reshape(n, nb, 16, 16)
    scale = d[..., None] * sc                              # [N, nb, 16]
    # w = scale*(q - 32) = scale*((q + 96) - 128): exact as 8-bit blocks of 16
    ints = (q.astype(np.int16) + 96).astype(np.uint8)
    return Blocks(8, 16, ints.reshape(n, -1), scale.reshape(n, -1).astype(np.float32), None)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def quantize_rtn(w: np.ndarray, bits: int = 4, block_size: int = 32) -> Blocks:
    """Round-to-nearest asymmetric quantization of float weights [N, K] (for float sources).

    Lossy by nature (unlike the GGUF repack); used only when the checkpoint holds floats.
    """
    n, k = w.shape
    assert k % block_size == 0, (k, block_size)
    wb = w.reshape(n, k // block_size, block_size).astype(np.float32)
    lo, hi = wb.min(-1), wb.max(-1)
    levels = (1 << bits) - 1
    # a constant block (a zeroed padding row: Gemma's <pad> embedding) gets a scale at its own
    # size, not 1.0: the offset (lo + 2**(bits-1) * scale) is applied to exact activation sums
    # while MatMulNBits' int8 path sums quantized activations, a mismatch that grows with it
    flat = np.maximum(np.abs(lo), np.float32(1e-8)) / levels
    scale = np.where(hi > lo, (hi - lo) / levels, flat).astype(np.float32)
    q = np.clip(np.rint((wb - lo[..., None]) / scale[..., None]), 0, levels).astype(np.uint8)
    # w ~= scale*q + lo = scale*(q - 2**(bits-1)) + (lo + 2**(bits-1)*scale)
    offset = (lo + (1 << (bits - 1)) * scale).astype(np.float32)
    return Blocks(bits, block_size, q.reshape(n, k), scale, offset)


def pack_matmul_nbits(b: Blocks) -> tuple[np.ndarray, np.ndarray]:
    """Blocks -> (B [N, K/bs, bs*bits/8] uint8, scales [N * K/bs] float32) for MatMulNBits."""
    n, k = b.ints.shape
    nb = k // b.block_size
    if b.bits == 4:
        q = b.ints.reshape(n, k // 2, 2)
        packed = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)   # adjacent elements share a byte
    else:
        assert b.bits == 8, b.bits
        packed = b.ints
    return (np.ascontiguousarray(packed.reshape(n, nb, b.block_size * b.bits // 8)),
            np.ascontiguousarray(b.scale.reshape(-1).astype(np.float32)))


def concat_rows(parts: list[Blocks]) -> Blocks:
    """Stack Blocks along the output dimension (fused QKV, fused gate/up)."""
    assert len({(p.bits, p.block_size) for p in parts}) == 1, [(p.bits, p.block_size) for p in parts]
    has_off = any(p.offset is not None for p in parts)
    offs = [p.offset if p.offset is not None else np.zeros_like(p.scale) for p in parts]
    return Blocks(parts[0].bits, parts[0].block_size,
                  np.concatenate([p.ints for p in parts]),
                  np.concatenate([p.scale for p in parts]),
                  np.concatenate(offs) if has_off else None)
