"""`lookup+eagle`: prompt lookup where the text repeats, the EAGLE head everywhere else.

A long n-gram match is nearly free to draft and usually accepted (edits, summaries, code), while
the head covers open-ended text. Each step asks prompt lookup first and gives the sequences it
has no match for to the head. Both drafters observe every step, so either can take over at the
next one with valid state (the head's pending target features keep accumulating).
"""
from __future__ import annotations

from backend.config import SamplingParams
from backend.drafters.base import Draft
from backend.sequence import SequenceState


class LookupEagleDrafter:
    name = "lookup+eagle"

    def __init__(self, lookup, eagle):
        self.lookup, self.eagle = lookup, eagle
        self.max_lookup = lookup.traits.max_budget
        # a step drafts with the head whenever lookup has no match: priced as the head
        self.traits = eagle.traits

    def check_params(self, params: SamplingParams) -> None:
        self.lookup.check_params(params)
        self.eagle.check_params(params)

    def begin(self, seq: SequenceState, prompt_hidden) -> None:
        self.lookup.begin(seq, None)
        self.eagle.begin(seq, prompt_hidden)

    def preview(self, seq: SequenceState, limit: int) -> None:
        return None                                  # drafting costs a forward

    def backlog(self, seq: SequenceState) -> int:
        return self.eagle.backlog(seq)

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[Draft]:
        drafts = self.lookup.propose(seqs, [min(k, self.max_lookup) for k in max_tokens])
        rest = [i for i, (d, k) in enumerate(zip(drafts, max_tokens)) if d.num_draft_tokens == 0 and k > 0]
        if rest:
            for i, d in zip(rest, self.eagle.propose([seqs[i] for i in rest], [max_tokens[i] for i in rest])):
                drafts[i] = d
        return drafts

    def observe(self, seq: SequenceState, draft: Draft, accepted_nodes, hidden) -> None:
        self.lookup.observe(seq, draft, accepted_nodes, None)
        self.eagle.observe(seq, draft, accepted_nodes, hidden)

    def end(self, seq: SequenceState) -> None:
        self.lookup.end(seq)
        self.eagle.end(seq)
