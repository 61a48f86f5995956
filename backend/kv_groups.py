"""KV groups: which sequences share one set of KV arrays, in which rows, and when to copy.

A runtime whose forward reads a batch's past KV as one dense [B, Hkv, L, D] array per layer
(the ONNX graph: its Concat writes past + new columns into a buffer we bind) keeps sequences
that run together in one group. Continuous batching changes the set whenever a request joins or
leaves, and copying the whole group then cost 3-7 decode steps at 16 x 450 tokens (measured
offline), so a group changes in place where it can: a finished sequence leaves an idle row (fed
one padding node, its output dropped; exact because rows never see each other) that the next
joiner takes over, or a row is appended (the past is row-major, so more rows is a longer view of
the same buffer). Only when a joiner is longer than the group, idle rows pass a quarter of it,
or garbage columns need squeezing out are the sequences copied into a new group.

The policy is device independent: the arrays live behind `GroupStorage`, which the runtime
implements. (A runtime with KV preallocated per sequence slot, where the attention kernel reads
each row's own slot, has no groups: joins and leaves cost nothing there.)
Knows: groups, rows, when a copy pays. Does not know: tensors, devices, models.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from backend.kv_cache import PAD_PARENT, KVLayout


class GroupStorage(Protocol):
    """A runtime's KV arrays for one group (every layer's K and V, rows x columns)."""

    def new(self, rows: int, cols: int) -> object:
        """Arrays for a new group, zero filled (masked garbage must be finite: 0 * v == 0)."""

    def add_row(self, kv: object) -> object:
        """The same arrays with one more row; the existing rows keep their content."""

    def copy_row(self, dst: object, row: int, src: object, src_row: int, cols: np.ndarray) -> None:
        """dst[row, :, :n] = src[src_row, :, cols] (n = cols.size) and dst[row, :, n:] = 0."""


class Group:
    """Sequences that share KV arrays, in row order."""

    def __init__(self, seq_ids: list[int], layout: KVLayout, kv: object):
        self.seq_ids = list(seq_ids)
        self.layout = layout
        self.kv = kv
        self.dead: set[int] = set()

    def row(self, seq_id: int) -> int:
        return self.seq_ids.index(seq_id)

    def live_ids(self) -> list[int]:
        return [s for s in self.seq_ids if s not in self.dead]


class KVGroups:
    def __init__(self, storage: GroupStorage):
        self.storage = storage
        self._groups: list[Group] = []
        self._where: dict[int, Group] = {}

    # --- sequences ---------------------------------------------------------------------------
    def alloc(self, seq_id: int) -> None:
        assert seq_id not in self._where, f"sequence {seq_id} already allocated"
        g = Group([seq_id], KVLayout(1), self.storage.new(1, 0))
        self._groups.append(g)
        self._where[seq_id] = g

    def free(self, seq_id: int) -> None:
        g = self._where.pop(seq_id, None)
        if g is None:
            return
        g.dead.add(seq_id)
        if not g.live_ids():
            self._groups.remove(g)

    def length(self, seq_id: int) -> int:
        g = self._where[seq_id]
        return int(g.layout.lengths[g.row(seq_id)])

    def num_sequences(self) -> int:
        return len(self._where)

    def clear(self) -> None:
        self._groups.clear()
        self._where.clear()

    # --- a step ------------------------------------------------------------------------------
    def group_for(self, seq_ids: list[int]) -> tuple[Group, list[int]]:
        """The group to run seq_ids in (the largest group holding any of them, with the others
        moved into its idle rows or appended when that is cheap, else a new group) and their
        rows in it."""
        for s in seq_ids:
            if s not in self._where:
                raise KeyError(f"sequence {s} is not allocated")
        g = max({id(self._where[s]): self._where[s] for s in seq_ids}.values(), key=lambda x: len(x.seq_ids))
        joiners = [s for s in seq_ids if self._where[s] is not g]
        if not joiners:
            idle = len(g.seq_ids) - len(seq_ids)
            if not (g.seq_ids == list(seq_ids) and not g.dead) and \
                    not (idle <= len(g.seq_ids) // 4 or g.layout.has_scratch()):
                g = self._regroup(list(seq_ids))
            return g, [g.row(s) for s in seq_ids]     # else: run the other rows idle
        free_rows = [r for r, sid in enumerate(g.seq_ids) if sid in g.dead]
        rows_after = len(g.seq_ids) + max(0, len(joiners) - len(free_rows))
        cheap = (rows_after - len(seq_ids) <= rows_after // 4
                 and all(self.length(s) <= g.layout.num_cols for s in joiners)
                 and not g.layout.has_scratch()
                 and not any(self._where[s].layout.has_scratch() for s in joiners))
        if not cheap:
            g = self._regroup(list(seq_ids))
            return g, [g.row(s) for s in seq_ids]
        for s in joiners:
            self._move_in(g, s, free_rows.pop(0) if free_rows else len(g.seq_ids))
        return g, [g.row(s) for s in seq_ids]

    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> None:
        """Keep the accepted nodes of each row; idle rows of the group drop their scratch."""
        g = self._where[seq_ids[0]]
        nodes_of = {}
        for sid, nodes in zip(seq_ids, keep):
            assert self._where[sid] is g, "commit must follow a forward over the same sequences"
            nodes_of[sid] = nodes
        empty = np.zeros(0, np.int64)
        for r, sid in enumerate(g.seq_ids):
            g.layout.commit(r, nodes_of.get(sid, empty))
        if g.layout.needs_compaction() or len(g.dead) > len(g.seq_ids) // 4:
            self._regroup(g.live_ids())

    def truncate(self, seq_id: int, length: int) -> None:
        g = self._where[seq_id]
        g.layout.truncate(g.row(seq_id), length)

    # --- copies ------------------------------------------------------------------------------
    def _move_in(self, g: Group, seq_id: int, row: int) -> None:
        """Copy seq_id's committed KV into row `row` of g (an idle row, or a new last row)."""
        src = self._where[seq_id]
        sr = src.row(seq_id)
        cols = src.layout.columns(sr)
        if row == len(g.seq_ids):
            g.kv = self.storage.add_row(g.kv)
            g.seq_ids.append(seq_id)
        else:
            g.dead.discard(g.seq_ids[row])
            g.seq_ids[row] = seq_id
        self.storage.copy_row(g.kv, row, src.kv, sr, cols)
        g.layout.place_row(row, cols.size)
        self._leave(src, seq_id)
        self._where[seq_id] = g

    def _regroup(self, seq_ids: list[int]) -> Group:
        """Copy the committed columns of seq_ids (from wherever they live) into a new group."""
        assert not any(self._where[s].layout.has_scratch() for s in seq_ids), \
            "regrouping sequences with uncommitted tokens"
        layout = KVLayout(len(seq_ids), np.array([self.length(s) for s in seq_ids], np.int64))
        new = Group(seq_ids, layout, self.storage.new(len(seq_ids), layout.num_cols))
        for r, s in enumerate(seq_ids):
            g = self._where[s]
            gr = g.row(s)
            self.storage.copy_row(new.kv, r, g.kv, gr, g.layout.columns(gr))
        for s in seq_ids:
            self._leave(self._where[s], s)
            self._where[s] = new
        self._groups.append(new)
        return new

    def _leave(self, g: Group, seq_id: int) -> None:
        g.dead.add(seq_id)
        if not g.live_ids() and g in self._groups:
            self._groups.remove(g)


def spread_rows(rows: list[int], b: int, input_ids, parents, logits_index, extra):
    """Inputs of len(rows) sequences -> inputs of all b rows of their group; the other rows get
    one padding node each (attends to itself only, never committed)."""
    t = input_ids.shape[1]
    ids = np.zeros((b, t), np.int64)
    par = np.full((b, t), PAD_PARENT, np.int32)
    idx = np.zeros((b, logits_index.shape[1]), np.int64)
    ids[rows], par[rows], idx[rows] = input_ids, parents, logits_index
    ext = None
    if extra:
        ext = {}
        for k, a in extra.items():
            full = np.zeros((b,) + a.shape[1:], a.dtype)
            full[rows] = a
            ext[k] = full
    return ids, par, idx, ext
