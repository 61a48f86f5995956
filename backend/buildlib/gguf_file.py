"""A GGUF file's metadata and tensors, read in a second where gguf.GGUFReader takes ~25 s: that
reader makes numpy views for every item of every array, and a Llama-3 or Qwen file carries
400,000-500,000 token and merge strings (a Llama-3.2-1B GGUF: 26 s, every build, issue 53).

The format (ggml's docs/gguf.md, version 2 and 3, little-endian): magic "GGUF", version u32,
tensor count u64, key-value count u64; each key a string (u64 length + UTF-8 bytes), its type
u32 and value (an array: element type u32, count u64, elements); each tensor's name, dimension
count u32, dimensions u64 (innermost first), GGML type u32 and offset u64 from the data start,
which is the end of the tensor infos aligned to `general.alignment` (32 by default).

Tensors come back as GGUFReader gives them (checkpoint.py reads either alike): a read-only memory
map, float types as their dtype in logical shape, block types as uint8 [..., rows, bytes per row].
Knows: the container. Does not know: what the keys or tensors mean (checkpoint.py).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
            11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


class GGUFFormatError(ValueError):
    pass


@dataclass
class GGUFTensor:
    name: str
    type_name: str                  # gguf.GGMLQuantizationType's name: "F32", "Q4_K", ...
    dims: tuple[int, ...]           # GGUF order: innermost (ne0) first
    data: np.ndarray                # read-only memory map, as GGUFReader's ReaderTensor.data


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, kind: int):
        if kind not in _SCALARS:
            raise GGUFFormatError(f"{self.path.name}: unknown GGUF value type {kind} at byte {self.pos}")
        v = np.frombuffer(self.buf, _SCALARS[kind], 1, self.pos)[0]
        self.pos += v.nbytes
        return bool(v) if kind == _BOOL else v.item()

    def u32(self) -> int:
        self.pos += 4
        return struct.unpack_from("<I", self.buf, self.pos - 4)[0]

    def u64(self) -> int:
        self.pos += 8
        return struct.unpack_from("<Q", self.buf, self.pos - 8)[0]

    def string(self) -> str:
        n = self.u64()
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", "surrogateescape")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(kind)
        item, count = self.u32(), self.u64()
        if item == _STRING:
            return [self.string() for _ in range(count)]
        if item == _ARRAY or item not in _SCALARS:
            raise GGUFFormatError(f"{self.path.name}: arrays of GGUF type {item} are not supported")
        arr = np.frombuffer(self.buf, _SCALARS[item], count, self.pos)
        self.pos += arr.nbytes
        return [bool(x) for x in arr] if item == _BOOL else arr.tolist()


def read_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """-> the key-value metadata (Python values), the tensors (memory-mapped)."""
    import gguf          # the type table (block sizes), ggml's own

    path = Path(path)
    mm = np.memmap(path, np.uint8, "r")
    cur = _Cursor(memoryview(mm), path)
    if bytes(mm[:4]) != b"GGUF":
        raise GGUFFormatError(f"{path.name}: not a GGUF file (magic {bytes(mm[:4])!r})")
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise GGUFFormatError(f"{path.name}: GGUF version {version} (read: 2 and 3)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.u32())
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.u64() for _ in range(cur.u32()))
        infos.append((name, dims, cur.u32(), cur.u64()))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))
        nbytes = int(np.prod(dims, dtype=np.int64)) // per * size
        raw = mm[start + offset:start + offset + nbytes]
        if qtype.name in _FLOATS:
            data = raw.view(_FLOATS[qtype.name]).reshape(shape)
        else:                                        # blocks: [..., rows, bytes per row]
            data = raw.reshape(shape[:-1] + (shape[-1] // per * size,))
        tensors.append(GGUFTensor(name, qtype.name, dims, data))
    return meta, tensors
