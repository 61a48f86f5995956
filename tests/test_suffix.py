"""Suffix decoding (issue 29): the suffix structures against brute force over the texts (counts of
every path, the longest match, the proposed tree), the global store's eviction of its oldest
texts, losslessness with trees (greedy and seeded sampling, alone and batched), the cost of a
step on a 4k-token history, and the build pricing the drafter."""
from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from conftest import run_batch

from backend.config import DrafterKind, SamplingParams, SpecConfig
from backend.decoder import SpecDecoder
from backend.draft_kinds.suffix import SuffixKind, repetitive_text
from backend.drafters.prompt_lookup import PromptLookupDrafter
from backend.drafters.suffix import SuffixDrafter
from backend.drafters.suffix_index import SuffixStore, SuffixTrie
from backend.runtime.toy import ToyRuntime, ToyTokenizer
from backend.sequence import Request

SUFFIX = DrafterKind.SUFFIX


class Seq:
    """What the drafter reads of a sequence."""

    def __init__(self, seq_id: int, prompt):
        self.seq_id, self.prompt_ids, self.output_ids = seq_id, tuple(prompt), [int(prompt[-1])]

    @property
    def root(self) -> int:
        return self.output_ids[-1]


# ---- brute force over the texts ----------------------------------------------------------------

def count(texts, path) -> int:
    """Occurrences of `path` in `texts` (every start position)."""
    n = len(path)
    return sum(1 for t in texts for i in range(len(t) - n + 1) if tuple(t[i:i + n]) == tuple(path))


def reference_match(own, texts, d: SuffixDrafter) -> tuple[int, list]:
    """(m, texts counted): the longest suffix of the own text followed by a token in it, or in
    `texts` if that match is at least global_match long; the texts whose counts are summed."""
    vocab = sorted({t for x in [own] + texts for t in x})

    def longest(among):
        return next((m for m in range(min(d.max_match, len(own)), 0, -1)
                     if any(count(among, own[-m:] + [c]) for c in vocab)), 0)
    m_own, m_glob = longest([own]), longest(texts) if texts else 0
    if m_glob < d.global_match:
        m_glob = 0
    m = max(m_own, m_glob)
    if m < d.min_match:
        return 0, []
    return m, ([own] if m_own == m else []) + (texts if m_glob == m else [])


def reference_proposal(own, texts, d: SuffixDrafter, budget: int) -> tuple[int, list[int], list[int]]:
    """(m, parents, tokens) as the drafter should propose them, from occurrence counts alone:
    the `size` most probable continuations of the match (counts summed; each step's share
    discounted by 1/context; ties by token path) as a tree."""
    m, among = reference_match(own, texts, d)
    if not m:
        return 0, [], []
    vocab = sorted({t for x in [own] + texts for t in x})
    size = min(budget, d.traits.max_budget, max(1, math.floor(d.factor * m)))
    nodes = []                                         # (-prob, path)

    def walk(path, prob):
        if len(path) == size:
            return
        counts = {c: count(among, own[-m:] + path + [c]) for c in vocab}
        total = sum(counts.values())
        for c, k in counts.items():
            p = prob * (k / (total + 1.0 / (m + len(path)))) if k else 0.0
            if k and p >= d.min_prob:
                nodes.append((-p, tuple(path + [c])))
                walk(path + [c], p)
    walk([], 1.0)
    chosen = [path for _, path in sorted(nodes)[:size]]
    index = {path: i for i, path in enumerate(chosen)}
    return m, [index.get(p[:-1], -1) for p in chosen], [p[-1] for p in chosen]


def reference_chain(own, texts, d: SuffixDrafter, budget: int) -> list[int]:
    """The preview: the most counted continuation at each step (ties to the smaller token),
    while its probability stays >= min_prob."""
    m, among = reference_match(own, texts, d)
    if not m:
        return []
    vocab = sorted({t for x in [own] + texts for t in x})
    chain, prob = [], 1.0
    while len(chain) < min(budget, max(1, math.floor(d.factor * m))):
        counts = [count(among, own[-m:] + chain + [c]) for c in vocab]
        if not sum(counts):
            break
        best = int(np.argmax(counts))
        prob = prob * (counts[best] / (sum(counts) + 1.0 / (m + len(chain))))
        if prob < d.min_prob:
            break
        chain.append(vocab[best])
    return chain


def all_paths(vocab: int, longest: int):
    for n in range(1, longest + 1):
        yield from (list(p) for p in itertools.product(range(vocab), repeat=n))


def trie_count(trie: SuffixTrie, path) -> int:
    node = trie.find(path)
    return node.count if node is not None else 0


# ---- the structure -----------------------------------------------------------------------------

