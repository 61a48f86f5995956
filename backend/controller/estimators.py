"""Two decayed running means the controller's models are built from.

DecayedRatio: a ratio (measured / predicted) whose prior counts as `strength` observations and
whose evidence fades per step of a shared clock, observed or not (applied lazily).
DecayedMean: a mean of observations that fades per observation, with a prior that counts as
`strength` observations.
"""
from __future__ import annotations


class DecayedRatio:
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


class DecayedMean:
    def __init__(self, prior: float, decay: float = 0.98, strength: float = 2.0):
        self.total, self.count = prior * strength, strength
        self.decay = decay
        self.observed = 0

    def update(self, x: float) -> None:
        self.total = self.total * self.decay + x
        self.count = self.count * self.decay + 1
        self.observed += 1

    @property
    def mean(self) -> float:
        return self.total / self.count
