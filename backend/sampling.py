"""Target distribution and categorical sampling, shared by plain and speculative decoding.

`target_probs` applies temperature, then top-k, then top-p, then min-p (the order of transformers'
logits warpers and vLLM's sampler) to one row of logits. Plain decoding samples from exactly this
distribution; speculative verification (verify.py) preserves exactly this distribution.

Sampling is an exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. per token picks token x
with probability p(x) (gpt-fast `multinomial_sample_one_no_sync`, vLLM). The noise E is drawn by
the caller from the request's own generator, so the same noise gives the same token.
Knows: numpy math on one row of logits. Does not know: trees, drafts, models.
"""
from __future__ import annotations

import numpy as np

from backend.config import SamplingParams

_PARTIAL = (64, 512, 4096)    # candidate counts tried before a full sort for top-p


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[V] float32 logits -> [V] float64 probabilities of the warped target distribution."""
    v = logits.shape[-1]
    if params.greedy:
        p = np.zeros(v, np.float64)
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits.astype(np.float64) / params.temperature
    keep = None                                               # candidate ids, best first
    if 0 < params.top_k < v:
        keep = _best_first(z, np.argpartition(-z, params.top_k - 1)[: params.top_k])
    if params.top_p < 1.0:
        keep = _nucleus(z, keep, params.top_p)
    if keep is not None:
        zk = z[keep]
        pk = np.exp(zk - zk.max())
        pk /= pk.sum()
        p = np.zeros(v, np.float64)
        p[keep] = pk
    else:
        p = np.exp(z - z.max())
        p /= p.sum()
    if params.min_p > 0.0:
        p[p < params.min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def _best_first(z: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids sorted by descending z, ties by token id (a deterministic order)."""
    return ids[np.lexsort((ids, -z[ids]))]


def _nucleus(z: np.ndarray, keep: np.ndarray | None, top_p: float) -> np.ndarray:
    """Smallest best-first set of tokens whose probability reaches top_p."""
    full = np.exp(z - z.max())
    if keep is not None:
        cum = np.cumsum(full[keep]) / full[keep].sum()
        return keep[: min(int(np.searchsorted(cum, top_p)) + 1, keep.size)]
    total = full.sum()
    for n in _PARTIAL:   # the nucleus is usually small: avoid sorting the whole vocabulary
        if n >= z.size:
            break
        cand = _best_first(z, np.argpartition(-z, n - 1)[:n])
        cum = np.cumsum(full[cand]) / total
        if cum[-1] >= top_p:
            return cand[: int(np.searchsorted(cum, top_p)) + 1]
    order = _best_first(z, np.arange(z.size))
    cum = np.cumsum(full[order]) / total
    return order[: min(int(np.searchsorted(cum, top_p)) + 1, z.size)]


def sample(p: np.ndarray, exp_noise: np.ndarray) -> int:
    """Exponential race: token x with probability p[x]. exp_noise: [V] Exp(1) draws."""
    return int(np.argmax(p / exp_noise))
