"""How much to speculate: controllers that choose each step's draft budget (the scheduler
asks them once per step).

FixedController: K from the request or the server config (0 = plain decoding).

AdaptiveController: for a batch of B sequences, chooses the draft length k that maximises
expected output tokens per second of the whole batch:

    E_i(k)   = 1 + sum_{j=1..k} prod_{d<=j} alpha_i[d]       expected tokens of sequence i
    time(k)  = verify(B, k + 1) + sum_i draft_i(k)            measured cost model
    k*       = argmax_k  sum_i E_i(k) / time(k)               (k = 0 is plain decoding)

alpha_i[d] is the running probability that sequence i's depth-d draft token is accepted given
depth d-1 was (decayed counts, with the drafter's pooled statistics as the prior). The cost
model comes from measured forward times (CostModel.measure, stored in the manifest) and is
corrected online by the ratio of measured to predicted step times. Everything is continuous in
load and acceptance, so a small change in either makes a small change in k (no thresholds).
Drafter state is independent of the budget, so switching speculation off and on is safe.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.config import DrafterKind, SpecConfig
from backend.sequence import SequenceState


class FixedController:
    def __init__(self, spec: SpecConfig, default_k: int = 4):
        self.k = spec.num_draft_tokens if spec.num_draft_tokens is not None else default_k
        self.max_k = spec.max_draft_tokens

    def budgets(self, seqs: list[SequenceState], max_seq_len: int) -> list[int]:
        out = []
        for s in seqs:
            k = s.request.num_draft_tokens if s.request.num_draft_tokens is not None else self.k
            out.append(0 if s.drafter is DrafterKind.NONE else min(k, self.max_k, s.draft_room()))
        return out

    def observe(self, seq, draft, verdict, batch: int, draft_s: float, verify_s: float) -> None:
        return None


@dataclass
class CostModel:
    """Seconds of one target forward over B sequences x T tokens, plus draft costs."""

    tokens: list[int]                  # grid of M = B * T
    seconds: list[float]               # median forward time at each M (B = 1, context ~256)
    per_seq_s: float = 0.0             # extra time per additional sequence in a batch
    draft_step_s: dict[str, float] = field(default_factory=dict)   # drafter -> s per draft token

    def verify(self, b: int, t: int) -> float:
        m = b * t
        return float(np.interp(m, self.tokens, self.seconds, right=None)
                     if m <= self.tokens[-1] else
                     self.seconds[-1] * m / self.tokens[-1]) + self.per_seq_s * (b - 1)

    def draft(self, kind: DrafterKind, b: int, k: int) -> float:
        return self.draft_step_s.get(kind.value, 0.0) * k * (1 + 0.25 * (b - 1))

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "per_seq_s": self.per_seq_s,
                "draft_step_s": self.draft_step_s}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        return cls(list(d["tokens"]), list(d["seconds"]), float(d.get("per_seq_s", 0.0)),
                   dict(d.get("draft_step_s", {})))


class _Acceptance:
    """Decayed counts per depth d of: trials (depth d drafted and depth d-1 reached) and
    successes (depth d accepted); their ratio is the conditional acceptance alpha[d]."""

    def __init__(self, max_depth: int, decay: float):
        self.acc = np.zeros(max_depth)
        self.drafted = np.zeros(max_depth)
        self.decay = decay

    def update(self, depth: int, accepted: int) -> None:
        self.acc *= self.decay
        self.drafted *= self.decay
        self.drafted[: min(depth, accepted + 1)] += 1
        self.acc[: min(accepted, depth)] += 1

    def alpha(self, prior: np.ndarray, strength: float) -> np.ndarray:
        return (self.acc + prior * strength) / (self.drafted + strength)


class AdaptiveController:
    def __init__(self, spec: SpecConfig, cost: CostModel, decay: float = 0.9,
                 prior_strength: float = 2.0):
        self.max_k = spec.max_draft_tokens
        self.cost = cost
        self.decay = decay
        self.strength = prior_strength
        self._seq: dict[int, _Acceptance] = {}
        self._pool: dict[DrafterKind, _Acceptance] = {}
        self._scale = 1.0                      # measured / predicted step time (EMA)

    def _prior(self, kind: DrafterKind) -> np.ndarray:
        pool = self._pool.get(kind)
        if pool is None:
            return np.full(self.max_k, 0.5)
        return pool.alpha(np.full(self.max_k, 0.5), 4.0)

    def alphas(self, seq: SequenceState) -> np.ndarray:
        st = self._seq.get(seq.seq_id)
        prior = self._prior(seq.drafter)
        return prior if st is None else st.alpha(prior, self.strength)

    def budgets(self, seqs: list[SequenceState], max_seq_len: int) -> list[int]:
        forced = [s.request.num_draft_tokens for s in seqs]
        spec = [i for i, s in enumerate(seqs) if s.drafter is not DrafterKind.NONE and forced[i] is None]
        k_star = self.choose_k([self.alphas(seqs[i]) for i in spec], [seqs[i].drafter for i in spec],
                               len(seqs)) if spec else 0
        out = []
        for s, f in zip(seqs, forced):
            k = 0 if s.drafter is DrafterKind.NONE else (f if f is not None else k_star)
            out.append(min(k, self.max_k, s.draft_room()))
        return out

    def choose_k(self, alphas: list[np.ndarray], kinds: list[DrafterKind], batch: int) -> int:
        """argmax_k expected tokens per second for the batch (alphas of speculating rows)."""
        plain_rows = batch - len(alphas)
        best_k, best = 0, -1.0
        for k in range(self.max_k + 1):
            tokens = plain_rows + sum(1.0 + float(np.cumprod(a[:k]).sum()) for a in alphas)
            t = self.cost.verify(batch, k + 1) + sum(self.cost.draft(kd, batch, k) for kd in set(kinds))
            rate = tokens / t
            if rate > best * (1 + 1e-9):
                best_k, best = k, rate
        return best_k

    def observe(self, seq: SequenceState, draft, verdict, batch: int, draft_s: float,
                verify_s: float) -> None:
        depth = draft.tree.max_depth
        if depth == 0:
            return
        st = self._seq.setdefault(seq.seq_id, _Acceptance(self.max_k, self.decay))
        pool = self._pool.setdefault(seq.drafter, _Acceptance(self.max_k, 0.995))
        d = min(depth, self.max_k)
        st.update(d, verdict.num_accepted)
        pool.update(d, verdict.num_accepted)

    def forget(self, seq: SequenceState) -> None:
        self._seq.pop(seq.seq_id, None)
