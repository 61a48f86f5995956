"""Target distribution and categorical sampling, shared by plain and speculative decoding.

`target_probs` applies temperature, then top-k, then top-p, then min-p (the order of transformers'
logits warpers and vLLM's sampler) to one row of logits. Cut-offs are thresholds on the logit
value: top-k keeps every token tied with the k-th best, top-p every token tied with the one at
which the best-first cumulative probability reaches p (vLLM's masks keep ties the same way), so a
GPU kernel finds the same set by a search over values, with no sort. Plain decoding samples from exactly this
distribution; speculative verification (verify.py) preserves exactly this distribution.

Sampling is an exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. per token picks token x
with probability p(x) (gpt-fast `multinomial_sample_one_no_sync`, vLLM).

The noise is keyed to the sequence position (`PositionNoise`): E_i, the noise of the token at
position i of the sequence (prompt tokens counted), is a pure function of (seed, i), never of how
many draws a step made. Plain decoding emits argmax(p_i / E_i) at position i, and so does
speculative verification whatever was drafted (verify.py), so a seeded request gives the same
text alone or in a batch, with any drafter and any draft budget; and a request continued from
its prompt and the output it had so far (a migrated request: docs/scale-out.md) draws the same
noise as the uninterrupted one. E_i comes from Philox4x32-10 (Salmon et al., SC'11; the generator
of cuRAND and of Triton's `tl.randint4x`), keyed by the 64-bit seed with counter
(token // 4, i, 0, 0), so a GPU kernel can make the same noise on the device from two integers.
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
        kth = np.partition(z, v - params.top_k)[v - params.top_k]        # the k-th best value
        keep = _best_first(z, np.flatnonzero(z >= kth))
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
    """The tokens (of `keep`, best first, or of all) whose value is at least that of the token
    at which the best-first cumulative probability reaches top_p."""
    full = np.exp(z - z.max())
    if keep is not None:
        cum = np.cumsum(full[keep]) / full[keep].sum()
        last = z[keep[min(int(np.searchsorted(cum, top_p)), keep.size - 1)]]
        return keep[z[keep] >= last]
    total = full.sum()
    for n in _PARTIAL:   # the nucleus is usually small: avoid sorting the whole vocabulary
        if n >= z.size:
            break
        cand = _best_first(z, np.argpartition(-z, n - 1)[:n])
        cum = np.cumsum(full[cand]) / total
        if cum[-1] >= top_p:
            return np.flatnonzero(z >= z[cand[int(np.searchsorted(cum, top_p))]])
    order = _best_first(z, np.arange(z.size))
    cum = np.cumsum(full[order]) / total
    return np.flatnonzero(z >= z[order[min(int(np.searchsorted(cum, top_p)), z.size - 1)]])


def sample(p: np.ndarray, exp_noise: np.ndarray) -> int:
    """Exponential race: token x with probability p[x]. exp_noise: [V] Exp(1) draws."""
    return int(np.argmax(p / exp_noise))


def target_token(logits: np.ndarray, params: SamplingParams, exp_noise: np.ndarray | None) -> int:
    """The target's token after one row of logits: its argmax (greedy), or its sample with the
    position's noise. Plain decoding and verification both emit exactly this."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(target_probs(logits, params), exp_noise)


PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))     # round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)                           # key increments (Weyl)
PHILOX_ROUNDS = 10


def philox4x32(key: int, x0: np.ndarray, x1, x2=0, x3=0) -> np.ndarray:
    """Philox4x32-10 of the counters (x0, x1, x2, x3) under the 64-bit key (key low word first,
    as Triton splits its seed); all broadcast together -> [..., 4] uint32 words (Random123's
    known answers hold: tests/test_verify_distribution.py)."""
    m32, s32 = np.uint64(0xFFFFFFFF), np.uint64(32)
    key = np.asarray(key, np.uint64)
    x0, x1, x2, x3 = np.broadcast_arrays(*(np.asarray(x, np.uint64) & m32 for x in (x0, x1, x2, x3)), key)[:4]
    k0, k1 = key & m32, key >> s32
    wa, wb = np.uint64(PHILOX_W[0]), np.uint64(PHILOX_W[1])
    for _ in range(PHILOX_ROUNDS):
        p0, p2 = PHILOX_M[0] * x0, PHILOX_M[1] * x2
        x0, x1, x2, x3 = ((p2 >> s32) ^ x1 ^ k0), p2 & m32, ((p0 >> s32) ^ x3 ^ k1), p0 & m32
        k0, k1 = (k0 + wa) & m32, (k1 + wb) & m32
    return np.stack([x0, x1, x2, x3], -1).astype(np.uint32)


def exponentials(seed: int, position: int, vocab: int) -> np.ndarray:
    """[vocab] float64 Exp(1) noise of output position `position`: -log((u + 0.5) / 2^32) of the
    Philox words, token t taking word t % 4 of counter block t // 4."""
    words = philox4x32(seed, np.arange((vocab + 3) // 4), position).reshape(-1)[:vocab]
    return -np.log((words.astype(np.float64) + 0.5) * 2.0 ** -32)


class PositionNoise:
    """A request's noise, E_i = exponentials(seed, i), with the few latest positions cached (a
    draft model and the verification of the same step read the same positions)."""

    KEEP = 24

    def __init__(self, seed: int, vocab: int):
        assert 0 <= seed < 2 ** 64, seed
        self.seed, self.vocab = seed, vocab
        self._cache: dict[int, np.ndarray] = {}

    def at(self, position: int) -> np.ndarray:
        e = self._cache.get(position)
        if e is None:
            e = self._cache[position] = exponentials(self.seed, position, self.vocab)
            if len(self._cache) > self.KEEP:
                del self._cache[min(self._cache)]
        return e
