"""How much to speculate: controllers that choose each step's draft budget (the scheduler
asks them once per step).

FixedController: K from the request or the server config (0 = plain decoding).

AdaptiveController: for a batch of B sequences, chooses the draft length k that maximises
expected output tokens per second of the whole batch:

    E_i(k)   = 1 + sum_{j=1..k} prod_{d<=j} alpha_i[d]       expected tokens of sequence i
    time(k)  = verify(B, k + 1) + sum_i draft_i(k)            measured cost model
    k*       = argmax_k  sum_i E_i(k) / time'(k)              (k = 0 is plain decoding)
    time'(k) = time(0) + (1 + u) (time(k) - time(0))           priced with caution u = 0.25

The extra cost of speculating is priced 25% above its prediction: the prediction's error on a
live server grows with that extra cost (a wide verify at 8 streams, predicted 2.6-3.0 plain
steps, measured 3.2-4.5; at one stream a 6-wide verify is 1.2-1.3 steps and off by a few
percent), and a wrong bet on speculation costs more than a missed one gains. (A flat 5%
margin on throughput, used before, was too little at 8-16 streams.)

alpha_i[d] is the running probability that sequence i's depth-d draft token is accepted given
depth d-1 was (decayed counts, with the drafter's pooled statistics as the prior). The cost
model comes from measured forward times (build/costs.py, stored in the manifest) and is
corrected online: the decoder reports every step's batch, width and measured draft and verify
times, and verify(B, T) is scaled by the decayed ratio of measured to predicted time, kept per
batch band (1, 2-3, 4-7, 8-15, 16-31, 32+) and width band (1, 2-5, 6-9, 10-13, 14+), since the
build measured bare B = 1 forwards at one context, while live steps have longer contexts,
garbage columns and per-node acceptance work, which grow with B and T. A speculative band
with few observations is pulled toward the plain (T = 1) ratio of its batch band, and the
draft ratio of a batch band toward the next smaller band's. Unobserved ratios drift back to
their priors, so a bad spell does not switch speculation off for good.

Catch-up: a drafter with a model of its own (EAGLE head, draft model) must first feed it what
it has not seen: the whole prompt before a request's first draft, and every step it did not
draft before the next one. draft_i(k > 0) includes that forward, priced per backlog token by
the build (rows of a kind padded to the longest backlog) and spread over the drafting steps it
buys: the kind's measured mean drafting run, at most the tokens the request has left. At one
stream with the EAGLE head, a first tree after a 250-token prompt drafted for 24-44 ms against
10-19 ms later, and most requests drafted for one or two steps, so a short measured run makes
intermittent probing pay the catch-up nearly in full, while a drafter whose requests keep
drafting (a good draft model) pays it once over the whole run.
Everything is continuous in load and acceptance, so a small change in either makes a small
change in k (no thresholds).
Drafter state is independent of the budget, so switching speculation off and on is safe.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.config import DrafterKind, SpecConfig
from backend.sequence import SequenceState


class FixedController:
    wants_previews = False
    wants_backlogs = False

    def __init__(self, spec: SpecConfig, default_k: int = 4):
        self.k = spec.num_draft_tokens if spec.num_draft_tokens is not None else default_k
        self.max_k = spec.max_draft_tokens
        self.max_tree = spec.max_tree_nodes

    def budgets(self, seqs: list[SequenceState], max_seq_len: int, previews=None, backlogs=None) -> list[int]:
        out = []
        for s in seqs:
            k = s.request.num_draft_tokens if s.request.num_draft_tokens is not None else self.k
            limit = self.max_tree if s.drafter in (DrafterKind.EAGLE, DrafterKind.LOOKUP_EAGLE) else self.max_k
            out.append(0 if s.drafter is DrafterKind.NONE else min(k, limit, s.draft_room()))
        return out

    def observe(self, seq, draft, verdict, batch: int, draft_s: float, verify_s: float) -> None:
        return None

    def observe_step(self, batch: int, width: int, draft_s: float, verify_s: float) -> None:
        return None

    def corrections(self) -> dict[str, float]:
        return {}

    def forget(self, seq) -> None:
        return None


@dataclass
class CostModel:
    """Seconds of one target forward over B sequences x T tokens, plus draft costs."""

    tokens: list[int]                  # grid of M = B * T
    seconds: list[float]               # median forward time at each M (B = 1, context ~256)
    per_seq_s: float = 0.0             # extra time per additional sequence in a batch
    draft_step_s: dict[str, float] = field(default_factory=dict)   # drafter -> s per draft token
    catch_up_s: dict[str, float] = field(default_factory=dict)     # drafter -> s per backlog token

    def verify(self, b: int, t: int) -> float:
        m = b * t
        return float(np.interp(m, self.tokens, self.seconds, right=None)
                     if m <= self.tokens[-1] else
                     self.seconds[-1] * m / self.tokens[-1]) + self.per_seq_s * (b - 1)

    def draft(self, kind: DrafterKind, b: int, steps: int) -> float:
        """Time of `steps` sequential draft forwards for a batch of b sequences."""
        return self.draft_step_s.get(kind.value, 0.0) * steps * (1 + 0.25 * (b - 1))

    def catch_up(self, kind: DrafterKind, rows: int, backlog: int) -> float:
        """Extra time of the catch-up forward when `rows` rows of drafter `kind` must first
        feed their model up to `backlog` tokens each (padded to the longest)."""
        return self.catch_up_s.get(kind.value, 0.0) * rows * backlog

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "per_seq_s": self.per_seq_s,
                "draft_step_s": self.draft_step_s, "catch_up_s": self.catch_up_s}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        return cls(list(d["tokens"]), list(d["seconds"]), float(d.get("per_seq_s", 0.0)),
                   dict(d.get("draft_step_s", {})), dict(d.get("catch_up_s", {})))


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


class _Ratio:
    """Decayed mean of measured / predicted time; the prior (1.0 = the build-time model, or a
    related ratio passed in) counts as `strength` observations, and decay applies per step
    (`now` counts steps; applied lazily), observed or not."""

    def __init__(self, decay: float = 0.99, strength: float = 4.0, lo: float = 0.25, hi: float = 4.0):
        self.total = self.count = 0.0
        self.t = 0
        self.decay, self.strength, self.lo, self.hi = decay, strength, lo, hi

    def _age(self, now: int) -> None:
        if now > self.t:
            if self.count:
                f = self.decay ** (now - self.t)
                self.total *= f
                self.count *= f
            self.t = now

    def update(self, ratio: float, now: int) -> None:
        self._age(now)
        self.total += min(self.hi, max(self.lo, ratio))
        self.count += 1

    def value(self, now: int, prior: float = 1.0) -> float:
        self._age(now)
        return (self.total + self.strength * prior) / (self.count + self.strength)


WIDTH_BUCKETS = (1, 5, 9, 13, 10 ** 9)   # verify widths 1 | 2-5 | 6-9 | 10-13 | 14+


def _bucket(width: int) -> int:
    return next(i for i, w in enumerate(WIDTH_BUCKETS) if width <= w)


BATCH_BUCKETS = (1, 3, 7, 15, 31, 10 ** 9)   # batch 1 | 2-3 | 4-7 | 8-15 | 16-31 | 32+


def _bbucket(batch: int) -> int:
    return next(i for i, b in enumerate(BATCH_BUCKETS) if batch <= b)


SETTLE = 32                      # plain steps after a speculative one that pay for its garbage

TREE_SIZES = (4, 8, 12, 16)      # tree budgets the controller chooses between (tree drafters)

FRESH_DECAY = 0.9995             # per step: first-step evidence fades (half-life ~1400 steps)

RUN_PRIOR = 4.0                  # drafting steps a catch-up is expected to serve, until measured


class _Arm:
    """Decayed mean of tokens emitted per step when speculating with one tree size."""

    def __init__(self, prior: float, decay: float = 0.98, strength: float = 2.0):
        self.total, self.count = prior * strength, strength
        self.decay = decay
        self.observed = 0

    def update(self, emitted: int) -> None:
        self.total = self.total * self.decay + emitted
        self.count = self.count * self.decay + 1
        self.observed += 1

    @property
    def mean(self) -> float:
        return self.total / self.count


class AdaptiveController:
    """See the module docstring. Chain drafters (prompt lookup, draft model) are modelled by
    per-depth acceptance; tree drafters (EAGLE) by the measured tokens per step of each tree
    size in TREE_SIZES, per request, with the drafter's pooled yield as the prior (optimistic
    priors make untried sizes get tried; decay keeps adapting). A request that has not drafted
    yet expects the pooled yield only as far as first trees have borne it out (`_fresh_ratio`).

    Free drafters (prompt lookup) show what they would propose before the choice (`previews`,
    up to max_k tokens): a row with no match expects one token whatever k is and does not widen
    the verify. And every step's preview, whatever k was drafted of it (0 included), is scored
    against the tokens the row goes on to emit, over as many steps as it takes to differ or to
    run out: at each depth the emitted token equals a point-mass draft token x with exactly
    the probability that rejection sampling accepts x (p(x), greedy or sampled; a rejected
    x is never the recovered token), so this is an unbiased acceptance observation of the full
    preview depth at no cost. A request whose text turns repetitive after a bad spell is not
    locked out by its own estimate (k = 0 used to observe nothing), and depths beyond the k
    it has been using are learned without drafting them."""

    wants_previews = True
    wants_backlogs = True

    def __init__(self, spec: SpecConfig, cost: CostModel, tree_kinds: frozenset = frozenset({DrafterKind.EAGLE}),
                 decay: float = 0.9, prior_strength: float = 2.0, caution: float = 0.25):
        self.max_k = spec.max_draft_tokens
        self.caution = caution        # the extra cost of speculation is priced this much higher
        self.max_tree = spec.max_tree_nodes
        self.eagle_depth = spec.eagle_depth
        self.cost = cost
        self.tree_kinds = tree_kinds
        self.decay = decay
        self.strength = prior_strength
        self._seq: dict[int, _Acceptance] = {}
        self._pool: dict[DrafterKind, _Acceptance] = {}
        self._arms: dict[tuple[DrafterKind, int], _Arm] = {}      # pooled over requests
        self._seq_arms: dict[int, dict[int, _Arm]] = {}            # per request, pooled prior
        self._fresh: dict[DrafterKind, _Ratio] = {}                # first steps vs the pool
        self._runs: dict[DrafterKind, _Arm] = {}                   # drafting run lengths
        self._run_len: dict[int, int] = {}                         # seq id -> current run
        self._tracked: dict[int, list[list]] = {}                  # seq id -> [[preview, matched]]
        self._previews: dict[int, list[int]] = {}                  # this step's, per seq id
        # measured / modelled verify time per (batch band, width band), and draft time per batch
        # band; a speculative band with few observations leans on the plain ratio of the same
        # batch band (learned at n=1, a spec ratio says nothing about B=8, where long contexts
        # make every forward dearer than the build's B=1 model)
        self._corr = [[_Ratio() for _ in WIDTH_BUCKETS] for _ in BATCH_BUCKETS]
        self._draft_corr = [_Ratio() for _ in BATCH_BUCKETS]
        self._pending: dict[int, list] = {}    # batch band -> [width band, s, predicted s, steps]
        self._now = 0                                          # steps observed
        self._predicted_draft = 0.0                           # of the step just budgeted
        self._chain_ks = tuple(range(self.max_k + 1))          # candidate budgets per drafter kind
        self._tree_ks = (0,) + tuple(z for z in TREE_SIZES if z <= self.max_tree)

    # --- acceptance models -------------------------------------------------------------------
    def _prior(self, kind: DrafterKind) -> np.ndarray:
        pool = self._pool.get(kind)
        if pool is None:
            return np.full(self.max_k, 0.5)
        return pool.alpha(np.full(self.max_k, 0.5), 4.0)

    def alphas(self, seq: SequenceState, prior: np.ndarray | None = None) -> np.ndarray:
        st = self._seq.get(seq.seq_id)
        prior = self._prior(seq.drafter) if prior is None else prior
        return prior if st is None else st.alpha(prior, self.strength)

    def _chain_curve(self, seq: SequenceState, prior: np.ndarray | None = None) -> np.ndarray:
        """[max_k + 1]: expected tokens of a chain sequence's step, per budget k = 0..max_k."""
        return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(self.alphas(seq, prior)))))

    def _arm(self, kind: DrafterKind, size: int) -> _Arm:
        if (kind, size) not in self._arms:
            self._arms[(kind, size)] = _Arm(prior=1.0 + 3.0 * (1 - np.exp(-size / 6.0)))
        return self._arms[(kind, size)]

    def expected_tokens(self, seq: SequenceState, k: int) -> float:
        """E[tokens emitted in one step] for sequence `seq` with a draft budget of k."""
        if k <= 0 or seq.drafter is DrafterKind.NONE:
            return 1.0
        if seq.drafter in self.tree_kinds:
            size = max((z for z in TREE_SIZES if z <= min(k, self.max_tree)), default=0)
            return self._tree_yield(seq, size) if size else 1.0
        return float(self._chain_curve(seq)[min(k, self.max_k)])

    @staticmethod
    def _bounded(arm: _Arm, smaller: list[_Arm]) -> float:
        """An untried tree size is optimistic, but not far beyond what the next smaller tried
        size measured: a tree twice as big rarely yields much more (measured on the EAGLE head:
        probing 8/12/16 after 4 had shown ~1.5 tokens per step cost ~3% at one stream)."""
        if arm.observed >= 3:
            return arm.mean
        tried = [a for a in smaller if a.observed >= 3]
        return min(arm.mean, 1.25 * tried[-1].mean + 0.1) if tried else arm.mean

    def _arm_yield(self, kind: DrafterKind, size: int) -> float:
        """Pooled tokens per step of a tree size, over all requests of the drafter."""
        return self._bounded(self._arm(kind, size),
                             [self._arms[(kind, z)] for z in TREE_SIZES if z < size and (kind, z) in self._arms])

    def _tree_yield(self, seq: SequenceState, size: int) -> float:
        """This request's tokens per step at a tree size: its own decayed mean, with the pooled
        yield as the prior (a chat request and an edit request differ by 2x with one head; the
        pool alone made chat requests speculate on the strength of edit requests)."""
        arms = self._seq_arms.get(seq.seq_id, {})
        pooled = self._arm_yield(seq.drafter, size)
        if not arms:
            return 1.0 + self._fresh_ratio(seq.drafter) * (pooled - 1.0)
        if size in arms:
            return arms[size].mean
        # the request's own smaller tree bounds a larger untried one as soon as it has been
        # tried once (its mean already includes the pooled prior): a chat request whose 4-node
        # tree got nothing does not go on to probe 8, 12 and 16 nodes (measured: 8 probes,
        # 2 tokens, x0.93 on one request)
        tried = [arms[z] for z in sorted(arms) if z < size]
        return min(pooled, 1.25 * tried[-1].mean + 0.1) if tried else pooled

    def _fresh_ratio(self, kind: DrafterKind) -> float:
        """What a request's first tree has yielded beyond its one sure token, as a fraction of
        what the pool predicted for it (1 until measured; decays back to 1 over time). The pool
        learns mostly from requests that kept drafting because they drafted well, so it flatters
        a request that has not drafted yet: measured at one stream, first trees predicted 1.9-3.2
        tokens by the pool yielded 1.4 on average."""
        r = self._fresh.get(kind)
        return 1.0 if r is None else r.value(self._now)

    def verify_cost(self, batch: int, width: int) -> float:
        """Predicted seconds of a verify forward of `batch` rows x `width` tokens, corrected by
        the measured ratio of its batch band x width band."""
        return self.cost.verify(batch, width) * self._verify_ratio(batch, width)

    def _verify_ratio(self, batch: int, width: int) -> float:
        row = self._corr[_bbucket(batch)]
        plain = row[0].value(self._now)
        return plain if width <= 1 else row[_bucket(width)].value(self._now, plain)

    def _draft_ratio(self, batch: int) -> float:
        i = _bbucket(batch)
        prior = 1.0 if i == 0 else self._draft_corr[i - 1].value(self._now)
        return self._draft_corr[i].value(self._now, prior)

    def _draft_model_cost(self, kinds: set, batch: int, k: int) -> float:
        """The build-time model's draft time (uncorrected)."""
        total = 0.0
        for kd in kinds:
            steps = min(k, self.eagle_depth) if kd in self.tree_kinds else min(k, self.max_k)
            total += self.cost.draft(kd, batch, steps)
        return total

    # --- the choice --------------------------------------------------------------------------
    def budgets(self, seqs: list[SequenceState], max_seq_len: int,
                previews: list[list[int] | None] | None = None,
                backlogs: list[int] | None = None) -> list[int]:
        previews = previews or [None] * len(seqs)
        backlogs = backlogs or [0] * len(seqs)
        forced = [s.request.num_draft_tokens for s in seqs]
        rows = [i for i, (s, f) in enumerate(zip(seqs, forced)) if s.drafter is not DrafterKind.NONE and f is None]
        free = [seqs[i] for i in rows]
        avail = [None if previews[i] is None else len(previews[i]) for i in rows]
        behind = [backlogs[i] for i in rows]
        k_star = self.choose_k(free, len(seqs), avail, behind) if free else 0
        kinds = {s.drafter for s in free}
        self._predicted_draft = (self._draft_model_cost(kinds, len(seqs), k_star)
                                 + self._catch_up_cost(free, behind)) if k_star else 0.0
        out = []
        self._previews = {s.seq_id: pv for s, pv in zip(seqs, previews) if pv}
        for s, f in zip(seqs, forced):
            k = 0 if s.drafter is DrafterKind.NONE else (f if f is not None else k_star)
            limit = self.max_tree if s.drafter in self.tree_kinds else self.max_k
            out.append(min(k, limit, s.draft_room()))
        return out

    def _catch_up_cost(self, seqs: list[SequenceState], backlogs: list[int], amortised: bool = False) -> float:
        """The build-time model's price of the drafters' catch-up forwards (uncorrected): per
        drafter kind, its rows padded to the longest backlog. `amortised`: the share of this
        step, the catch-up being spread over the drafting steps it buys (the measured mean
        drafting run of the kind, at most the steps the rows have left)."""
        longest: dict[DrafterKind, list[int]] = {}
        for s, b in zip(seqs, backlogs):
            n_b_left = longest.setdefault(s.drafter, [0, 0, 1])
            n_b_left[0] += 1
            n_b_left[1] = max(n_b_left[1], b)
            n_b_left[2] = max(n_b_left[2], s.params.max_tokens - len(s.output_ids))
        total = 0.0
        for kd, (n, b, left) in longest.items():
            c = self.cost.catch_up(kd, n, b)
            total += c / max(1.0, min(self._run_mean(kd), left)) if amortised else c
        return total

    def _run_mean(self, kind: DrafterKind) -> float:
        arm = self._runs.get(kind)
        return RUN_PRIOR if arm is None else arm.mean

    def _track_run(self, seq: SequenceState, drafted: bool) -> None:
        """Count a request's consecutive drafting steps; a finished run updates its kind's mean."""
        n = self._run_len.get(seq.seq_id, 0)
        if drafted:
            self._run_len[seq.seq_id] = n + 1
        elif n:
            self._end_run(seq)

    def _end_run(self, seq: SequenceState) -> None:
        n = self._run_len.pop(seq.seq_id, 0)
        if n:
            self._runs.setdefault(seq.drafter, _Arm(prior=RUN_PRIOR, decay=0.9, strength=2.0)).update(n)

    def choose_k(self, seqs: list[SequenceState], batch: int, avail: list[int | None] | None = None,
                 backlogs: list[int] | None = None) -> int:
        """argmax_k expected output tokens per second of the whole batch (avail[i]: how many
        tokens sequence i's free drafter can propose, None = as many as asked; backlogs[i]:
        what its drafter must catch up on first, priced into every k > 0)."""
        avail = avail or [None] * len(seqs)
        catch_up = self._catch_up_cost(seqs, backlogs, amortised=True) if backlogs else 0.0
        plain_rows = batch - len(seqs)
        kinds = {s.drafter for s in seqs}
        trees = [s for s in seqs if s.drafter in self.tree_kinds]
        chains = [(s, a) for s, a in zip(seqs, avail) if s.drafter not in self.tree_kinds]
        chain_tokens = self._chain_tokens(chains)
        # the widest row sets the verify width: rows of free drafters only as wide as their match
        reach = max([self.max_tree] * bool(trees) + [self.max_k if a is None else a for _, a in chains])
        ks = set()                  # between tree sizes the yield is flat and the cost grows
        for kd in kinds:
            ks.update(self._tree_ks if kd in self.tree_kinds else self._chain_ks)
        draft_ratio = self._draft_ratio(batch)                  # once per step, not per k
        plain_cost = self.verify_cost(batch, 1)
        best_k, best = 0, -1.0
        for k in sorted(ks):
            if k > reach:
                break
            tokens = (plain_rows + chain_tokens[min(k, self.max_k)]
                      + sum(self.expected_tokens(s, k) for s in trees))
            cost = self.verify_cost(batch, k + 1)
            if k:
                cost += (self._draft_model_cost(kinds, batch, k) + catch_up) * draft_ratio
            rate = tokens / (plain_cost + (1 + self.caution) * (cost - plain_cost))
            if rate > best * (1 + 1e-9):
                best_k, best = k, rate
        return best_k

    def _chain_tokens(self, rows: list[tuple[SequenceState, int | None]]) -> np.ndarray:
        """[max_k + 1]: expected tokens of all chain rows together, per budget k, a row capped at
        what its free drafter can propose (one curve per row and one prior per drafter kind:
        expected_tokens per row and per k cost ~1 ms a step at 16 rows)."""
        total = np.zeros(self.max_k + 1)
        ks = np.arange(self.max_k + 1)
        priors: dict[DrafterKind, np.ndarray] = {}
        for s, a in rows:
            if s.drafter not in priors:
                priors[s.drafter] = self._prior(s.drafter)
            cap = self.max_k if a is None else min(a, self.max_k)
            total += self._chain_curve(s, priors[s.drafter])[np.minimum(ks, cap)]
        return total

    def observe(self, seq: SequenceState, draft, verdict, batch: int, draft_s: float,
                verify_s: float) -> None:
        depth = draft.tree.max_depth
        self._track_run(seq, depth > 0)
        if seq.drafter in self.tree_kinds:
            size = max((z for z in TREE_SIZES if z <= draft.num_draft_tokens), default=0)
            if depth and size:
                arms = self._seq_arms.setdefault(seq.seq_id, {})
                if not arms:                  # the request's first tree, against the pool's word
                    pooled = self._arm_yield(seq.drafter, size)
                    if pooled > 1.0:
                        fresh = self._fresh.setdefault(
                            seq.drafter, _Ratio(decay=FRESH_DECAY, strength=1.0, lo=0.0, hi=2.0))
                        fresh.update(verdict.num_accepted / (pooled - 1.0), self._now)
                if size not in arms:
                    arms[size] = _Arm(prior=self._tree_yield(seq, size), decay=0.9, strength=2.0)
                arms[size].update(verdict.num_accepted + 1)
                self._arm(seq.drafter, size).update(verdict.num_accepted + 1)
            return
        pv = self._previews.get(seq.seq_id)
        if pv is not None or seq.seq_id in self._tracked:
            self._track(seq, pv, verdict.output_ids)      # free drafter: score its previews
        elif depth:
            self._record_chain(seq, depth, verdict.num_accepted)

    def _record_chain(self, seq: SequenceState, depth: int, accepted: int) -> None:
        st = self._seq.setdefault(seq.seq_id, _Acceptance(self.max_k, self.decay))
        pool = self._pool.setdefault(seq.drafter, _Acceptance(self.max_k, 0.995))
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
            self._record_chain(seq, len(chain), m)
        if still:
            self._tracked[seq.seq_id] = still

    def observe_step(self, batch: int, width: int, draft_s: float, verify_s: float) -> None:
        """One verify of `batch` rows x `width` tokens took verify_s (forward + acceptance +
        commit): update the correction of its class.

        A speculative step leaves garbage columns (rejected and padding nodes) in every row of
        the batch, until compaction copies them out; the plain steps after it are dearer, and
        the copy lands on whichever step triggers it. Measured on a fixed batch of 8 (three
        noisy runs): plain steps between speculative ones took 67-105 ms against 48-60 ms in a
        plain batch, and the plain ratio learned there made a 6-wide verify look 2.6x a plain
        step where it cost 3.2x. So a
        plain step's excess over a clean plain step, for SETTLE steps after a speculative step
        of its batch band, is charged to that speculative step, and the plain ratio learns
        from clean steps only."""
        self._now += 1
        predicted = self.cost.verify(batch, width)
        if predicted <= 0 or verify_s <= 0:
            return
        bi = _bbucket(batch)
        if width > 1:
            self._settle(bi)
            self._pending[bi] = [_bucket(width), verify_s, predicted, 0]
            if self._predicted_draft > 0 and draft_s > 0:
                self._draft_corr[bi].update(draft_s / self._predicted_draft, self._now)
            return
        p = self._pending.get(bi)
        if p is None:
            self._corr[bi][0].update(verify_s / predicted, self._now)      # a clean plain step
            return
        p[1] += verify_s - predicted * self._corr[bi][0].value(self._now)   # the garbage's cost
        p[3] += 1
        if p[3] >= SETTLE:
            self._settle(bi)

    def _settle(self, bi: int) -> None:
        p = self._pending.pop(bi, None)
        if p is not None:
            self._corr[bi][p[0]].update(p[1] / p[2], self._now)

    def forget(self, seq: SequenceState) -> None:
        self._end_run(seq)
        self._seq.pop(seq.seq_id, None)
        self._seq_arms.pop(seq.seq_id, None)
        self._tracked.pop(seq.seq_id, None)

    def corrections(self) -> dict[str, float]:
        """Live / build-time cost ratios as used (the `specdec_cost_correction` gauges):
        verify_t{width band}_b{batch band} and draft_b{batch band}; and per tree drafter,
        fresh_yield_{kind}: the share of the pool's extra tokens a request that has not drafted
        yet is expected to get (first trees measured against the pool)."""
        def band(bounds, i):
            lo = 1 if i == 0 else bounds[i - 1] + 1
            hi = bounds[i]
            return str(lo) if hi == lo else (f"{lo}+" if hi >= 10 ** 9 else f"{lo}-{hi}")
        names = {}
        for bi in range(len(BATCH_BUCKETS)):
            b = 1 if bi == 0 else BATCH_BUCKETS[bi - 1] + 1
            for wi in range(len(WIDTH_BUCKETS)):
                w = 1 if wi == 0 else WIDTH_BUCKETS[wi - 1] + 1
                names[f"verify_t{band(WIDTH_BUCKETS, wi)}_b{band(BATCH_BUCKETS, bi)}"] = self._verify_ratio(b, w)
            names[f"draft_b{band(BATCH_BUCKETS, bi)}"] = self._draft_ratio(b)
        for kd in sorted(self.tree_kinds, key=lambda k: k.value):
            names[f"fresh_yield_{kd.value}"] = self._fresh_ratio(kd)
        return names
