"""AdaptiveController: the draft budget that maximises the whole batch's expected output tokens
per second, from four models that meet in `choose_k`:

    tokens(k) = plain rows + sum over chain rows E_i(k)          chains.ChainAcceptance
                           + sum over tree rows yield_i(k)       trees.TreeYields
    time(k)   = verify(B, k + 1) * correction                    cost.CostModel, CostCorrection
              + (draft(k) + catch-up share) * draft correction   catch_up.CatchUp
    k*        = argmax_k tokens(k) / time'(k)                      (k = 0 is plain decoding)
    time'(k)  = time(0) + (1 + u) (time(k) - time(0))             priced with caution u = 0.25

A choice of plain decoding is held for up to HOLD_STEPS steps while nothing it was made from
has moved: the same rows, no draft verified (the acceptance models learn nothing), no catch-up
backlog shorter. Between those, only the online cost correction and a fresh request's trust in
the pool drift, by a fraction of a percent a step. An idle EAGLE drafter otherwise paid the
whole choice every step: ~0.12-0.2 ms at 4 rows, 1.5% of a native-engine step (perf-notes §13d).

The extra cost of speculating is priced 25% above its prediction: the prediction's error on a
live server grows with that extra cost (a wide verify at 8 streams, predicted 2.6-3.0 plain
steps, measured 3.2-4.5; at one stream a 6-wide verify is 1.2-1.3 steps and off by a few
percent), and a wrong bet on speculation costs more than a missed one gains. (A flat 5%
margin on throughput, used before, was too little at 8-16 streams.)

Whether a drafter is a tree or a chain, its largest budget, the draft forwards a budget costs
and its cost entry come from its traits (drafters/base.py). Everything is continuous in load and
acceptance, so a small change in either makes a small change in k (no thresholds). Drafter
state is independent of the budget, so switching speculation off and on is safe.
"""
from __future__ import annotations

from backend.config import DrafterKind
from backend.controller.catch_up import CatchUp
from backend.controller.chains import ChainAcceptance
from backend.controller.cost import CostCorrection, CostModel
from backend.controller.trees import TREE_SIZES, TreeYields, tree_size
from backend.sequence import SequenceState

HOLD_STEPS = 8                   # steps a plain-decoding choice is kept while its inputs hold


