"""The native CPU engine (WeightFormat.GGUF): a checkpoint's weights in the blocked layout that
plugins/native/kernels.h reads, in one file.

GGUF blocks are kept as they are: Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K bit for bit (their
f16 scales, offsets and packed sub-block scales too), Q4_0 as Q4_1 with m = -8d (exact in f16).
So a decode step reads the same bytes per token as llama.cpp on the same file. Float tensors
are quantized to Q8_0 blocks (round to nearest, scale amax/127 in f16, as llama.cpp's
quantize). The only change is the order: 16 output rows are interleaved per block (kernels.h
explains the layouts, blocks.py writes them). Parts of one fused matrix (q, k, v; gate,
up) of different kinds stay apart, each in its own blocks (forward.c runs them side by side).

File: 8 bytes little-endian header length, a JSON header (model numbers and, per tensor, its
offset, byte size and kind), then the tensors, each 64-byte aligned.
Knows: GGUF block layouts, the kernel's layout (kernels.h). Does not know: the kernel, the runtime.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backend.buildlib.checkpoint import Checkpoint
from backend.devices.native.blocks import kind_of, layout, matrix as _matrix
from backend.engine_format import (ALIGN, KINDS, LANES, QBLOCK, blocked, f16_bits, q8_blocks,  # noqa: F401 (re-exported)
                                   read_native, repack)
from backend.manifest import NORMS, EngineFile, WeightFormat


def _blocks(parts) -> tuple:
    """A matrix of the parts, repacked only when written (one matrix's blocks in memory at a
    time: an 8B file's are 4.9-8.5 GB) -> kind, data shape, rows (padded), cols, make."""
    kind, shape = layout(parts)
    return kind, shape, shape[0] * LANES, parts[0].shape[1], lambda: _matrix(parts)[1]


def _f32(a) -> tuple:
    arr = np.ascontiguousarray(a, np.float32)
    return "f32", arr.shape, 0, 0, lambda: arr


def _fused_or_apart(prefix: str, names: tuple[str, ...], parts) -> dict:
    """One matrix of the parts (`prefix.qkv`, `prefix.gate_up`) when they share a block kind, else
    each apart (`prefix.q`, ...), so every part keeps its file's own blocks (a Q4_K_M file mixes
    Q5_0 q/k with a Q8_0 v); forward.c runs the parts side by side."""
    fused = "qkv" if names[0] == "q" else "gate_up"
    if len({kind_of(p) for p in parts}) == 1:
        return {f"{prefix}.{fused}": _blocks(parts)}
    return {f"{prefix}.{n}": _blocks([p]) for n, p in zip(names, parts)}


def export_native(ck: Checkpoint, num_layers: int, max_seq: int, path: Path) -> EngineFile:
    from backend.engine_format import rope_tables

    cfg = ck.config
    tensors: dict[str, tuple] = {}         # name -> kind, shape, rows, cols, make (the data)
    f32 = _f32
    cos, sin = rope_tables(cfg, max_seq)
    tensors["rope_cos"], tensors["rope_sin"] = f32(cos), f32(sin)
    if any(cfg.local_rope(i) for i in range(num_layers)):      # the sliding layers' own base
        cos, sin = rope_tables(cfg, max_seq, local=True)
        tensors["rope_local_cos"], tensors["rope_local_sin"] = f32(cos), f32(sin)
    if "norm" in ck.tensors:                  # an EAGLE-1/2 head has none
        tensors["norm"] = f32(ck.tensor("norm").float32())
    tensors["embed"] = _blocks([ck.tensor("embed")])
    if "fc" in ck.tensors:                    # an EAGLE head: x = fc([embedding, feature]) + bias
        tensors["fc"] = _blocks([ck.tensor("fc")])
        tensors["fc_bias"] = f32(ck.tensor("fc_bias").float32())
    if "lm_head" in ck.tensors:
        tensors["lm_head"] = _blocks([ck.tensor("lm_head")])
    for i in range(num_layers):
        t = lambda n: ck.tensor(f"layers.{i}.{n}")
        for name in NORMS:                          # every norm a layer program may name, where it has it
            if f"layers.{i}.{name}" in ck.tensors:
                tensors[f"layers.{i}.{name}"] = f32(t(name).float32())
        tensors.update(_fused_or_apart(f"layers.{i}", ("q", "k", "v"), [t("q"), t("k"), t("v")]))
        tensors[f"layers.{i}.o"] = _blocks([t("o")])
        tensors.update(_fused_or_apart(f"layers.{i}", ("gate", "up"), [t("gate"), t("up")]))
        tensors[f"layers.{i}.down"] = _blocks([t("down")])
        if cfg.attention_bias and f"layers.{i}.q_bias" in ck.tensors:
            tensors[f"layers.{i}.qkv_bias"] = f32(np.concatenate(
                [t("q_bias").float32(), t("k_bias").float32(), t("v_bias").float32()]))
    index, offset = {}, 0
    for name, (kind, shape, rows, cols, _) in tensors.items():
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = int(np.prod(shape, dtype=np.int64)) * (4 if kind == "f32" else 1)
        index[name] = {"kind": kind, "offset": offset, "nbytes": nbytes, "rows": rows, "cols": cols,
                       "shape": list(shape)}
        offset += nbytes
    header = json.dumps({"num_layers": num_layers, "max_positions": max_seq, "tensors": index}).encode()
    start = -(-(8 + len(header)) // ALIGN) * ALIGN
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name, (_, shape, _, _, make) in tensors.items():
            arr = make()
            assert arr.shape == tuple(shape), (name, arr.shape, shape)
            f.seek(start + index[name]["offset"])
            arr.tofile(f)
    gathered = {"rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"} | ({"embed"} if "lm_head" in tensors else set())
    per_token = sum(v["nbytes"] for k, v in index.items() if k not in gathered)
    return EngineFile(path=path.name, weights=WeightFormat.GGUF, num_layers=num_layers,
                      size_bytes=path.stat().st_size, weight_bytes_per_token=per_token)
