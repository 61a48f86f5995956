"""KV slots: the bookkeeping of a runtime that keeps each sequence's KV in a slot of its own
(the torch runtime; the TensorRT engine graph's KV inputs).

A sequence owns a slot while it lives: its committed tokens at columns [0, length), the nodes of
the forwards since its last commit (scratch) right after them. A forward's parents may name
scratch nodes of earlier forwards (a drafter growing a tree level by level). `layout` turns a
forward into what the attention needs (plugins/reference.py: rotary positions, each node's path
by depth, where each node's KV is written); `commit` keeps an accepted root-to-node path and
says which columns the storage must move down to the committed end; padding nodes read nothing
and write into their own scratch column, or into the spare slot past the end.
A runtime of slots can also keep a prefix cache (prefix_cache.py; its block pool in
runtime/slot_blocks.py): a sequence then starts with the cached blocks of its prompt as committed
columns (`restore`).
Knows: slots, columns, paths. Does not know: tensors, devices.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from backend.kv_cache import PAD_PARENT
from backend.prefix_cache import BLOCK_TOKENS, PrefixCache

SCRATCH_COLUMNS = 96       # columns past max_seq_len: tree nodes of a sequence near the end


@dataclass
class _Seq:
    slot: int
    length: int = 0                                       # committed columns
    paths: list[list[int]] = field(default_factory=list)  # scratch node -> its path (scratch ids)


class SlotSequences(ABC):
    """The Runtime protocol's sequence methods for a runtime whose KV bookkeeping is a
    SlotTable in `self.slots` (the torch and engine runtimes)."""

    slots: "SlotTable"
    prefix_cache: PrefixCache | None = None

    def alloc(self, seq_id: int) -> None:
        self.slots.alloc(seq_id)

    def free(self, seq_id: int) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq_id)
        self.slots.free(seq_id)

    def enable_prefix_cache(self, budget_bytes: int, block: int = BLOCK_TOKENS) -> PrefixCache | None:
        """Keep KV of prompt blocks for later requests, in at most `budget_bytes` (0: none)."""
        self.prefix_cache = PrefixCache(self.block_storage(), budget_bytes, block) if budget_bytes > 0 else None
        return self.prefix_cache

    @abstractmethod
    def block_storage(self):
        """The runtime's prefix_cache.BlockStorage (runtime/slot_blocks.SlotBlocks): each slot
        runtime (native, torch, engine) gives its own; one without cannot be made."""

    def length(self, seq_id: int) -> int:
        return self.slots.length(seq_id)

    def room(self) -> int:
        return self.slots.room()


class SlotTable:
    def __init__(self, capacity: int, columns: int, max_seq_len: int):
        self.capacity, self.columns, self.max_seq_len = capacity, columns, max_seq_len
        self.spare = capacity                  # the slot padding rows write into
        # a stack, lowest slot on top: the most recently freed slot is reused first, so the KV
        # pages a server touches stay those of its peak concurrency (the cache is allocated
        # lazily by the OS; round-robin reuse had touched every slot: +24% resident after warm-up)
        self._free = list(range(capacity - 1, -1, -1))
        self._seqs: dict[int, _Seq] = {}

    def alloc(self, seq_id: int) -> None:
        assert seq_id not in self._seqs, f"sequence {seq_id} already allocated"
        if not self._free:
            raise RuntimeError(f"all {self.capacity} KV slots are taken (RuntimeOptions.max_sequences)")
        self._seqs[seq_id] = _Seq(self._free.pop())

    def free(self, seq_id: int) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is not None:
            self._free.append(s.slot)

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def slot(self, seq_id: int) -> int:
        return self._seqs[seq_id].slot

    def restore(self, seq_id: int, length: int) -> None:
        """A new sequence's first `length` columns were filled from the prefix cache: committed."""
        s = self._seqs[seq_id]
        assert s.length == 0 and not s.paths and 0 <= length < self.max_seq_len, (s.length, length)
        s.length = length

    def room(self) -> int:
        return len(self._free)

    def clear(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))
        self._seqs.clear()

    def layout(self, seq_ids: list[int], parents: np.ndarray) -> tuple[dict, list]:
        """A forward's host arrays: `pos` [B, T] rotary positions, `wslot`/`wcol` [B, T] where
        each node's KV goes, `paths` [B, T, P] what each node reads, `slots`, `ctx`, `n_prior`
        [B]; and the forward's new scratch paths per row (for `extend`)."""
        b, t = parents.shape
        pos = np.zeros((b, t), np.int64)
        wslot = np.zeros((b, t), np.int64)
        wcol = np.zeros((b, t), np.int64)
        new_paths = []
        for r, sid in enumerate(seq_ids):
            s = self._seqs[sid]
            n0 = len(s.paths)
            mine = []
            for j in range(t):
                p = int(parents[r, j])
                assert p < n0 + j, f"parent {p} of scratch node {n0 + j} is not an earlier node"
                path = [] if p == PAD_PARENT else ([n0 + j] if p < 0 else
                                                   (s.paths[p] if p < n0 else mine[p - n0]) + [n0 + j])
                mine.append(path)
                col = s.length + n0 + j
                pos[r, j] = s.length + max(len(path) - 1, 0)
                if path and (col >= self.columns or pos[r, j] >= self.max_seq_len):
                    raise ValueError(f"sequence too long: position {pos[r, j]} (column {col}) >= "
                                     f"max_seq_len {self.max_seq_len}")
                wslot[r, j], wcol[r, j] = (s.slot, col) if col < self.columns else (self.spare, j)
            new_paths.append(mine)
        paths = np.full((b, t, max(1, max(len(p) for m in new_paths for p in m))), -1, np.int32)
        for r, mine in enumerate(new_paths):
            for j, path in enumerate(mine):
                paths[r, j, : len(path)] = path
        rows = [self._seqs[s] for s in seq_ids]
        return {"pos": pos, "wslot": wslot, "wcol": wcol, "paths": paths,
                "ctx": np.array([s.length for s in rows], np.int32),
                "slots": np.array([s.slot for s in rows], np.int32),
                "n_prior": np.array([len(s.paths) for s in rows], np.int32)}, new_paths

    def extend(self, seq_ids: list[int], new_paths: list) -> None:
        """The forward laid out by `layout` ran: its nodes are scratch now."""
        for sid, paths in zip(seq_ids, new_paths):
            self._seqs[sid].paths.extend(paths)

    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keep scratch nodes `keep` (increasing: a root-to-node path) of each row, drop the rest
        -> (slots, from, to) columns the storage must move (only those that are not in place)."""
        moves = [[], [], []]
        for sid, nodes in zip(seq_ids, keep):
            s = self._seqs[sid]
            nodes = np.asarray(nodes, np.int64)
            assert nodes.size == 0 or (np.all(np.diff(nodes) > 0) and nodes[-1] < len(s.paths)), \
                (nodes.tolist(), len(s.paths))
            src, dst = s.length + nodes, s.length + np.arange(nodes.size)
            moved = src != dst
            moves[0].append(np.full(int(moved.sum()), s.slot))
            moves[1].append(src[moved])
            moves[2].append(dst[moved])
            s.length += int(nodes.size)
            s.paths = []
        return tuple(np.concatenate(m).astype(np.int64) if m else np.zeros(0, np.int64) for m in moves)

    def truncate(self, seq_id: int, length: int) -> None:
        s = self._seqs[seq_id]
        assert 0 <= length <= s.length, (length, s.length)
        s.length, s.paths = length, []