class AdaptiveController:
    wants_previews = True
    wants_backlogs = True

    def __init__(self, traits: dict, cost: CostModel, decay: float = 0.9,
                 prior_strength: float = 2.0, caution: float = 0.25):
        """traits: DrafterKind -> DrafterTraits of every drafter the decoder runs."""
        cost.check_priced({k.value: t for k, t in traits.items()})
        self.traits = traits
        self.cost = cost
        self.caution = caution        # the extra cost of speculation is priced this much higher
        self.max_k = max((t.max_budget for t in traits.values() if not t.tree), default=0)
        self.chains = ChainAcceptance(self.max_k, decay, prior_strength)
        self.trees = TreeYields()
        self.catch_up = CatchUp(cost, traits)
        self.correction = CostCorrection(cost)
        self._ks = {k: ((0,) + tuple(z for z in TREE_SIZES if z <= t.max_budget) if t.tree
                        else tuple(range(t.max_budget + 1))) for k, t in traits.items()}
        k_top = max((t.max_budget for t in traits.values()), default=0)
        self._sizes = {k: [tree_size(min(j, t.max_budget)) for j in range(k_top + 1)]   # budget -> tree size
                       for k, t in traits.items() if t.tree}
        self._now = 0                                  # steps observed: the models' clock
        self._predicted_draft = 0.0                    # of the step just budgeted
        self._learned = 0                              # acceptance evidence observed (a clock)
        self._hold = None                              # (rows key, backlogs, until step) of k* = 0

    def expected_tokens(self, seq: SequenceState, k: int) -> float:
        """E[tokens emitted in one step] for sequence `seq` with a draft budget of k."""
        if k <= 0 or seq.drafter is DrafterKind.NONE:
            return 1.0
        t = self.traits[seq.drafter]
        if t.tree:
            size = self._sizes[seq.drafter][min(k, t.max_budget)]
            return self.trees.expected(seq, size, self._now) if size else 1.0
        return float(self.chains.curve(seq)[min(k, self.max_k)])

    def verify_cost(self, batch: int, width: int, nodes: float | None = None) -> float:
        return self.correction.verify_cost(batch, width, self._now, nodes)

    def _draft_cost(self, kinds: set, batch: int, k: int) -> float:
        """The build-time model's draft time (uncorrected)."""
        return sum(self.cost.draft(self.traits[kd].cost_key, batch, self.traits[kd].forwards(k))
                   for kd in kinds)

    # --- the choice --------------------------------------------------------------------------
    def budgets(self, seqs: list[SequenceState], previews: list[list[int] | None] | None = None,
                backlogs: list[int] | None = None) -> list[int]:
        previews = previews or [None] * len(seqs)
        backlogs = backlogs or [0] * len(seqs)
        forced = [s.request.num_draft_tokens for s in seqs]
        rows = [i for i, (s, f) in enumerate(zip(seqs, forced)) if s.drafter is not DrafterKind.NONE and f is None]
        free = [seqs[i] for i in rows]
        avail = [None if previews[i] is None else len(previews[i]) for i in rows]
        behind = [backlogs[i] for i in rows]
        key = (len(seqs), tuple(s.seq_id for s in free), tuple(avail), self._learned)
        hold = self._hold
        if free and hold is not None and hold[0] == key and self._now < hold[2] \
                and all(b >= h for b, h in zip(behind, hold[1])):
            k_star = 0                    # held: nothing the plain choice was made from moved
        else:
            k_star = self.choose_k(free, len(seqs), avail, behind) if free else 0
            self._hold = (key, behind, self._now + HOLD_STEPS) if free and not k_star else None
        kinds = {s.drafter for s in free}
        self._predicted_draft = (self._draft_cost(kinds, len(seqs), k_star)
                                 + self.catch_up.cost_of(free, behind)) if k_star else 0.0
        self.chains.set_previews(seqs, previews)
        return [0 if s.drafter is DrafterKind.NONE else (f if f is not None else k_star)
                for s, f in zip(seqs, forced)]

    def choose_k(self, seqs: list[SequenceState], batch: int, avail: list[int | None] | None = None,
                 backlogs: list[int] | None = None) -> int:
        """argmax_k expected output tokens per second of the whole batch (avail[i]: how many
        tokens sequence i's free drafter can propose, None = as many as asked; backlogs[i]:
        what its drafter must catch up on first, priced into every k > 0)."""
        avail = avail or [None] * len(seqs)
        catch_up = self.catch_up.cost_of(seqs, backlogs, amortised=True) if backlogs else 0.0
        plain_rows = batch - len(seqs)
        kinds = {s.drafter for s in seqs}
        trees = [s for s in seqs if self.traits[s.drafter].tree]
        chains = [(s, a) for s, a in zip(seqs, avail) if not self.traits[s.drafter].tree]
        chain_tokens = self.chains.batch_tokens(chains)
        # the widest row sets the verify width: rows of free drafters only as wide as their match
        reach = max([self.traits[s.drafter].max_budget for s in trees]
                    + [self.traits[s.drafter].max_budget if a is None else a for s, a in chains])
        ks = set()                  # between tree sizes the yield is flat and the cost grows
        for kd in kinds:
            ks.update(self._ks[kd])
        draft_ratio = self.correction.draft_ratio(batch, self._now)       # once per step, not per k
        plain_cost = self.verify_cost(batch, 1)
        # per tree row, its tree size at each budget and its yield at each size (once, not per k)
        tree_rows = []
        for s in trees:
            sizes = self._sizes[s.drafter]
            tree_rows.append((sizes, {z: self.trees.expected(s, z, self._now) if z else 1.0 for z in set(sizes)}))
        best_k, best = 0, -1.0
        for k in sorted(ks):
            if k > reach:
                break
            tokens = (plain_rows + chain_tokens[min(k, self.max_k)]
                      + sum(y[sizes[k]] for sizes, y in tree_rows))
            # a ragged engine computes each row's own nodes: a row without a match costs one
            nodes = (plain_rows + sum(1 + min(k, self.traits[s.drafter].max_budget, k if a is None else a)
                                      for s, a in chains)
                     + sum(1 + sizes[k] for sizes, _ in tree_rows))
            cost = self.verify_cost(batch, k + 1, nodes)
            if k:
                cost += (self._draft_cost(kinds, batch, k) + catch_up) * draft_ratio
            rate = tokens / (plain_cost + (1 + self.caution) * (cost - plain_cost))
            if rate > best * (1 + 1e-9):
                best_k, best = k, rate
        return best_k

    # --- what happened -----------------------------------------------------------------------
    def observe(self, seq: SequenceState, draft, verdict) -> None:
        if seq.drafter is DrafterKind.NONE:
            return
        depth = draft.tree.max_depth
        if self.catch_up.track(seq, depth > 0):
            self._learned += 1                         # a drafting run ended: its mean moved
        if self.traits[seq.drafter].tree:
            size = tree_size(draft.num_draft_tokens)
            if depth and size:
                self.trees.observe(seq, size, verdict.num_accepted, self._now)
                self._learned += 1
            return
        if self.chains.observe(seq, depth, verdict.num_accepted, verdict.output_ids):
            self._learned += 1          # previews are scored every step; a draft model idle at
                                        # k = 0 shows none and learns nothing: the plain choice holds

    def observe_step(self, batch: int, width: int, draft_s: float, verify_s: float, nodes: int | None = None) -> None:
        self._now += 1
        self.correction.observe(batch, width, draft_s, verify_s, self._predicted_draft, self._now, nodes)

    def forget(self, seq: SequenceState) -> None:
        self._learned += 1                             # a drafting run may end
        self.catch_up.end_run(seq)
        self.chains.forget(seq)
        self.trees.forget(seq)

    def corrections(self) -> dict[str, float]:
        """Live / build-time cost ratios as used (the `specdec_cost_correction` gauges):
        verify_t{width band}_b{batch band} and draft_b{batch band}; and per tree drafter,
        fresh_yield_{kind}: the share of the pool's extra tokens a request that has not drafted
        yet is expected to get (first trees measured against the pool)."""
        out = self.correction.names(self._now)
        for kd in sorted((k for k, t in self.traits.items() if t.tree), key=lambda k: k.value):
            out[f"fresh_yield_{kd.value}"] = self.trees.fresh_ratio(kd, self._now)
        return out