def test_trie_counts_every_path_as_brute_force_while_a_text_grows():
    rng = np.random.default_rng(0)
    for trial in range(3):
        trie = SuffixTrie(depth=5)
        done = [rng.integers(0, 3, int(rng.integers(2, 9))).tolist() for _ in range(trial)]
        for t in done:                                   # finished texts, then a growing one
            trie.extend([], trie.start(), t)
        text, active, grown = [], trie.start(), []
        for _ in range(12):
            chunk = rng.integers(0, 3, int(rng.integers(1, 4))).tolist()
            active = trie.extend(text, active, chunk)
            grown += chunk
            for path in all_paths(3, 6):
                want = count(done + [grown], path) if len(path) <= 5 else 0
                assert trie_count(trie, path) == want, (path, done, grown)
            # the active nodes: every suffix that occurred before, up to the first new one
            for j, node in enumerate(active[1:], 1):
                assert node is trie.find(grown[-j:]) and node.count >= 2
            n = len(active)
            assert n == min(5, len(grown) + 1) or count(done + [grown], grown[-n:]) == 1


def test_store_evicts_oldest_texts_and_counts_stay_exact():
    rng = np.random.default_rng(1)
    store = SuffixStore(depth=4, budget=40)
    added = []
    for _ in range(30):
        text = rng.integers(0, 3, int(rng.integers(3, 16))).tolist()
        store.add(text)
        added.append(text)
        kept, total = [], 0
        for t in reversed(added):                       # newest first, while they fit
            if total + len(t) > 40:
                break
            kept.insert(0, t)
            total += len(t)
        assert [list(t) for t in store.texts] == kept and store.tokens == total
        for path in all_paths(3, 5):
            assert trie_count(store.trie, path) == (count(kept, path) if len(path) <= 4 else 0), path
    for t in list(store.texts):                          # removing all leaves an empty trie
        store.trie.remove(t)
    assert store.trie.root.kids == {}


@pytest.mark.parametrize("seed", range(6))
def test_proposals_match_brute_force_own_and_global(seed):
    rng = np.random.default_rng(seed)
    d = SuffixDrafter(max_tokens=5, max_match=4, min_match=1 + seed % 2, global_match=1 + seed % 3, factor=1.5,
                      min_prob=0.05 if seed % 3 else 0.0, global_tokens=60)
    for r in range(4):                                   # earlier requests fill the store
        s = Seq(r, rng.integers(0, 4, 6).tolist())
        d.begin(s, None)
        s.output_ids += rng.integers(0, 4, 12).tolist()
        d.end(s)
    texts = [list(t) for t in d.store.texts]
    assert texts and d.store.tokens <= 60
    s = Seq(99, rng.integers(0, 4, 8).tolist())
    d.begin(s, None)
    checked = drafted = from_store = branched = 0
    for _ in range(30):
        s.output_ids += rng.integers(0, 4, int(rng.integers(1, 3))).tolist()
        d.observe(s, None, None, None)
        own = list(s.prompt_ids) + s.output_ids
        from_store += len(reference_match(own, texts, d)[1]) > 1
        for budget in (1, 3, 5):
            m, parents, tokens = reference_proposal(own, texts, d, budget)
            branched += len(parents) > len(set(parents))
            assert d.match(s)[0] == m
            draft = d.propose([s], [budget])[0]
            assert draft.tokens[0] == s.root
            assert draft.tokens[1:].tolist() == tokens
            assert (draft.tree.parents[1:] - 1).tolist() == parents
            assert d.preview(s, budget) == reference_chain(own, texts, d, budget)
            checked += 1
            drafted += bool(tokens)
    assert drafted > checked // 3 and from_store > 0 and branched > 0


# ---- the drafter in the decoder ----------------------------------------------------------------

PROMPT = (1, 2, 3, 1, 2, 4, 1, 2)


class Spy(SuffixDrafter):
    """Counts the drafts that branch, so the tests know trees were verified."""

    trees = 0

    def propose(self, seqs, max_tokens):
        out = super().propose(seqs, max_tokens)
        Spy.trees += sum(not d.tree.is_chain for d in out)
        return out


def make(k=4):
    drafters = {SUFFIX: Spy(max_tokens=8, max_match=6, global_match=2, min_prob=0.02),
                DrafterKind.PROMPT_LOOKUP: PromptLookupDrafter(1, 3, 2)}
    return SpecDecoder(ToyRuntime(vocab=8, seed=1), ToyTokenizer(), drafters, SpecConfig(num_draft_tokens=k))


def run(dec, kind, params, prompt=PROMPT):
    return [t for o in dec.generate(Request(prompt, params, kind)) for t in o.new_ids]


PROMPTS = [PROMPT, (3, 3, 2, 1, 5), (5, 6, 7, 5, 6), (1, 2, 3, 4)]


