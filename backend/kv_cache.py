"""KV-cache bookkeeping for a batch of sequences that share one set of KV arrays.

The storage (per layer [B, Hkv, L, D] arrays) belongs to the runtime; this module only knows
which of the L columns of each row hold committed tokens. A forward over T new tokens appends T
columns to every row; `commit` then marks the accepted tree nodes of a row valid and leaves the
rest as garbage that the attention bias masks out. Garbage is squeezed out by `compaction_plan`
when it grows (the runtime copies the columns), and when the batch's membership changes.

Columns of a row stay in token order (tree nodes are topologically ordered and an accepted path
is increasing), which is what keeps attention results independent of where the columns sit
(graph.py). Rotary positions are independent of columns: prefix length + tree depth.
Knows: columns, lengths, masks. Does not know: tensors, models, tokens.
"""
from __future__ import annotations

import numpy as np

from backend.tree import MASK_VALUE

PAD_PARENT = -2   # a padding node in a ragged batch: attends to itself only, never committed


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """[T] depths for a parents row where -1 = child of the prefix and -2 = padding (depth 0)."""
    d = np.zeros(parents.size, np.int64)
    for i, p in enumerate(parents):
        if p >= 0:
            d[i] = d[p] + 1
    return d


def tree_visibility(parents: np.ndarray) -> np.ndarray:
    """[T, T] bool: node i sees node j (j is i or an ancestor of i). Padding sees itself."""
    n = parents.size
    m = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]
    return m


class KVLayout:
    """Column bookkeeping of one batch group."""

    def __init__(self, num_rows: int, lengths: np.ndarray | None = None):
        self.lengths = np.zeros(num_rows, np.int64) if lengths is None else lengths.astype(np.int64)
        self.num_cols = int(self.lengths.max()) if num_rows and lengths is not None else 0
        # [B, L] bool; committed columns are left-aligned right after a compaction/merge
        self.valid = np.arange(self.num_cols)[None, :] < self.lengths[:, None]
        self.pending_start = -1    # first column of the last forward's new tokens

    @property
    def num_rows(self) -> int:
        return int(self.lengths.size)

    def forward_inputs(self, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """parents [B, T] -> (attn_bias [B, T, L + T] float32, position_ids [B, T] int64)."""
        b, t = parents.shape
        assert b == self.num_rows, (b, self.num_rows)
        bias = np.empty((b, t, self.num_cols + t), np.float32)
        positions = np.empty((b, t), np.int64)
        for r in range(b):
            pr = parents[r]
            bias[r, :, : self.num_cols] = np.where(self.valid[r], np.float32(0), MASK_VALUE)
            bias[r, pr == PAD_PARENT, : self.num_cols] = MASK_VALUE
            bias[r, :, self.num_cols:] = np.where(tree_visibility(pr), np.float32(0), MASK_VALUE)
            positions[r] = self.lengths[r] + tree_depths(pr)
        return bias, positions

    def append(self, t: int) -> None:
        """A forward wrote t new columns to every row (not yet committed)."""
        self.pending_start = self.num_cols
        self.valid = np.concatenate([self.valid, np.zeros((self.num_rows, t), bool)], axis=1)
        self.num_cols += t

    def commit(self, row: int, nodes: np.ndarray) -> None:
        """Keep the new-token nodes `nodes` (increasing indices into the last forward) of a row."""
        assert self.pending_start >= 0, "commit without a forward"
        nodes = np.asarray(nodes, np.int64)
        if nodes.size:
            assert np.all(np.diff(nodes) > 0), f"accepted nodes must increase: {nodes.tolist()}"
            cols = self.pending_start + nodes
            assert cols[-1] < self.num_cols, (cols.tolist(), self.num_cols)
            self.valid[row, cols] = True
        self.lengths[row] += nodes.size

    def truncate(self, row: int, length: int) -> None:
        """Forget committed columns of a row beyond its first `length` (a draft model rolling
        back its own rejected tokens)."""
        cols = self.columns(row)
        assert 0 <= length <= cols.size, (length, cols.size)
        self.valid[row, cols[length:]] = False
        self.lengths[row] = length

    def garbage(self) -> int:
        """Columns every row pays attention for but that hold no committed token (worst row)."""
        return self.num_cols - int(self.lengths.min()) if self.num_rows else 0

    def needs_compaction(self) -> bool:
        g = self.num_cols - int(self.lengths.max())
        return g > 32 + self.num_cols // 8

    def columns(self, row: int) -> np.ndarray:
        """Committed columns of a row, in token order."""
        return np.flatnonzero(self.valid[row])

    def compacted(self, rows: list[int] | None = None) -> "KVLayout":
        rows = list(range(self.num_rows)) if rows is None else rows
        return KVLayout(len(rows), self.lengths[rows].copy())
