"""The prefix cache's storage for the runtimes that keep KV in slots (native, torch, engine):
a pool of block entries beside the slot arrays, and the copies between them.

The same code serves numpy arrays (native, the engine graph on ONNX Runtime) and torch tensors
(the torch runtime, the TensorRT executor), CPU or GPU: it only slices, reshapes and indexes with a
list, which both libraries spell alike. A runtime names its KV arrays
(`parts`: each [..., S + 1, Hkv, L, D] with the slot axis at `axis`) and its SlotTable; each part
gets a pool [..., Hkv, capacity, block, D] in the part's dtype and on its device, allocated once
when the cache is made (numpy's zeros are paged in as blocks are written). A run of consecutive
blocks is a run of a slot's columns, so a save is one indexed copy per part and a load two (the
gather, then the write into the slot).
Knows: slot arrays' layout, the block pool. Does not know: keys, recency (prefix_cache.py).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from backend.kv_slots import SlotTable


def _zeros(like, shape: tuple):
    return like.new_zeros(shape) if hasattr(like, "new_zeros") else np.zeros(shape, like.dtype)


class SlotBlocks:
    """prefix_cache.BlockStorage over a runtime's slot KV arrays."""

    def __init__(self, parts: Callable[[], list], axis: int, table: SlotTable,
                 sync: Callable[[], None] | None = None):
        """parts: the runtime's KV arrays now (read at each copy: a closed runtime has none);
        sync: called after each copy (an executor that runs on a stream of its own)."""
        self.parts, self.axis, self.table, self.sync = parts, axis, table, sync
        self.pools: list = []
        self.block = 0

    def block_bytes(self, block: int) -> int:
        a = self.axis
        return sum(int(p.nbytes) // (p.shape[a] * p.shape[a + 2]) for p in self.parts()) * block

    def allocate(self, capacity: int, block: int) -> None:
        a = self.axis
        self.block = block
        self.pools = [_zeros(p, tuple(p.shape[:a]) + (p.shape[a + 1], capacity, block) + tuple(p.shape[a + 3:]))
                      for p in self.parts()]

    def _pre(self) -> tuple:
        return (slice(None),) * self.axis

    def save(self, seq_id: int, first_block: int, handles: list[int]) -> None:
        n, b, a = len(handles), self.block, self.axis
        c0, c1 = first_block * b, (first_block + n) * b
        assert c1 <= self.table.length(seq_id), (c1, self.table.length(seq_id))
        slot = self.table.slot(seq_id)
        for p, q in zip(self.parts(), self.pools):
            src = p[self._pre() + (slot,)][..., c0:c1, :]                   # [..., Hkv, n * b, D]
            q[self._pre() + (slice(None), list(handles))] = src.reshape(src.shape[:a + 1] + (n, b, src.shape[-1]))
        if self.sync is not None:
            self.sync()

    def load(self, seq_id: int, handles: list[int]) -> None:
        n, b, a = len(handles), self.block, self.axis
        slot = self.table.slot(seq_id)
        for p, q in zip(self.parts(), self.pools):
            blocks = q[self._pre() + (slice(None), list(handles))]            # [..., Hkv, n, b, D]
            p[self._pre() + (slot,)][..., : n * b, :] = blocks.reshape(blocks.shape[:a + 1] + (n * b, blocks.shape[-1]))
        if self.sync is not None:
            self.sync()
        self.table.restore(seq_id, n * b)
