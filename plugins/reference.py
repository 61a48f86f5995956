"""Numpy reference of tree attention: the op contract a GPU kernel is tested against.

q [B, Hq, T, D] (already scaled), k and v [B, Hkv, S, D] (S = past + T, the new tokens last),
bias [B, T, S] additive (0 visible, very negative masked; tree + padding + past validity).
GQA: query head h reads KV head h // (Hq / Hkv). Returns [B, Hq, T, D] in float32, computed in
float64 so it is the exact value the graph's invariant formulation approximates.
"""
from __future__ import annotations

import numpy as np


def tree_attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray) -> np.ndarray:
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    assert hq % hkv == 0 and v.shape == k.shape and bias.shape == (b, t, s), (q.shape, k.shape, bias.shape)
    group = hq // hkv
    kk = np.repeat(k.astype(np.float64), group, axis=1)
    vv = np.repeat(v.astype(np.float64), group, axis=1)
    scores = q.astype(np.float64) @ kk.transpose(0, 1, 3, 2) + bias[:, None].astype(np.float64)
    scores -= scores.max(-1, keepdims=True)
    w = np.exp(scores)
    w /= w.sum(-1, keepdims=True)
    return (w @ vv).astype(np.float32)
