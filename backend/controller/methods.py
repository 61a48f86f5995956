"""Which of a drafter's methods pays now: per step, the method with the most expected output
tokens per second, from decayed means of what each one measured (issue 28: a cross-vocabulary
draft chooses between SLEM chains and TLI, drafters/cross_vocab.py).

    rate(m) = (1 + accepted(m)) / (verify_s + forwards(m) * forward_s + extra_s(m))

accepted: draft tokens the target kept per step; forwards: draft forwards per step; extra_s:
measured host work per step beyond the forwards (re-tokenization). verify_s and forward_s are
the build's prices (the cost model), which only set the exchange rate between acceptance and
draft work. Estimates are kept per mode (greedy or sampled requests), where the methods differ
most: at temperature > 0 only a draft coupled to the target's noise keeps its acceptance.
Each method is tried MIN_TRIES times per mode first; after that the other method is tried again
once every EXPLORE steps, so an estimate that went stale can recover.
Knows: numbers per method name. Does not know: what a method does.
"""
from __future__ import annotations

from backend.controller.estimators import DecayedMean

MIN_TRIES = 3
EXPLORE = 16


class MethodChoice:
    def __init__(self, methods: tuple[str, ...], verify_s: float, forward_s: float, decay: float = 0.95):
        self.methods = methods
        self.verify_s, self.forward_s = max(verify_s, 1e-6), max(forward_s, 0.0)
        self.decay = decay
        self._means: dict[tuple[bool, str], tuple[DecayedMean, DecayedMean, DecayedMean]] = {}
        self._picks: dict[bool, int] = {}

    def _stats(self, mode: bool, m: str):
        if (mode, m) not in self._means:
            self._means[mode, m] = (DecayedMean(0.0, self.decay, 0.0), DecayedMean(1.0, self.decay, 0.0),
                                    DecayedMean(0.0, self.decay, 0.0))
        return self._means[mode, m]

    def rate(self, mode: bool, m: str) -> float:
        acc, fwd, extra = self._stats(mode, m)
        if not acc.observed:
            return float("inf")
        return (1.0 + acc.mean) / (self.verify_s + fwd.mean * self.forward_s + extra.mean)

    def pick(self, greedy: bool) -> str:
        """The method for one row's next draft."""
        tries = {m: self._stats(greedy, m)[0].observed for m in self.methods}
        fewest = min(self.methods, key=lambda m: tries[m])
        if tries[fewest] < MIN_TRIES:
            return fewest
        n = self._picks[greedy] = self._picks.get(greedy, 0) + 1
        ranked = sorted(self.methods, key=lambda m: -self.rate(greedy, m))
        return ranked[1] if n % EXPLORE == 0 and len(ranked) > 1 else ranked[0]

    def observe(self, greedy: bool, m: str, accepted: int, forwards: int, extra_s: float) -> None:
        acc, fwd, extra = self._stats(greedy, m)
        acc.update(accepted)
        fwd.update(forwards)
        extra.update(extra_s)

    def summary(self) -> dict:
        """{mode: {method: (tries, accepted per step, rate)}} for reports."""
        out: dict = {}
        for (mode, m), (acc, _, _) in self._means.items():
            out.setdefault("greedy" if mode else "sampled", {})[m] = (acc.observed, round(acc.mean, 3),
                                                                      round(self.rate(mode, m), 3))
        return out
