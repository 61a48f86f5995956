"""Rejection sampling keeps the target distribution exactly.

Toy models with small vocabularies (p and q known exactly, depending on the path) are drafted
from and verified 200k times with fixed seeds; the empirical distribution of the first emitted
token and of whole 3-token sequences must match the exact target distribution (total variation
bound), for chains, trees with sibling candidates (with and without replacement), deterministic
top-k trees, temperature/top-k/top-p/min-p, and drafts far from the target. A deliberately
wrong verifier run through the same harness must fail the bound (the test can fail).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from backend.config import SamplingParams
from backend.sampling import target_probs
from backend.tree import TokenTree
from backend.verify import Noise, verify_sampled, verify_tree

N_SAMPLES = 200_000


class ToyModel:
    """Next-token logits as a fixed random function of the whole path (small vocabulary)."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.5, bias: np.ndarray | None = None):
        self.v = vocab
        self.rng = np.random.default_rng(seed)
        self.scale = scale
        self.bias = np.zeros(vocab) if bias is None else bias
        self.cache: dict[tuple, np.ndarray] = {}
        self.probs_cache: dict[tuple, np.ndarray] = {}

    def logits(self, path: tuple) -> np.ndarray:
        if path not in self.cache:
            self.cache[path] = (self.rng.standard_normal(self.v) * self.scale + self.bias).astype(np.float32)
        return self.cache[path]

    def probs(self, path: tuple, params: SamplingParams) -> np.ndarray:
        """target_probs of this path (cached: the harness calls it 10^6 times)."""
        key = (path, id(params))
        if key not in self.probs_cache:
            self.probs_cache[key] = target_probs(self.logits(path), params)
        return self.probs_cache[key]


def exact_sequence_probs(target: ToyModel, prefix: tuple, length: int, params: SamplingParams) -> np.ndarray:
    probs = np.zeros(target.v ** length)
    for i, seq in enumerate(itertools.product(range(target.v), repeat=length)):
        pr = 1.0
        for j in range(length):
            pr *= target_probs(target.logits(prefix + seq[:j]), params)[seq[j]]
        probs[i] = pr
    return probs


_TREES: dict = {}


def shape(choices) -> TokenTree:
    key = tuple(map(tuple, choices))
    if key not in _TREES:
        _TREES[key] = TokenTree.from_choices(choices)
    return _TREES[key]


def draft_tree(draft: ToyModel, prefix: tuple, choices, mode: str, params: SamplingParams,
               rng: np.random.Generator):
    """Draw a tree of the given shape. mode: 'iid' (siblings with replacement), 'wor' (without
    replacement, Gumbel-top-k), 'topk' (deterministic: point masses)."""
    tree = shape(choices)
    n = tree.num_nodes
    tokens = np.zeros(n, np.int64)
    tokens[0] = prefix[-1]
    q_rows = None if mode == "topk" else np.zeros((n, draft.v))
    paths = [prefix] + [None] * (n - 1)
    for node in range(n):
        kids = tree.children[node]
        if not kids or paths[node] is None:
            continue
        if mode == "topk":
            picks = np.argsort(-draft.logits(paths[node]), kind="stable")[: len(kids)]
        else:
            q = draft.probs(paths[node], params)
            if mode == "iid":
                picks = np.minimum(np.searchsorted(np.cumsum(q), rng.random(len(kids)), side="right"),
                                   draft.v - 1)
            else:
                keys = np.log(np.maximum(q, 1e-300)) - np.log(rng.standard_exponential(draft.v))
                keys[q == 0] = -np.inf
                picks = np.argsort(-keys, kind="stable")[: min(len(kids), np.count_nonzero(q))]
            q_rows[kids[: len(picks)]] = q
        for c, tok in zip(kids, picks):
            tokens[c] = tok
            paths[c] = paths[node] + (int(tok),)
    for c in range(n):
        if paths[c] is None:          # a sibling q had no support for: never verified as drawn
            paths[c] = paths[tree.parents[c]] + (int(tokens[c]),)
    return tree, tokens, q_rows, paths


def run_step(target, draft, prefix, choices, mode, params, rng, verifier=verify_sampled):
    tree, tokens, q, paths = draft_tree(draft, prefix, choices, mode, params, rng)
    noise = Noise.draw(rng, tree.num_nodes, target.v)
    return verifier(tree, tokens, lambda node: target.probs(paths[node], params), noise, q,
                    mode == "wor")


def tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


CHAIN3 = [[0], [0, 0], [0, 0, 0]]
TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]
PARAMS = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)

CASES = [
    ("chain-sampled", CHAIN3, "iid", PARAMS, None),
    ("tree-with-replacement", TREE, "iid", PARAMS, None),
    ("tree-without-replacement", TREE, "wor", PARAMS, None),
    ("tree-deterministic-topk", TREE, "topk", PARAMS, None),
    ("tree-wor-topk-topp-temperature", TREE, "wor", WARPED, None),
    ("chain-min-p", CHAIN3, "iid", SamplingParams(temperature=1.2, min_p=0.1), None),
    ("tree-far-drafts", TREE, "wor", PARAMS, np.array([-4.0, -4.0, 0.0, 0.0, 3.0, 3.0])),
]


