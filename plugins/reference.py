"""The GPU ops' contracts and their numpy references (the spec every kernel is tested against).

tree_attention(q, k_cache, v_cache, slots, ctx_len, paths, scale, window=0, softcap=0) -> o
    q        [B, T, Hq, D]   queries of the T new nodes of each row, rotary applied, not scaled
    k_cache  [S, Hkv, L, D]  one layer's keys, one slot per sequence: a row's committed keys at
    v_cache  [S, Hkv, L, D]  columns [0, ctx_len), its scratch nodes' keys right after them
                             (this forward's nodes included: the caller writes them first)
    slots    [B] int32       the slot of each row
    ctx_len  [B] int32       committed columns: visible to every node of the row
    paths    [B, T, P] int32 paths[b, j, i]: scratch index (column ctx_len[b] + index) of node j's
                             ancestor at depth i, node j itself at i = depth(j), then -1. So node
                             j sees node i iff i is j or an ancestor of j. A padding node's path
                             is empty: it sees nothing, and its output is 0
    scale                    q's multiplier in the scores
    window   int             a sliding window (0: none): node j at position p = ctx_len + depth(j)
                             sees only the keys of its own sequence at positions > p - window,
                             counted along its path (committed column c is position c, its
                             ancestor at depth i position ctx_len + i): a node with a path of
                             n entries sees sequence entries >= ctx_len + n - window
    softcap  float           an attention-logit soft-cap (Gemma-2; 0: none): each score (q.k
                             scale) becomes softcap tanh(score / softcap) before the mask
    o        [B, T, Hq, D]   float32. GQA: query head h reads KV head h // (Hq / Hkv).
    Masked: nothing else. Positions (rotary) come from tree depth: ctx_len + depth, applied by
    the caller before the keys are written. The kernel reads each node's keys in the order of
    its own sequence (committed columns, then its path by depth) in blocks aligned at column 0,
    so its sums do not depend on T, on where padding and rejected columns sit, or on which
    physical columns hold the path: one verify of T nodes gives a node the bits that a single
    step along its path gives it.

verify(logits, tokens, parents, temperature, top_k, top_p, min_p, seeds, positions)
        -> (accepted_nodes, output_ids, num_accepted)
    logits       [B, T, V] float32  target logits after each node's path
    tokens       [B, T] int64       tokens[b, 0] is the root (not tested)
    parents      [B, T] int32       -1 for the root, PAD_PARENT (-2) for padding (after the nodes)
    temperature  [B] float64 (0 = greedy), top_k [B] int32 (0 = off), top_p [B] float64,
    min_p [B] float64               the row's SamplingParams
    seeds        [B] uint64, positions [B] int64: the row's noise key and the output position of
                                    depth 0; depth d uses sampling.exponentials(seed, position + d)
    accepted_nodes [B, T] int32 (root first, -1 padded), output_ids [B, T] int64 (accepted draft
    tokens + the final token, -1 padded), num_accepted [B] int32. Equal to backend/verify.py.
"""
from __future__ import annotations

import numpy as np

from backend.config import SamplingParams
from backend.kv_cache import PAD_PARENT
from backend.sampling import PositionNoise
from backend.tree import TokenTree
from backend.verify import pad_verdicts, verify_tree


def tree_attention_ref(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray,
                       ctx_len: np.ndarray, paths: np.ndarray, scale: float, window: int = 0,
                       softcap: float = 0.0) -> np.ndarray:
    """Per row: every node against the committed columns and its scratch ancestors (those within
    `window` positions of it, where a window is given), the scores soft-capped where `softcap`
    is, in float64 (rounded once to float32, so rows are the same whatever else is in the batch)."""
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert hq % hkv == 0 and v_cache.shape == k_cache.shape and paths.shape[:2] == (b, t), \
        (q.shape, k_cache.shape, paths.shape)
    g = hq // hkv
    out = np.zeros((b, t, hq, d), np.float32)
    for r in range(b):
        ctx = int(ctx_len[r])
        nscratch = int(paths[r].max()) + 1 if paths[r].max() >= 0 else 0
        cols = ctx + nscratch
        if cols == 0:                           # a padding row (a CUDA graph's bucket): nothing to see, 0
            continue
        k = k_cache[slots[r], :, :cols].astype(np.float64)                  # [Hkv, cols, D]
        v = v_cache[slots[r], :, :cols].astype(np.float64)
        visible = np.zeros((t, cols), bool)
        visible[:, :ctx] = True
        for j in range(t):
            path = paths[r, j][paths[r, j] >= 0]
            visible[j, ctx + path] = True
            if window > 0:                      # sequence entries below lo are out of the window
                lo = ctx + path.size - window
                visible[j, : min(max(lo, 0), ctx)] = False
                visible[j, ctx + path[: max(lo - ctx, 0)]] = False
        qq = q[r].astype(np.float64).reshape(t, hkv, g, d)
        s = np.einsum("thgd,hcd->thgc", qq, k) * scale
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        s = np.where(visible[:, None, None, :], s, -np.inf)
        w = np.exp(s - np.maximum(s.max(-1, keepdims=True), -1e300))
        w /= np.maximum(w.sum(-1, keepdims=True), 1e-300)          # nothing visible: 0
        out[r] = np.einsum("thgc,hcd->thgd", w, v).reshape(t, hq, d).astype(np.float32)
    return out


