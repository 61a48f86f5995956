"""Target distribution warping and exponential-race sampling."""
import numpy as np

from backend.config import SamplingParams
from backend.sampling import sample, target_probs


def test_greedy_is_one_hot_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    np.testing.assert_array_equal(target_probs(logits, SamplingParams()), [0, 1, 0, 0])


def test_temperature_top_k_top_p_min_p():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    p = target_probs(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(p, [0.4, 0.3, 0.2, 0.1], rtol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.4 / 0.7, 0.3 / 0.7, 0, 0], rtol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(p, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0], rtol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.6))
    np.testing.assert_allclose(p, [0.4 / 0.7, 0.3 / 0.7, 0, 0], rtol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=0.5))
    q = np.array([0.4, 0.3, 0.2, 0.1]) ** 2
    np.testing.assert_allclose(p, q / q.sum(), rtol=1e-6)


def test_top_p_partial_sort_equals_full_sort():
    rng = np.random.default_rng(0)
    for scale in (0.5, 3.0, 10.0):
        logits = (rng.standard_normal(50000) * scale).astype(np.float32)
        for top_p in (0.5, 0.9, 0.99):
            p = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
            z = logits.astype(np.float64)
            order = np.argsort(-z, kind="stable")
            full = np.exp(z - z.max())
            cum = np.cumsum(full[order]) / full.sum()
            keep = order[: int(np.searchsorted(cum, top_p)) + 1]
            assert set(np.flatnonzero(p)) == set(keep.tolist())


def test_exponential_race_frequencies():
    rng = np.random.default_rng(1)
    p = np.array([0.5, 0.25, 0.125, 0.125])
    counts = np.bincount([sample(p, rng.standard_exponential(4)) for _ in range(40000)], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), p, atol=0.01)
    assert sample(np.array([0.0, 1.0, 0.0]), np.ones(3)) == 1


def test_cut_offs_keep_every_token_tied_at_the_boundary():
    """Thresholds on the value (as a GPU kernel finds them, by search, and as vLLM masks)."""
    logits = np.log(np.array([0.3, 0.2, 0.2, 0.2, 0.1], np.float32))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.3 / 0.9, 0.2 / 0.9, 0.2 / 0.9, 0.2 / 0.9, 0], rtol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.45))
    np.testing.assert_allclose(p, [0.3 / 0.9, 0.2 / 0.9, 0.2 / 0.9, 0.2 / 0.9, 0], rtol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.25))
    np.testing.assert_allclose(p, [1, 0, 0, 0, 0], rtol=1e-6)