@pytest.mark.parametrize("name,choices,mode,params,draft_bias", CASES, ids=[c[0] for c in CASES])
def test_first_token_distribution(name, choices, mode, params, draft_bias):
    v = 6
    target, draft = ToyModel(v, 1), ToyModel(v, 2, bias=draft_bias)
    prefix = (3,)
    rng = np.random.default_rng(1234)
    counts = np.zeros(v)
    for _ in range(N_SAMPLES):
        counts[run_step(target, draft, prefix, choices, mode, params, rng).output_ids[0]] += 1
    exact = target_probs(target.logits(prefix), params)
    assert tv(counts, exact) < 0.01, (counts / counts.sum(), exact)
    if draft_bias is not None:   # the drafts really were far from the target
        assert 0.5 * np.abs(target_probs(draft.logits(prefix), params) - exact).sum() > 0.4


def generate3(target, draft, choices, mode, params, rng, verifier=verify_sampled) -> tuple:
    out: tuple = ()
    prefix = (3,)
    while len(out) < 3:
        verdict = run_step(target, draft, prefix + out, choices, mode, params, rng, verifier)
        out += tuple(int(t) for t in verdict.output_ids)
    return out[:3]


def sequence_tv(mode, choices, params, verifier=verify_sampled, n=N_SAMPLES) -> float:
    v = 4
    target, draft = ToyModel(v, 5, scale=1.2), ToyModel(v, 6, scale=1.2)
    rng = np.random.default_rng(99)
    counts = np.zeros(v ** 3)
    for _ in range(n):
        a, b, c = generate3(target, draft, choices, mode, params, rng, verifier)
        counts[(a * v + b) * v + c] += 1
    return tv(counts, exact_sequence_probs(target, (3,), 3, params))


@pytest.mark.parametrize("mode,choices,params", [
    ("iid", CHAIN3, PARAMS), ("wor", TREE, PARAMS), ("topk", TREE, WARPED)],
    ids=["chain-sampled", "tree-without-replacement", "tree-topk-warped"])
def test_three_token_sequences(mode, choices, params):
    assert sequence_tv(mode, choices, params) < 0.02


def test_harness_detects_a_biased_verifier():
    """Recover from p instead of the residual norm(max(0, p - q)): the bound must catch it."""
    import backend.verify as vmod

    def biased(tree, tokens, target_p, noise, q, without_replacement):
        orig = vmod._residual
        vmod._residual = lambda p, qq, x: p
        try:
            return verify_sampled(tree, tokens, target_p, noise, q, without_replacement)
        finally:
            vmod._residual = orig

    assert sequence_tv("iid", CHAIN3, PARAMS, biased, n=50_000) > 0.04


def test_greedy_accepts_exactly_the_argmax_path():
    tree = TokenTree.from_choices([[0], [1], [0, 0]])
    logits = np.zeros((4, 5), np.float32)
    logits[0, 2] = logits[2, 4] = logits[1, 1] = logits[3, 0] = 1.0
    v = verify_tree(tree, np.array([9, 1, 2, 3]), logits, SamplingParams(), None)
    assert v.accepted_nodes.tolist() == [0, 2] and v.output_ids.tolist() == [2, 4]
    assert v.num_accepted == 1 and v.final_is_bonus
    v = verify_tree(tree, np.array([9, 2, 1, 1]), logits, SamplingParams(), None)
    assert v.accepted_nodes.tolist() == [0, 1, 3] and v.output_ids.tolist() == [2, 1, 0]
    assert v.final_is_bonus and v.num_accepted == 2
    v = verify_tree(tree, np.array([9, 2, 1, 3]), logits, SamplingParams(), None)
    assert v.accepted_nodes.tolist() == [0, 1] and v.output_ids.tolist() == [2, 1]
    assert not v.final_is_bonus


def test_fixed_shape_batch_output():
    from backend.verify import pad_verdicts

    tree = TokenTree.from_choices([[0], [1], [0, 0]])
    logits = np.zeros((4, 5), np.float32)
    logits[0, 2] = logits[2, 4] = logits[1, 1] = logits[3, 0] = 1.0
    a = verify_tree(tree, np.array([9, 2, 1, 1]), logits, SamplingParams(), None)
    b = verify_tree(tree, np.array([9, 3, 3, 3]), logits, SamplingParams(), None)
    out, num, nodes = pad_verdicts([a, b], tree.max_depth)
    assert out.tolist() == [[2, 1, 0], [2, -1, -1]]
    assert num.tolist() == [2, 0] and nodes.tolist() == [[0, 1, 3], [0, -1, -1]]


def test_verify_tree_sampled_path_uses_target_probs():
    """verify_tree (logits in) and verify_sampled (probabilities in) agree draw for draw."""
    target, draft = ToyModel(6, 1), ToyModel(6, 2)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    for seed in range(50):
        rng = np.random.default_rng(seed)
        tree, tokens, q, paths = draft_tree(draft, (3,), TREE, "wor", params, rng)
        noise = Noise.draw(rng, tree.num_nodes, 6)
        logits = np.stack([target.logits(paths[i]) for i in range(tree.num_nodes)])
        a = verify_tree(tree, tokens, logits, params, noise, q, True)
        b = verify_sampled(tree, tokens, lambda n: target.probs(paths[n], params), noise, q, True)
        assert a.output_ids.tolist() == b.output_ids.tolist()


def test_same_noise_same_tokens():
    target, draft = ToyModel(6, 1), ToyModel(6, 2)
    a = [run_step(target, draft, (3,), TREE, "wor", PARAMS, np.random.default_rng(7)).output_ids.tolist()
         for _ in range(3)]
    assert a[0] == a[1] == a[2]
