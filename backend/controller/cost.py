"""What a step costs: the build's measured model (CostModel) and its online correction
(CostCorrection) by the step times the decoder reports.

CostModel is measured at build time (builder/costs.py) and stored in the manifest: the target
forward over M = B * T new tokens, the extra cost per sequence, and per drafter (its traits'
`cost_key`) the seconds of one draft forward and of each catch-up token. Every drafter a server
runs must have its entry (`check_priced`): an unpriced drafter would look free.

CostCorrection scales verify(B, T) by the decayed ratio of measured to predicted time, kept per
batch band (1, 2-3, 4-7, 8-15, 16-31, 32+) and width band (1, 2-5, 6-9, 10-13, 14+), since the
build measured bare B = 1 forwards at one context, while live steps have longer contexts,
garbage columns and per-node acceptance work, which grow with B and T. A speculative band with
few observations is pulled toward the plain (T = 1) ratio of its batch band, and the draft
ratio of a batch band toward the next smaller band's. Unobserved ratios drift back to their
priors, so a bad spell does not switch speculation off for good.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.controller.estimators import DecayedRatio


class UnpricedDrafter(ValueError):
    pass


@dataclass
class CostModel:
    """Seconds of one target forward over B sequences x T tokens, plus draft costs."""

    tokens: list[int]                  # grid of M = B * T
    seconds: list[float]               # median forward time at each M (B = 1, context ~256)
    per_seq_s: float = 0.0             # extra time per additional sequence in a batch
    draft_step_s: dict[str, float] = field(default_factory=dict)   # cost key -> s per draft forward
    catch_up_s: dict[str, float] = field(default_factory=dict)     # cost key -> s per backlog token
    ragged: bool = False               # the target computes each row's own nodes only (padding free)

    def verify(self, b: int, t: int, nodes: float | None = None) -> float:
        """b rows x t tokens; on a ragged engine, `nodes` real nodes in all (default b * t)."""
        m = nodes if self.ragged and nodes is not None else b * t
        return float(np.interp(m, self.tokens, self.seconds, right=None)
                     if m <= self.tokens[-1] else
                     self.seconds[-1] * m / self.tokens[-1]) + self.per_seq_s * (b - 1)

    def draft(self, key: str, b: int, forwards: int) -> float:
        """Time of `forwards` sequential draft forwards for a batch of b sequences."""
        return self.draft_step_s[key] * forwards * (1 + 0.25 * (b - 1))

    def catch_up(self, key: str, rows: int, backlog: int) -> float:
        """Extra time of the catch-up forward when `rows` rows must first feed their draft model
        up to `backlog` tokens each (padded to the longest)."""
        return self.catch_up_s[key] * rows * backlog

    def check_priced(self, traits: dict) -> None:
        """Every drafter (name -> DrafterTraits) has its entries, or UnpricedDrafter says which."""
        for name, t in traits.items():
            missing = [table for table, have in (("draft_step_s", self.draft_step_s),
                                                 ("catch_up_s", self.catch_up_s if t.catches_up else None))
                       if have is not None and t.cost_key not in have]
            if missing:
                raise UnpricedDrafter(
                    f"drafter {name!r} has no cost entry {t.cost_key!r} in {' and '.join(missing)} of the "
                    f"cost model (priced: {sorted(self.draft_step_s)}); the adaptive controller would "
                    "treat it as free. Rebuild with `specdec build` so the build times it.")

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "per_seq_s": self.per_seq_s,
                "draft_step_s": self.draft_step_s, "catch_up_s": self.catch_up_s, "ragged": self.ragged}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        return cls(list(d["tokens"]), list(d["seconds"]), float(d.get("per_seq_s", 0.0)),
                   dict(d.get("draft_step_s", {})), dict(d.get("catch_up_s", {})), bool(d.get("ragged", False)))


WIDTH_BUCKETS = (1, 5, 9, 13, 10 ** 9)   # verify widths 1 | 2-5 | 6-9 | 10-13 | 14+
BATCH_BUCKETS = (1, 3, 7, 15, 31, 10 ** 9)   # batch 1 | 2-3 | 4-7 | 8-15 | 16-31 | 32+
SETTLE = 32                      # plain steps after a speculative one that pay for its garbage


def _band(bounds: tuple, value: int) -> int:
    return next(i for i, b in enumerate(bounds) if value <= b)


def _band_name(bounds: tuple, i: int) -> str:
    lo = 1 if i == 0 else bounds[i - 1] + 1
    hi = bounds[i]
    return str(lo) if hi == lo else (f"{lo}+" if hi >= 10 ** 9 else f"{lo}-{hi}")


class CostCorrection:
    """Measured / modelled verify time per (batch band, width band), and draft time per batch
    band (module docstring); `now` is the controller's step clock."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self._verify = [[DecayedRatio() for _ in WIDTH_BUCKETS] for _ in BATCH_BUCKETS]
        self._draft = [DecayedRatio() for _ in BATCH_BUCKETS]
        self._pending: dict[int, list] = {}    # batch band -> [width band, s, predicted s, steps]

    def verify_cost(self, batch: int, width: int, now: int, nodes: float | None = None) -> float:
        """Predicted seconds of a verify of `batch` rows x `width` tokens (`nodes` real ones), corrected."""
        return self.cost.verify(batch, width, nodes) * self.verify_ratio(batch, width, now)

    def verify_ratio(self, batch: int, width: int, now: int) -> float:
        # a speculative band with few observations leans on the plain ratio of its batch band
        # (learned at n=1, a spec ratio says nothing about B=8, where long contexts make every
        # forward dearer than the build's B=1 model)
        row = self._verify[_band(BATCH_BUCKETS, batch)]
        plain = row[0].value(now)
        return plain if width <= 1 else row[_band(WIDTH_BUCKETS, width)].value(now, plain)

    def draft_ratio(self, batch: int, now: int) -> float:
        i = _band(BATCH_BUCKETS, batch)
        prior = 1.0 if i == 0 else self._draft[i - 1].value(now)
        return self._draft[i].value(now, prior)

    def observe(self, batch: int, width: int, draft_s: float, verify_s: float,
                predicted_draft_s: float, now: int, nodes: int | None = None) -> None:
        """One verify of `batch` rows x `width` tokens took verify_s (forward + acceptance +
        commit), and its drafting draft_s against predicted_draft_s.

        A speculative step leaves garbage columns (rejected and padding nodes) in every row of
        the batch, until compaction copies them out; the plain steps after it are dearer, and
        the copy lands on whichever step triggers it. Measured on a fixed batch of 8 (three
        noisy runs): plain steps between speculative ones took 67-105 ms against 48-60 ms in a
        plain batch, and the plain ratio learned there made a 6-wide verify look 2.6x a plain
        step where it cost 3.2x. So a plain step's excess over a clean plain step, for SETTLE
        steps after a speculative step of its batch band, is charged to that speculative step,
        and the plain ratio learns from clean steps only."""
        predicted = self.cost.verify(batch, width, nodes)
        if predicted <= 0 or verify_s <= 0:
            return
        bi = _band(BATCH_BUCKETS, batch)
        if width > 1:
            self._settle(bi, now)
            self._pending[bi] = [_band(WIDTH_BUCKETS, width), verify_s, predicted, 0]
            if predicted_draft_s > 0 and draft_s > 0:
                self._draft[bi].update(draft_s / predicted_draft_s, now)
            return
        p = self._pending.get(bi)
        if p is None:
            self._verify[bi][0].update(verify_s / predicted, now)     # a clean plain step
            return
        p[1] += verify_s - predicted * self._verify[bi][0].value(now)  # the garbage's cost
        p[3] += 1
        if p[3] >= SETTLE:
            self._settle(bi, now)

    def _settle(self, bi: int, now: int) -> None:
        p = self._pending.pop(bi, None)
        if p is not None:
            self._verify[bi][p[0]].update(p[1] / p[2], now)

    def names(self, now: int) -> dict[str, float]:
        """verify_t{width band}_b{batch band} and draft_b{batch band} ratios as used."""
        out = {}
        for bi in range(len(BATCH_BUCKETS)):
            b = 1 if bi == 0 else BATCH_BUCKETS[bi - 1] + 1
            for wi in range(len(WIDTH_BUCKETS)):
                w = 1 if wi == 0 else WIDTH_BUCKETS[wi - 1] + 1
                out[f"verify_t{_band_name(WIDTH_BUCKETS, wi)}_b{_band_name(BATCH_BUCKETS, bi)}"] = \
                    self.verify_ratio(b, w, now)
            out[f"draft_b{_band_name(BATCH_BUCKETS, bi)}"] = self.draft_ratio(b, now)
        return out
