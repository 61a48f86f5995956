"""Build-time measurement of batch invariance: does one T-token verify forward give bitwise the
logits of T single-token steps (chain) and of a path inside a token tree? Recorded in the
manifest; greedy speculation is token-identical to plain decoding exactly when this holds.
"""
from __future__ import annotations

import numpy as np

from backend.manifest import EngineFile, EngineManifest


def measure_invariance(manifest: EngineManifest, ef: EngineFile, prompt_len: int = 250,
                       steps: int = 16, seed: int = 0) -> float:
    """Largest |logit difference| between verify forwards (chain and tree) and single steps.
    The two sequences hold their prompt in different column layouts (one has garbage columns of
    rejected drafts after it) and cross 256 columns, where GEMM kernels block their sums."""
    from backend.devices import load_runtime

    rt = load_runtime(manifest, ef.weights)
    rng = np.random.default_rng(seed)
    prompt_len = min(prompt_len, manifest.max_seq_len - steps - 1)    # tiny test engines are short
    v = manifest.model.vocab_size
    prompt = rng.integers(3, v, prompt_len)
    tokens = rng.integers(3, v, steps)
    chain = lambda n: np.arange(-1, n - 1, dtype=np.int32)[None]
    try:
        rt.alloc(0)
        rt.forward([0], prompt[None, :-1], chain(prompt_len - 1), np.array([[prompt_len - 2]]))
        rt.commit([0], [np.arange(prompt_len - 1)])
        junk = rng.integers(3, v, 3)             # a rejected 3-token draft leaves garbage columns
        rt.forward([0], np.concatenate([prompt[-1:], junk])[None], chain(4), np.zeros((1, 1), np.int64))
        rt.commit([0], [np.array([0])])
        single = []
        for tok in tokens:
            out = rt.forward([0], np.array([[tok]]), chain(1), np.zeros((1, 1), np.int64))
            single.append(out.logits[0, 0].copy())
            rt.commit([0], [np.array([0])])
        rt.alloc(1)
        rt.forward([1], prompt[None], chain(prompt_len), np.array([[prompt_len - 1]]))
        rt.commit([1], [np.arange(prompt_len)])
        half = steps // 2
        out = rt.forward([1], tokens[None, :half], chain(half), np.arange(half)[None])
        diff = float(np.abs(out.logits[0] - np.stack(single[:half])).max())
        rt.commit([1], [np.arange(half)])
        # tree: the true continuation interleaved with random siblings
        rest = tokens[half:]
        ids, parents, path = [rest[0]], [-1], [0]
        for tok in rest[1:]:
            ids.append(int(rng.integers(3, v)))
            parents.append(path[-1])
            ids.append(tok)
            parents.append(path[-1])
            path.append(len(ids) - 1)
        n = len(ids)
        out = rt.forward([1], np.array([ids]), np.array([parents], np.int32), np.arange(n)[None])
        diff = max(diff, float(np.abs(out.logits[0, path] - np.stack(single[half:])).max()))
        return diff
    finally:
        rt.close()
