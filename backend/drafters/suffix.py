"""Suffix decoding (Oliaro et al., "SuffixDecoding", 2024, arXiv:2411.04975; vLLM `suffix`):
a drafter without a model that proposes what followed the current context before, in this
request's prompt and output and in earlier requests' texts, as a tree scored by how often each
continuation occurred.

State (suffix_index.py): a suffix trie per request over its prompt and output (grown by the
committed tokens), and one global store per drafter, i.e. per model instance, shared by all its
requests: each finished request's output, with the prompt's last `max_match` tokens before it
(so that the start of a new answer matches where earlier answers started), bounded by
`global_tokens`, oldest requests dropped first. Nothing is kept across restarts.

A step: the longest suffix of the text (`min_match` to `max_match` tokens) followed by a token
in the request's own trie, or in the store for a match of at least `global_match` tokens (a
1-3 token match in other requests' answers drafted badly on chat and summaries: 0.1-0.2 of
first tokens accepted, against 0.3-0.7 in the request's own text); the continuations' counts
summed over both; a tree of the most probable continuations (suffix_index.share: counts
discounted by how short the match is), best first, down to `min_prob`, at most
min(budget, factor * match length) nodes. So the draft grows with the match and its evidence,
as in the paper. Proposals are deterministic (q is a point mass), so verification serves every
sampling parameter losslessly; with no match the step is plain decoding.

Priced as a chain (like prompt lookup): `preview` shows the most probable continuation, which
the adaptive controller scores against the text that follows and caps the budget at, and the
tree spends that budget on the most probable alternatives. The build times one step
(draft_kinds/suffix.py).
"""
from __future__ import annotations

import math

import numpy as np

from backend.config import SamplingParams
from backend.drafters.base import Draft, DrafterTraits
from backend.drafters.suffix_index import SuffixStore, SuffixTrie, best_chain, grow_tree
from backend.sequence import SequenceState
from backend.tree import TokenTree


class _Text:
    """A request's own trie, its text so far (the trie's tails point into it), its active nodes."""

    __slots__ = ("trie", "tokens", "active")

    def __init__(self, depth: int):
        self.trie = SuffixTrie(depth)
        self.tokens: list[int] = []
        self.active = self.trie.start()


class SuffixDrafter:
    name = "suffix"

    def __init__(self, max_tokens: int = 16, max_match: int = 16, min_match: int = 1, global_match: int = 4,
                 factor: float = 4.0, min_prob: float = 0.3, global_tokens: int = 1 << 16):
        assert 1 <= min_match <= max_match and max_tokens >= 1, (min_match, max_match, max_tokens)
        self.traits = DrafterTraits(tree=False, max_budget=max_tokens, max_forwards=1, cost_key=self.name)
        self.max_match, self.min_match, self.global_match = max_match, min_match, global_match
        self.factor, self.min_prob = factor, min_prob
        self.depth = max_match + max_tokens               # a match and a full draft fit in a window
        self.store = SuffixStore(self.depth, global_tokens)
        self._texts: dict[int, _Text] = {}
        self._match: dict[int, tuple] = {}                # seq -> (text length, store version, match)

    def check_params(self, params: SamplingParams) -> None:
        return None                                       # point-mass drafts: lossless for all

    def begin(self, seq: SequenceState, prompt_hidden) -> None:
        self._texts[seq.seq_id] = _Text(self.depth)
        self._sync(seq)

    def observe(self, seq: SequenceState, draft: Draft, accepted_nodes, hidden) -> None:
        self._sync(seq)

    def end(self, seq: SequenceState) -> None:
        self._match.pop(seq.seq_id, None)
        if self._texts.pop(seq.seq_id, None) is not None and seq.output_ids:
            self.store.add(list(seq.prompt_ids[-self.max_match:]) + list(seq.output_ids))

    def backlog(self, seq: SequenceState) -> int:
        return 0                                          # no model: nothing to catch up

    def _sync(self, seq: SequenceState) -> _Text:
        """Append the tokens committed since the last call (never re-reads the history)."""
        text = self._texts[seq.seq_id]
        n, p = len(text.tokens), len(seq.prompt_ids)
        if n < p:
            text.active = text.trie.extend(text.tokens, text.active, seq.prompt_ids[n:])
            n = p
        out = seq.output_ids
        if n < p + len(out):
            text.active = text.trie.extend(text.tokens, text.active, out[n - p:])
        return text

    def match(self, seq: SequenceState) -> tuple[int, tuple]:
        """(m, (own node, global node)): the longest suffix of the request's text followed by a
        token in its own trie or the global store (m = 0: none of at least min_match tokens)."""
        text = self._sync(seq)
        key = (len(text.tokens), self.store.version)
        got = self._match.get(seq.seq_id)
        if got is not None and got[0] == key:
            return got[1]
        own = next((m for m in range(min(self.max_match, len(text.active) - 1), 0, -1)
                    if text.active[m].has_next()), 0)
        tail = _tail(seq, self.max_match)
        glob, gnode = self.store.trie.longest_match(tail, self.max_match)
        if glob < self.global_match:
            glob, gnode = 0, None
        m = max(own, glob)
        nodes = (text.active[m] if own == m else None, gnode if glob == m else None)
        found = (m, nodes) if m >= self.min_match else (0, ())
        self._match[seq.seq_id] = (key, found)
        return found

    def size_for(self, m: int) -> int:
        """Most nodes a draft after an m-token match may have: grows with the match."""
        return min(self.traits.max_budget, max(1, math.floor(self.factor * m)))

    def preview(self, seq: SequenceState, limit: int) -> list[int]:
        m, nodes = self.match(seq)
        return best_chain(nodes, m, min(limit, self.size_for(m)), self.min_prob) if m and limit > 0 else []

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[Draft]:
        return [self._propose_one(s, k) for s, k in zip(seqs, max_tokens)]

    def _propose_one(self, seq: SequenceState, budget: int) -> Draft:
        m, nodes = self.match(seq)
        if budget <= 0 or not m:
            return Draft.empty(seq.root)
        parents, tokens, _ = grow_tree(nodes, m, min(budget, self.size_for(m)), self.min_prob)
        if not tokens:
            return Draft.empty(seq.root)
        return Draft(TokenTree(np.array([-1] + [p + 1 for p in parents], np.int32)),
                     np.array([seq.root] + tokens, np.int64))


def _tail(seq: SequenceState, n: int) -> list[int]:
    """The last n tokens of the request's text, without copying the rest."""
    out = seq.output_ids
    if len(out) >= n:
        return list(out[len(out) - n:])
    p = seq.prompt_ids
    return list(p[max(0, len(p) - (n - len(out))):]) + list(out)