def verify_ref(logits: np.ndarray, tokens: np.ndarray, parents: np.ndarray, temperature, top_k,
               top_p, min_p, seeds, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """backend/verify.py per row, in the fixed-shape batch form."""
    b, t, v = logits.shape
    verdicts = []
    for r in range(b):
        n = int(np.sum(parents[r] != PAD_PARENT))
        params = SamplingParams(temperature=float(temperature[r]), top_k=int(top_k[r]),
                                top_p=float(top_p[r]), min_p=float(min_p[r]))
        noise, pos = PositionNoise(int(seeds[r]), v), int(positions[r])
        verdicts.append(verify_tree(TokenTree(parents[r, :n]), np.asarray(tokens[r, :n], np.int64),
                                    logits[r, :n], params, lambda dd: noise.at(pos + dd)))
    out, num, nodes = pad_verdicts(verdicts, t - 1)
    return nodes, out, num


def paths_of(parents: np.ndarray) -> np.ndarray:
    """[B, T] parents (one forward, PAD_PARENT padding: empty) -> [B, T, T] paths (the op's input)."""
    b, t = parents.shape
    out = np.full((b, t, t), -1, np.int32)
    for r in range(b):
        for j in range(t):
            p = int(parents[r, j])
            if p == PAD_PARENT:
                continue
            if p < 0:
                out[r, j, 0] = j
            else:
                depth = int(np.sum(out[r, p] >= 0))
                out[r, j, :depth] = out[r, p, :depth]
                out[r, j, depth] = j
    return out


def write_nodes(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slots, ctx_len,
                n_prior) -> tuple[np.ndarray, np.ndarray]:
    """Copies of the caches with the new nodes' KV [B, T, Hkv, D] at columns ctx + n_prior + j."""
    kc, vc = k_cache.copy(), v_cache.copy()
    t = k.shape[1]
    for r, (s, c, n) in enumerate(zip(slots, ctx_len, n_prior)):
        cols = int(c) + int(n) + np.arange(t)
        keep = cols < kc.shape[2]                  # padding nodes past the end write nothing
        kc[s][:, cols[keep]] = k[r, keep].transpose(1, 0, 2)
        vc[s][:, cols[keep]] = v[r, keep].transpose(1, 0, 2)
    return kc, vc


def quantize_rows_ref(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """x [R, K] float32 -> (q [R, K] int8, d [R, K/block] float32), the kernel's own rounding."""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    return q.reshape(x.shape), (amax / np.float32(127.0)).astype(np.float32)


def wide_rows_ref(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x [R, K] float32 as wide activations see it, in float64: its int8 blocks plus its residual
    (x - d q, in float32 as the kernel computes it) quantized the same way (kernels.h act_q.wide)."""
    x = np.asarray(x, np.float32)
    q, d = quantize_rows_ref(x, block)
    first = (q.reshape(x.shape[0], -1, block).astype(np.float32) * d[..., None]).reshape(x.shape)
    q2, d2 = quantize_rows_ref(x - first, block)
    as64 = lambda q, d: (q.astype(np.float64).reshape(x.shape[0], -1, block) * d.astype(np.float64)[..., None])
    return (as64(q, d) + as64(q2, d2)).reshape(x.shape)


def blocked_matmul_ref(kind: str, d: np.ndarray, m: np.ndarray | None, ints: np.ndarray,
                       x: np.ndarray) -> np.ndarray:
    """y = (x quantized per block) @ w.T in float64 (the contract in the module docstring)."""
    n, k = ints.shape
    q, dx = quantize_rows_ref(x)
    d64 = np.asarray(d, np.float16).astype(np.float64)
    w = ints.astype(np.float64).reshape(n, -1, 32) * d64[..., None]
    if kind == "q4":
        w = w + np.asarray(m, np.float16).astype(np.float64)[..., None]
    xd = q.astype(np.float64).reshape(q.shape[0], -1, 32) * dx.astype(np.float64)[..., None]
    return (xd.reshape(q.shape[0], k) @ w.reshape(n, k).T).astype(np.float32)
