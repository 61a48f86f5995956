"""Prompt-lookup drafting (Saxena 2023; transformers `prompt_lookup_num_tokens`, vLLM `ngram`):
the last n tokens are looked up in the prompt and the text generated so far; what followed the
most recent earlier occurrence is proposed. Longer n are tried first (min_n..max_n). With
width > 1 the continuations of several matches are merged into a small tree (a trie under the
root). Proposals are deterministic, so q is a point mass and every sampling parameter is served
losslessly. With no match the drafter proposes nothing and the step is plain decoding.

The index maps every n-gram to the positions right after its occurrences and grows by the
committed tokens only, so it stays valid whatever the controller does between steps.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from backend.config import SamplingParams
from backend.drafters.base import Draft, DrafterTraits
from backend.sequence import SequenceState
from backend.tree import TokenTree


class _Index:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.after: dict[tuple, list[int]] = defaultdict(list)   # n-gram -> positions after it

    def extend(self, ids) -> None:
        for t in ids:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.after[tuple(self.tokens[end - n:end])].append(end)

    def continuations(self, limit: int, count: int) -> list[list[int]]:
        """Up to `count` distinct continuations (longest match first, then most recent)."""
        toks, end, found = self.tokens, len(self.tokens), []
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            for pos in reversed(self.after.get(tuple(toks[end - n:end]), ())):
                if pos >= end:
                    continue                       # the suffix itself
                cont = toks[pos:pos + limit]
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) >= count:
                        return found
        return found


class PromptLookupDrafter:
    name = "prompt-lookup"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, width: int = 1, max_tokens: int = 8):
        assert 1 <= min_ngram <= max_ngram, (min_ngram, max_ngram)
        self.traits = DrafterTraits(tree=False, max_budget=max_tokens, max_forwards=0, cost_key=self.name)
        self.min_n, self.max_n, self.width = min_ngram, max_ngram, max(1, width)
        self._index: dict[int, _Index] = {}
        self._preview: dict[int, tuple[int, int, list[int]]] = {}   # seq -> (tokens, limit, chain)

    def check_params(self, params: SamplingParams) -> None:
        return None                                  # point-mass drafts: lossless for all

    def begin(self, seq: SequenceState, prompt_hidden) -> None:
        idx = _Index(self.min_n, self.max_n)
        idx.extend(seq.all_ids())
        self._index[seq.seq_id] = idx

    def observe(self, seq: SequenceState, draft: Draft, accepted_nodes, hidden) -> None:
        idx = self._index[seq.seq_id]
        idx.extend(seq.all_ids()[len(idx.tokens):])

    def end(self, seq: SequenceState) -> None:
        self._index.pop(seq.seq_id, None)
        self._preview.pop(seq.seq_id, None)

    def preview(self, seq: SequenceState, limit: int) -> list[int]:
        """The longest, most recent match's continuation: what a chain proposal starts with."""
        idx = self._index[seq.seq_id]
        idx.extend(seq.all_ids()[len(idx.tokens):])
        conts = idx.continuations(limit, 1) if limit > 0 else []
        chain = conts[0] if conts else []
        self._preview[seq.seq_id] = (len(idx.tokens), limit, chain)
        return chain

    def backlog(self, seq: SequenceState) -> int:
        return 0                                     # no model: nothing to catch up

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[Draft]:
        return [self._propose_one(s, k) for s, k in zip(seqs, max_tokens)]

    def _propose_one(self, seq: SequenceState, budget: int) -> Draft:
        idx = self._index[seq.seq_id]
        idx.extend(seq.all_ids()[len(idx.tokens):])   # tokens emitted since the last observe
        if budget <= 0:
            return Draft.empty(seq.root)
        seen = self._preview.get(seq.seq_id)
        if self.width == 1 and seen is not None and seen[0] == len(idx.tokens) and budget <= seen[1]:
            conts = [seen[2][:budget]] if seen[2] else []     # this step's preview: same match
        else:
            conts = idx.continuations(budget, self.width)
        if not conts:
            return Draft.empty(seq.root)
        # trie under the root; the best continuation keeps most of the budget
        reserve = 2 * (len(conts) - 1) if budget >= 4 else 0
        parents, tokens, children = [-1], [seq.root], [{}]
        for i, cont in enumerate(conts):
            node = 0
            limit = budget - reserve if i == 0 else 2
            for t in cont[:limit]:
                if t not in children[node]:
                    if len(tokens) - 1 >= budget:
                        break
                    children[node][t] = len(tokens)
                    parents.append(node)
                    tokens.append(t)
                    children.append({})
                node = children[node][t]
        return Draft(TokenTree(np.array(parents, np.int32)), np.array(tokens, np.int64))