def test_greedy_with_trees_is_plain_decoding_and_earlier_requests_help():
    params = SamplingParams(max_tokens=48)
    plain = [run(make(), DrafterKind.NONE, params, p) for p in PROMPTS]
    Spy.trees = 0
    for k in (1, 3, 8):
        dec = make(k)
        for p, want in zip(PROMPTS * 2, plain * 2):          # the second round reads the first's
            assert run(dec, SUFFIX, params, p) == want, (k, p)
        assert dec.stats.num_accepted_tokens > 0
        assert len(dec.drafters[SUFFIX].store.texts) == 8
    assert Spy.trees > 0
    # a request the store has seen is drafted from it: most of its tokens come accepted
    dec = make(8)
    run(dec, SUFFIX, params, PROMPTS[1])
    again = [o for o in dec.generate(Request(PROMPTS[1], params, SUFFIX))]
    assert again[-1].stats.num_accepted_tokens >= 0.6 * len(plain[1])


def test_seeded_sampling_and_mixed_batches_are_plain_decoding():
    params = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02, max_tokens=60, seed=77)
    plain = run(make(), DrafterKind.NONE, params)
    Spy.trees = 0
    for k in (2, 8):
        dec = make(k)
        for _ in range(2):
            assert run(dec, SUFFIX, params) == plain
    assert Spy.trees > 0
    dec = make(6)
    others = [Request(p, SamplingParams(temperature=1.0, max_tokens=40, seed=3), kind)
              for p, kind in ((PROMPTS[1], SUFFIX), (PROMPTS[2], DrafterKind.PROMPT_LOOKUP), (PROMPTS[3], DrafterKind.NONE))]
    expected = [run(make(), DrafterKind.NONE, r.params, r.prompt_ids) for r in others]
    for _ in range(2):                                     # the second batch reads the first's
        seqs = [dec.start(Request(PROMPT, params, SUFFIX))] + [dec.start(r) for r in others]
        assert run_batch(dec, seqs) == [plain] + expected
    assert dec.stats.num_accepted_tokens > 0


def test_a_step_on_a_4k_history_costs_well_under_a_millisecond():
    """Appending a step's tokens, the preview and a 16-node tree, on a 4096-token request with a
    full global store (64k tokens): the build's own timing (draft_kinds/suffix.py)."""
    class Manifest:
        class model:
            vocab_size = 49152
    step, _ = SuffixKind().time(Manifest, 256, 3)["suffix"]
    assert step < 1e-3, step
    rng = np.random.default_rng(0)
    d = SuffixDrafter()
    s = Seq(1, repetitive_text(rng, 4096, 49152))
    t0 = time.perf_counter()
    d.begin(s, None)
    assert time.perf_counter() - t0 < 0.5                  # the prompt once: ~10 ms here


def test_the_build_prices_it_and_a_request_names_it(tmp_path):
    from backend import triton_io
    from backend.builder.pipeline import BuildConfig, build
    from backend.engine import make_decoder
    from backend.config import ServeConfig, RuntimeOptions
    from backend.manifest import WeightFormat
    from conftest import assert_greedy_identity, make_tiny_checkpoint

    pytest.importorskip("torch")
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=5)
    m = build(BuildConfig(target=str(ckpt), output=tmp_path / "repo", weights=(WeightFormat.FP32,), quiet=True,
                          check_invariance=False))
    assert 0 < m.cost_model["draft_step_s"]["suffix"] < 1e-3
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), weight_format="fp32",
                                   runtime=RuntimeOptions(max_sequences=4)))
    assert SUFFIX in dec.drafters                          # the adaptive controller accepted its price
    req = triton_io.parse({"drafter": np.array([b"suffix"], object), "max_tokens": np.array([4])}, [5, 6]).request
    assert req.drafter is SUFFIX
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), weight_format="fp32", spec=SpecConfig(num_draft_tokens=6),
                                   runtime=RuntimeOptions(max_sequences=4)))
    assert_greedy_identity(dec, "suffix")


def test_the_bench_time_slices_modes_with_their_own_history():
    """`specdec bench --drafter suffix,prompt-lookup`: every mode decodes the same request, one
    call each in turn, on its own decoder (its own store); each mode's clock counts its calls."""
    import random

    from backend.bench.spec_bench import run_sliced

    params = SamplingParams(max_tokens=40)
    modes = {DrafterKind.NONE: make(), SUFFIX: make(8), DrafterKind.PROMPT_LOOKUP: make(8)}
    for p in PROMPTS:
        got = run_sliced(modes, list(p), params, None, random.Random(0))
        assert got[SUFFIX].tokens == got[DrafterKind.PROMPT_LOOKUP].tokens == got[DrafterKind.NONE].tokens
        assert all(0 < r.ttft_s <= r.seconds for r in got.values())
    assert len(modes[SUFFIX].drafters[SUFFIX].store.texts) == len(PROMPTS)
    assert not modes[DrafterKind.NONE].drafters[SUFFIX].store.texts         # plain feeds no store
