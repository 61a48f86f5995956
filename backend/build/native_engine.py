"""The native CPU engine (WeightFormat.GGUF): a checkpoint's weights in the blocked layout that
plugins/native/kernels.h reads, in one file.

GGUF blocks are kept as they are: Q4_1 and Q8_0 bit for bit (their f16 scales and offsets too),
Q4_0 as Q4_1 with m = -8d (exact in f16). So a decode step reads the same bytes per token as
llama.cpp on the same file. Other tensors (float checkpoints, K-quants) are dequantized and
quantized to Q8_0 blocks (round to nearest, scale amax/127 in f16, as llama.cpp's quantize).
The only change is the order: 16 output rows are interleaved per block (kernels.h explains why).

File: 8 bytes little-endian header length, a JSON header (model numbers and, per tensor, its
offset, byte size and kind), then the tensors, each 64-byte aligned.
Knows: GGUF block layouts, the kernel's layout (kernels.h). Does not know: the kernel, the runtime.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backend.build.checkpoint import Checkpoint, SourceTensor
from backend.engine_format import (ALIGN, KINDS, LANES, QBLOCK, blocked, f16_bits, q8_blocks,  # noqa: F401 (re-exported)
                                   read_native, repack)
from backend.manifest import EngineFile, WeightFormat

def _source_blocks(t: SourceTensor) -> tuple[str, np.ndarray, np.ndarray | None, np.ndarray]:
    """-> kind, d [N, nb] f16 bits, m [N, nb] f16 bits (q4) or None, ints [N, K] (q4: u in
    [0, 16), element order; q8: int8)."""
    n = t.shape[0]
    if t.qtype in ("Q4_1", "Q4_0", "Q8_0"):
        nbytes = {"Q4_1": 20, "Q4_0": 18, "Q8_0": 34}[t.qtype]
        blk = np.ascontiguousarray(t.rows(), np.uint8).reshape(n, -1, nbytes)
        d = np.ascontiguousarray(blk[:, :, 0:2]).view(np.uint16)[..., 0]
        if t.qtype == "Q8_0":
            return "q8", d, None, np.ascontiguousarray(blk[:, :, 2:34]).view(np.int8).reshape(n, -1)
        if t.qtype == "Q4_1":
            m, qs = np.ascontiguousarray(blk[:, :, 2:4]).view(np.uint16)[..., 0], blk[:, :, 4:20]
        else:                                   # Q4_0: w = d (u - 8) = d u + (-8 d), exact in f16
            m, qs = f16_bits(d.view(np.float16) * np.float16(-8.0)), blk[:, :, 2:18]
        u = np.concatenate([qs & 15, qs >> 4], axis=-1)        # element j and j+16 share byte j
        return "q4", d, m, u.reshape(n, -1)
    d, ints = q8_blocks(t.float32())
    return "q8", d, None, ints


def _matrix(parts: list[SourceTensor]) -> tuple[str, np.ndarray, int, int]:
    """Row-concatenated source tensors as one blocked matrix -> kind, data, rows (padded), cols.
    Mixed kinds (a Q8_0 part beside Q4_1 parts) all become Q8_0 (exact for the Q8_0 parts)."""
    src = [_source_blocks(p) for p in parts]
    if len({s[0] for s in src}) > 1:
        src = [_source_blocks(SourceTensor(p.name, "F32", p.shape, p.float32())) if s[0] != "q8" else s
               for p, s in zip(parts, src)]
    kind = src[0][0]
    d = np.concatenate([s[1] for s in src])
    m = None if kind == "q8" else np.concatenate([s[2] for s in src])
    ints = np.concatenate([s[3] for s in src])
    data = repack(kind, d, m, ints)
    return kind, data, data.shape[0] * LANES, ints.shape[1]


def export_native(ck: Checkpoint, num_layers: int, max_seq: int, path: Path) -> EngineFile:
    from backend.build.graph import rope_tables

    cfg = ck.config
    tensors: dict[str, tuple[str, np.ndarray, int, int]] = {}
    f32 = lambda a: ("f32", np.ascontiguousarray(a, np.float32), 0, 0)
    cos, sin = rope_tables(cfg, max_seq)
    tensors["rope_cos"], tensors["rope_sin"] = f32(cos), f32(sin)
    if "norm" in ck.tensors:                  # an EAGLE-1/2 head has none
        tensors["norm"] = f32(ck.tensor("norm").float32())
    tensors["embed"] = _matrix([ck.tensor("embed")])
    if "fc" in ck.tensors:                    # an EAGLE head: x = fc([embedding, feature]) + bias
        tensors["fc"] = _matrix([ck.tensor("fc")])
        tensors["fc_bias"] = f32(ck.tensor("fc_bias").float32())
    if "lm_head" in ck.tensors:
        tensors["lm_head"] = _matrix([ck.tensor("lm_head")])
    for i in range(num_layers):
        t = lambda n: ck.tensor(f"layers.{i}.{n}")
        if f"layers.{i}.attn_norm" in ck.tensors:
            tensors[f"layers.{i}.attn_norm"] = f32(t("attn_norm").float32())
        if f"layers.{i}.hidden_norm" in ck.tensors:          # an EAGLE-3 head's feature norm
            tensors[f"layers.{i}.hidden_norm"] = f32(t("hidden_norm").float32())
        tensors[f"layers.{i}.mlp_norm"] = f32(t("mlp_norm").float32())
        tensors[f"layers.{i}.qkv"] = _matrix([t("q"), t("k"), t("v")])
        tensors[f"layers.{i}.o"] = _matrix([t("o")])
        tensors[f"layers.{i}.gate_up"] = _matrix([t("gate"), t("up")])
        tensors[f"layers.{i}.down"] = _matrix([t("down")])
        if cfg.attention_bias and f"layers.{i}.q_bias" in ck.tensors:
            tensors[f"layers.{i}.qkv_bias"] = f32(np.concatenate(
                [t("q_bias").float32(), t("k_bias").float32(), t("v_bias").float32()]))
    index, offset = {}, 0
    for name, (kind, arr, rows, cols) in tensors.items():
        offset = -(-offset // ALIGN) * ALIGN
        index[name] = {"kind": kind, "offset": offset, "nbytes": int(arr.nbytes), "rows": rows,
                       "cols": cols, "shape": list(arr.shape)}
        offset += arr.nbytes
    header = json.dumps({"num_layers": num_layers, "max_positions": max_seq, "tensors": index}).encode()
    start = -(-(8 + len(header)) // ALIGN) * ALIGN
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name, (_, arr, _, _) in tensors.items():
            f.seek(start + index[name]["offset"])
            f.write(arr.tobytes())
    gathered = {"rope_cos", "rope_sin"} | ({"embed"} if "lm_head" in tensors else set())
    per_token = sum(v["nbytes"] for k, v in index.items() if k not in gathered)
    return EngineFile(path=path.name, weights=WeightFormat.GGUF, num_layers=num_layers,
                      size_bytes=path.stat().st_size, weight_bytes_per_token=per_token)
