"""Suffix decoding (drafters/suffix.py): no weights and no build, served as the `suffix` drafter
from every manifest. Knows: how a drafting step is timed for the cost model. Does not know: the
suffix structures (drafters/suffix_index.py). Its request name is registered with the other
built-in ones (config.py), so a server's `default_drafter` can name it before any kind loads."""
from __future__ import annotations

import statistics
import time

import numpy as np

from backend.config import DrafterKind, SpecConfig
from backend.draft_kinds.base import DraftKind


def suffix_drafter(spec: SpecConfig):
    from backend.drafters.suffix import SuffixDrafter

    return SuffixDrafter(max_tokens=spec.max_tree_nodes, global_tokens=spec.suffix_global_tokens)


def repetitive_text(rng, n: int, vocab: int) -> list[int]:
    """Tokens that repeat in pieces, as agent traffic does (phrases of 4-24 tokens drawn from a
    small set, between fresh tokens), so that timing sees matches and branching continuations."""
    phrases = [rng.integers(3, vocab, int(rng.integers(4, 25))).tolist() for _ in range(64)]
    out: list[int] = []
    while len(out) < n:
        out += phrases[int(rng.integers(len(phrases)))] if rng.random() < 0.7 else rng.integers(3, vocab, 3).tolist()
    return out[:n]


class SuffixKind(DraftKind):
    name = "suffix decoding"

    def time(self, manifest, context, reps, history: int = 4096, steps: int = 32):
        """Seconds of one drafting step (the step's tokens appended, the preview the controller
        reads, the tree at the largest budget) on a `history`-token request, with a global store
        filled to its budget with texts like it; median over `steps` steps of `reps` requests."""
        from backend.buildlib.timing import TimingSeq

        spec = SpecConfig()
        drafter = suffix_drafter(spec)
        rng = np.random.default_rng(0)
        v = manifest.model.vocab_size
        while drafter.store.tokens + 512 <= drafter.store.budget:
            drafter.store.add(repetitive_text(rng, 512, v))
        budget = drafter.traits.max_budget
        times = []
        for r in range(reps + 1):                   # the first request warms up: not counted
            seq = TimingSeq(50_000 + r, repetitive_text(rng, history, v))
            drafter.begin(seq, None)
            follow = repetitive_text(rng, 3 * steps, v)
            for i in range(steps):
                seq.output_ids += follow[3 * i: 3 * i + 1 + i % 3]
                t0 = time.perf_counter()
                drafter.observe(seq, None, None, None)
                drafter.preview(seq, budget)
                drafter.propose([seq], [budget])
                if r:
                    times.append(time.perf_counter() - t0)
            drafter.end(seq)
        return {DrafterKind.SUFFIX.value: (statistics.median(times), None)}

    def make(self, manifest, spec, options, made, want):
        """Every manifest serves it, except one whose cost model predates it: the adaptive
        controller refuses an unpriced drafter, so such a server goes on without it (a request
        naming it is refused) until a rebuild prices it."""
        priced = not manifest.cost_model or DrafterKind.SUFFIX.value in manifest.cost_model.get("draft_step_s", {})
        if not priced or not want(DrafterKind.SUFFIX):
            return {}
        return {DrafterKind.SUFFIX: suffix_drafter(spec)}
