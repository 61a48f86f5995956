"""KV-cache bookkeeping for a batch of sequences that share one set of KV arrays.

The storage (per layer [B, Hkv, L, D] arrays) belongs to the runtime; this module only knows
which of the L columns of each row hold committed tokens. A forward over T new tokens appends T
columns to every row; `commit` then marks the accepted tree nodes of a row valid and leaves the
rest as garbage that the attention bias masks out. Garbage is squeezed out (the runtime copies
the committed columns) when it grows, and when the batch's membership changes.

Columns of a row stay in token order (tree nodes are topologically ordered and an accepted path
is increasing), which is what keeps attention results independent of where the columns sit
(graph.py). Rotary positions are independent of columns: prefix length + tree depth.
Knows: columns, lengths, masks. Does not know: tensors, models, tokens.
"""
from __future__ import annotations

import numpy as np

from backend.tree import MASK_VALUE

PAD_PARENT = -2   # a padding node in a ragged batch: attends to itself only, never committed


class KVLayout:
    """Column bookkeeping of one batch group.

    Between commits, the new tokens of one or more forwards form a per-row *scratch tree*:
    node ids count up across forwards, and a forward's `parents` may name any earlier scratch
    node (a drafter growing a tree level by level) or -1 (child of the committed prefix).
    `commit` keeps some scratch nodes (a root-to-node path) and discards the rest.
    """

    def __init__(self, num_rows: int, lengths: np.ndarray | None = None):
        self.lengths = np.zeros(num_rows, np.int64) if lengths is None else lengths.astype(np.int64)
        self.num_cols = int(self.lengths.max()) if num_rows and lengths is not None else 0
        # [B, L] bool; committed columns are left-aligned right after a compaction/merge
        self.valid = np.arange(self.num_cols)[None, :] < self.lengths[:, None]
        self.scratch_cols = [np.zeros(0, np.int64) for _ in range(num_rows)]   # column per node
        self.scratch_anc = [np.zeros((0, 0), bool) for _ in range(num_rows)]   # ancestor-or-self
        self.scratch_depth = [np.zeros(0, np.int64) for _ in range(num_rows)]
        self._next: list | None = None

    @property
    def num_rows(self) -> int:
        return int(self.lengths.size)

    def has_scratch(self) -> bool:
        return any(c.size for c in self.scratch_cols)

    def forward_inputs(self, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """parents [B, T] -> (attn_bias [B, T, L + T] float32, position_ids [B, T] int64)."""
        b, t = parents.shape
        assert b == self.num_rows, (b, self.num_rows)
        L = self.num_cols
        bias = np.full((b, t, L + t), MASK_VALUE, np.float32)
        positions = np.empty((b, t), np.int64)
        nxt = []
        for r in range(b):
            n0 = self.scratch_cols[r].size
            anc = np.zeros((n0 + t, n0 + t), bool)
            anc[:n0, :n0] = self.scratch_anc[r]
            depth = np.concatenate([self.scratch_depth[r], np.zeros(t, np.int64)])
            for j, p in enumerate(parents[r]):
                i = n0 + j
                anc[i, i] = True
                if p >= 0:
                    assert p < i, f"parent {p} of scratch node {i} is not an earlier node"
                    anc[i] |= anc[p]
                    depth[i] = depth[p] + 1
            pad = parents[r] == PAD_PARENT
            past = self.valid[r][None, :].repeat(t, 0)                       # [T, L]
            if n0:
                past[:, self.scratch_cols[r]] = anc[n0:, :n0]
            past[pad] = False
            bias[r, :, :L][past] = 0.0
            bias[r, :, L:][anc[n0:, n0:]] = 0.0
            positions[r] = self.lengths[r] + depth[n0:]
            nxt.append((anc, depth))
        self._next = nxt
        return bias, positions

    def window_bias(self, bias: np.ndarray, positions: np.ndarray, window: int) -> np.ndarray:
        """The sliding layers' attn_bias for the inputs forward_inputs just built: `bias`, and keys
        at positions <= the query's - window masked too (the window counted along each node's own
        path: its committed columns are positions 0.., its path prefix length + depth)."""
        local = bias.copy()
        b, t = positions.shape
        L = self.num_cols
        for r in range(b):
            kpos = np.full(L + t, np.iinfo(np.int64).min // 2, np.int64)     # garbage: masked anyway
            valid = self.valid[r]
            kpos[:L][valid] = np.arange(int(valid.sum()))
            kpos[self.scratch_cols[r]] = self.lengths[r] + self.scratch_depth[r]
            kpos[L:] = positions[r]
            local[r][positions[r][:, None] - kpos[None, :] >= window] = MASK_VALUE
        return local

    def append(self, t: int) -> None:
        """The forward whose inputs were built last wrote t new columns to every row."""
        assert self._next is not None and len(self._next) == self.num_rows
        cols = np.arange(self.num_cols, self.num_cols + t)
        for r, (anc, depth) in enumerate(self._next):
            self.scratch_cols[r] = np.concatenate([self.scratch_cols[r], cols])
            self.scratch_anc[r], self.scratch_depth[r] = anc, depth
        self._next = None
        self.valid = np.concatenate([self.valid, np.zeros((self.num_rows, t), bool)], axis=1)
        self.num_cols += t

    def commit(self, row: int, nodes: np.ndarray) -> None:
        """Keep scratch nodes `nodes` (increasing ids) of a row; drop the rest of its scratch."""
        nodes = np.asarray(nodes, np.int64)
        if nodes.size:
            assert np.all(np.diff(nodes) > 0), f"accepted nodes must increase: {nodes.tolist()}"
            assert nodes[-1] < self.scratch_cols[row].size, (nodes.tolist(), self.scratch_cols[row].size)
            self.valid[row, self.scratch_cols[row][nodes]] = True
        self.lengths[row] += nodes.size
        self.scratch_cols[row] = np.zeros(0, np.int64)
        self.scratch_anc[row] = np.zeros((0, 0), bool)
        self.scratch_depth[row] = np.zeros(0, np.int64)

    def truncate(self, row: int, length: int) -> None:
        """Forget committed columns of a row beyond its first `length` (a draft model rolling
        back its own rejected tokens)."""
        self.commit(row, np.zeros(0, np.int64))
        cols = self.columns(row)
        assert 0 <= length <= cols.size, (length, cols.size)
        self.valid[row, cols[length:]] = False
        self.lengths[row] = length

    def place_row(self, row: int, length: int) -> None:
        """Row `row` (an existing row, or num_rows to add one) now holds a sequence whose
        `length` committed tokens sit in its first columns; the rest of the row is garbage."""
        assert length <= self.num_cols and not self.has_scratch(), (length, self.num_cols)
        mask = np.arange(self.num_cols) < length
        if row == self.num_rows:
            self.lengths = np.append(self.lengths, length)
            self.valid = np.vstack([self.valid, mask[None]])
            self.scratch_cols.append(np.zeros(0, np.int64))
            self.scratch_anc.append(np.zeros((0, 0), bool))
            self.scratch_depth.append(np.zeros(0, np.int64))
        else:
            self.lengths[row] = length
            self.valid[row] = mask

    def needs_compaction(self) -> bool:
        g = self.num_cols - int(self.lengths.max())
        return g > 32 + self.num_cols // 8

    def columns(self, row: int) -> np.ndarray:
        """Committed columns of a row, in token order."""
        return np.flatnonzero(self.valid[row])
