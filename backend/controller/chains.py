"""Acceptance of chain drafters (prompt lookup, draft model), per request and per depth.

alpha_i[d] is the running probability that request i's depth-d draft token is accepted given
depth d-1 was (decayed counts, with the drafter's pooled statistics as the prior), and

    E_i(k) = 1 + sum_{j=1..k} prod_{d<=j} alpha_i[d]      expected tokens of a k-token chain.

Free drafters (prompt lookup) show what they would propose before the choice (`previews`):
every step's preview, whatever k was drafted of it (0 included), is scored against the tokens
the row goes on to emit, over as many steps as it takes to differ or to run out. At each depth
the emitted token equals a point-mass draft token x with exactly the probability that
verification accepts x (p(x), greedy or sampled), so this is an unbiased acceptance observation
of the full preview depth at no cost: a request whose text turns repetitive after a bad spell
is not locked out by its own estimate, and depths beyond the k in use are learned without
drafting them.
"""
from __future__ import annotations

import numpy as np

from backend.config import DrafterKind
from backend.sequence import SequenceState


class _Depths:
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


class ChainAcceptance:
    def __init__(self, max_k: int, decay: float = 0.9, strength: float = 2.0):
        self.max_k = max_k
        self.decay, self.strength = decay, strength
        self._seq: dict[int, _Depths] = {}
        self._pool: dict[DrafterKind, _Depths] = {}
        self._tracked: dict[int, list[list]] = {}          # seq id -> [[preview, matched]]
        self._previews: dict[int, list[int]] = {}          # this step's, per seq id

    def prior(self, kind: DrafterKind) -> np.ndarray:
        pool = self._pool.get(kind)
        if pool is None:
            return np.full(self.max_k, 0.5)
        return pool.alpha(np.full(self.max_k, 0.5), 4.0)

    def alphas(self, seq: SequenceState, prior: np.ndarray | None = None) -> np.ndarray:
        st = self._seq.get(seq.seq_id)
        prior = self.prior(seq.drafter) if prior is None else prior
        return prior if st is None else st.alpha(prior, self.strength)

    def curve(self, seq: SequenceState, prior: np.ndarray | None = None) -> np.ndarray:
        """[max_k + 1]: expected tokens of the request's step, per budget k = 0..max_k."""
        return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(self.alphas(seq, prior)))))

    def batch_tokens(self, rows: list[tuple[SequenceState, int | None]]) -> np.ndarray:
        """[max_k + 1]: expected tokens of all chain rows together, per budget k, a row capped at
        what its free drafter can propose (one curve per row and one prior per drafter kind:
        a curve per row and per k cost ~1 ms a step at 16 rows)."""
        total = np.zeros(self.max_k + 1)
        ks = np.arange(self.max_k + 1)
        priors: dict[DrafterKind, np.ndarray] = {}
        for s, a in rows:
            if s.drafter not in priors:
                priors[s.drafter] = self.prior(s.drafter)
            cap = self.max_k if a is None else min(a, self.max_k)
            total += self.curve(s, priors[s.drafter])[np.minimum(ks, cap)]
        return total

    def set_previews(self, seqs: list[SequenceState], previews: list[list[int] | None]) -> None:
        self._previews = {s.seq_id: pv for s, pv in zip(seqs, previews) if pv}

    def observe(self, seq: SequenceState, depth: int, num_accepted: int, emitted) -> bool:
        """A step of a chain row: score its previews if its drafter shows them, else the draft.
        -> whether it was evidence (False: a drafter without previews that drafted nothing)."""
        pv = self._previews.get(seq.seq_id)
        if pv is not None or seq.seq_id in self._tracked:
            self._track(seq, pv, emitted)
            return True
        if depth:
            self._record(seq, depth, num_accepted)
        return bool(depth)

    def _record(self, seq: SequenceState, depth: int, accepted: int) -> None:
        st = self._seq.setdefault(seq.seq_id, _Depths(self.max_k, self.decay))
        pool = self._pool.setdefault(seq.drafter, _Depths(self.max_k, 0.995))
        d = min(depth, self.max_k)
        st.update(d, accepted)
        pool.update(d, accepted)

    def _track(self, seq: SequenceState, preview: list[int] | None, emitted) -> None:
        """The row emitted `emitted` this step: open a tracker for this step's preview, advance
        every open tracker along the emitted tokens, and record each one whose preview has
        differed from the text or run out as a chain verdict (depth = preview length)."""
        trackers = self._tracked.pop(seq.seq_id, [])
        if preview:
            trackers.append([preview, 0])
        emitted = [int(t) for t in emitted]
        still = []
        for tr in trackers:
            chain, m = tr
            for t in emitted:
                if t != chain[m]:
                    break
                m += 1
                if m == len(chain):
                    break
            else:
                tr[1] = m                                 # all matched so far: keep watching
                still.append(tr)
                continue
            self._record(seq, len(chain), m)
        if still:
            self._tracked[seq.seq_id] = still

    def forget(self, seq: SequenceState) -> None:
        self._seq.pop(seq.seq_id, None)
        self._tracked.pop(seq.seq_id, None)
