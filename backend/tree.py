"""TokenTree: the shape of a speculation step, as a parents array.

Node 0 is the root: the last committed token, whose logits the target has not produced yet (it is
fed to the target together with the drafted nodes). Every other node is a drafted token.
`parents[0] == -1` and `parents[i] < i` (topological order), as in EAGLE's tree buffers
(Li et al. 2024, arXiv:2401.15077). Everything else is derived:

    depth[i]            distance from the root; rotary position = prefix length + depth
    ancestor_mask[i,j]  j is i or an ancestor of i (row-OR over parents)
    paths               root-to-leaf node lists padded with -1 (Medusa/EAGLE "retrieve indices")
    attn_bias           0 where attended, MASK where not: the tree-attention mask

A chain of k drafted tokens is `TokenTree.chain(k)` (k + 1 nodes); static trees come from the
Medusa/vLLM path-list format with `from_choices`; dynamic EAGLE-2 trees use `from_parents`.
Knows: tree structure only. Does not know: tokens, probabilities or models.
"""
from __future__ import annotations

from functools import cached_property

import numpy as np

MASK_VALUE = np.float32(-1e30)


class TokenTree:
    __slots__ = ("parents", "__dict__")

    def __init__(self, parents):
        p = np.asarray(parents, dtype=np.int32).reshape(-1)   # [num_nodes] int32
        assert p.size >= 1 and p[0] == -1, f"parents[0] must be -1, got {p[:1]}"
        assert np.all(p[1:] >= 0) and np.all(p[1:] < np.arange(1, p.size)), \
            f"parents must satisfy 0 <= parents[i] < i, got {p.tolist()}"
        self.parents = p

    # --- constructors -------------------------------------------------------------------------
    @classmethod
    def chain(cls, k: int) -> "TokenTree":
        """Root plus a chain of k drafted tokens (Leviathan et al. 2023)."""
        return cls(np.arange(-1, k, dtype=np.int32))

    @classmethod
    def from_parents(cls, parents) -> "TokenTree":
        return cls(parents)

    @classmethod
    def from_choices(cls, choices) -> "TokenTree":
        """Medusa/vLLM format: each path is a list of child ranks from the root, e.g.
        [[0], [1], [0, 0], [0, 1]] = two children of the root, two under the first one.
        Every prefix of a path must itself be listed (or be the root)."""
        paths = sorted((tuple(int(c) for c in path) for path in choices), key=lambda p: (len(p), p))
        index = {(): 0}
        parents = [-1]
        for path in paths:
            if path in index:
                raise ValueError(f"duplicate path {list(path)} in tree choices")
            if path[:-1] not in index:
                raise ValueError(f"path {list(path)} listed before its prefix {list(path[:-1])}")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
        return cls(parents)

    # --- derived ------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return int(self.parents.size)

    @property
    def num_draft_tokens(self) -> int:
        return self.num_nodes - 1

    @cached_property
    def depth(self) -> np.ndarray:                # [num_nodes] int32
        d = np.zeros(self.num_nodes, np.int32)
        for i in range(1, self.num_nodes):
            d[i] = d[self.parents[i]] + 1
        return d

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @cached_property
    def ancestor_mask(self) -> np.ndarray:        # [num_nodes, num_nodes] bool, self included
        n = self.num_nodes
        m = np.eye(n, dtype=bool)
        for i in range(1, n):
            m[i] |= m[self.parents[i]]
        return m

    @cached_property
    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            ch[self.parents[i]].append(i)
        return ch

    @cached_property
    def is_chain(self) -> bool:
        return bool(np.all(self.parents == np.arange(-1, self.num_nodes - 1)))

    @cached_property
    def paths(self) -> np.ndarray:                # [num_leaves, max_depth + 1] int32, -1 padded
        leaves = [i for i in range(self.num_nodes) if not self.children[i]]
        out = np.full((len(leaves), self.max_depth + 1), -1, np.int32)
        for r, leaf in enumerate(leaves):
            path = np.flatnonzero(self.ancestor_mask[leaf])   # ancestors sorted == root-to-leaf
            out[r, : path.size] = path
        return out

    def attn_bias(self) -> np.ndarray:           # [num_nodes, num_nodes] float32
        return np.where(self.ancestor_mask, np.float32(0), MASK_VALUE).astype(np.float32)

    def path_to(self, node: int) -> np.ndarray:   # [depth(node) + 1] int32, root first
        return np.flatnonzero(self.ancestor_mask[node]).astype(np.int32)

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenTree) and np.array_equal(self.parents, other.parents)

    def __hash__(self) -> int:
        return hash(self.parents.tobytes())

    def __repr__(self) -> str:
        return f"TokenTree(parents={self.parents.tolist()})"
