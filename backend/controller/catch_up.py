"""The price of a drafter's catch-up, spread over the drafting run it buys.

A drafter with a model of its own (EAGLE head, draft model) must first feed it what it has not
seen: the whole prompt before a request's first draft, and every step it did not draft before
the next one. A k > 0 step pays that forward, priced per backlog token by the build (rows of a
kind padded to the longest backlog) and spread over the drafting steps it buys: the kind's
measured mean drafting run, at most the tokens the request has left. At one stream with the
EAGLE head, a first tree after a 250-token prompt drafted for 24-44 ms against 10-19 ms later,
and most requests drafted for one or two steps, so a short measured run makes intermittent
probing pay the catch-up nearly in full, while a drafter whose requests keep drafting (a good
draft model) pays it once over the whole run.
"""
from __future__ import annotations

from backend.config import DrafterKind
from backend.controller.cost import CostModel
from backend.controller.estimators import DecayedMean
from backend.sequence import SequenceState

RUN_PRIOR = 4.0                  # drafting steps a catch-up is expected to serve, until measured


class CatchUp:
    def __init__(self, cost: CostModel, traits: dict):
        self.cost = cost
        self.traits = traits                                  # DrafterKind -> DrafterTraits
        self._runs: dict[DrafterKind, DecayedMean] = {}      # drafting run lengths per kind
        self._run_len: dict[int, int] = {}                    # seq id -> current run

    def cost_of(self, seqs: list[SequenceState], backlogs: list[int], amortised: bool = False) -> float:
        """The build-time model's price of the catch-up forwards (uncorrected): per drafter kind,
        its rows padded to the longest backlog. `amortised`: this step's share of it."""
        longest: dict[DrafterKind, list[int]] = {}
        for s, b in zip(seqs, backlogs):
            n_b_left = longest.setdefault(s.drafter, [0, 0, 1])
            n_b_left[0] += 1
            n_b_left[1] = max(n_b_left[1], b)
            n_b_left[2] = max(n_b_left[2], s.params.max_tokens - len(s.output_ids))
        total = 0.0
        for kd, (n, b, left) in longest.items():
            t = self.traits[kd]
            c = self.cost.catch_up(t.cost_key, n, b) if t.catches_up else 0.0
            total += c / max(1.0, min(self.run_mean(kd), left)) if amortised else c
        return total

    def run_mean(self, kind: DrafterKind) -> float:
        arm = self._runs.get(kind)
        return RUN_PRIOR if arm is None else arm.mean

    def track(self, seq: SequenceState, drafted: bool) -> bool:
        """Count a request's consecutive drafting steps; a finished run updates its kind's mean
        (-> True when it did)."""
        n = self._run_len.get(seq.seq_id, 0)
        if drafted:
            self._run_len[seq.seq_id] = n + 1
        elif n:
            self.end_run(seq)
        return bool(n) and not drafted

    def end_run(self, seq: SequenceState) -> None:
        n = self._run_len.pop(seq.seq_id, 0)
        if n:
            self._runs.setdefault(seq.drafter, DecayedMean(prior=RUN_PRIOR, decay=0.9, strength=2.0)).update(n)
