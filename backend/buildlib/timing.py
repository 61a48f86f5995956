"""Timing forwards and drafters for the cost model (builder/costs.py and the drafter kinds'
`time`): prefilled shapes timed round-robin, so a noisy spell on a shared machine lands on every
shape alike (the controller uses ratios between shapes), and the sequence a drafter reads.
"""
from __future__ import annotations

import statistics
import time

import numpy as np


class Shape:
    """`batch` sequences prefilled to `context` tokens, ready to time forwards of `t` new tokens
    each (the new columns are dropped after every forward, so the context stays put)."""

    def __init__(self, rt, batch: int, t: int, context: int, first_id: int, extra: dict | None = None):
        self.rt, self.extra = rt, extra
        self.rng = np.random.default_rng(first_id)
        self.ids = list(range(first_id, first_id + batch))
        for sid in self.ids:
            rt.alloc(sid)
        ctx_extra = None
        if extra:
            ctx_extra = {k: np.zeros((batch, context) + a.shape[2:], a.dtype) for k, a in extra.items()}
        v = rt.config.vocab_size
        rt.forward(self.ids, self.rng.integers(3, v, (batch, context)),
                   np.broadcast_to(np.arange(-1, context - 1, dtype=np.int32), (batch, context)).copy(),
                   np.full((batch, 1), context - 1), ctx_extra)
        rt.commit(self.ids, [np.arange(context)] * batch)
        self.tokens = (batch, t)
        self.parents = np.broadcast_to(np.arange(-1, t - 1, dtype=np.int32), (batch, t)).copy()
        self.index = np.broadcast_to(np.arange(t), (batch, t)).copy()
        self.times: list[float] = []
        self.time_one()                       # first forward of a shape allocates: not counted
        self.times.clear()

    def time_one(self) -> None:
        ids = self.rng.integers(3, self.rt.config.vocab_size, self.tokens)
        t0 = time.perf_counter()
        self.rt.forward(self.ids, ids, self.parents, self.index, self.extra)
        self.times.append(time.perf_counter() - t0)
        self.rt.commit(self.ids, [np.zeros(0, np.int64)] * len(self.ids))

    def close(self) -> float:
        for sid in self.ids:
            self.rt.free(sid)
        return statistics.median(self.times)


class TimingSeq:
    """What a drafter reads of a sequence: id, prompt, output, root."""

    def __init__(self, seq_id: int, prompt: list[int]):
        self.seq_id, self.prompt_ids, self.output_ids = seq_id, tuple(prompt), [prompt[-1]]

    def all_ids(self) -> list[int]:
        return list(self.prompt_ids) + self.output_ids

    @property
    def root(self) -> int:
        return self.output_ids[-1]


def step_and_catch_up(rt, context: int, reps: int, seed: int) -> tuple[float, float]:
    """A draft runtime's cost: (one 1-token step at `context`, seconds per token of catching up
    over a `context`-token prompt), medians of `reps` round-robin timings."""
    one, whole = time_round_robin([Shape(rt, 1, 1, context, seed), Shape(rt, 1, context, context, seed + 10)], reps)
    return one, max(0.0, (whole - one) / (context - 1))


def time_round_robin(shapes: list[Shape], reps: int) -> list[float]:
    for _ in range(reps):
        for s in shapes:
            s.time_one()
    return [s.close() for s in shapes]
