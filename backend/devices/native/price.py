"""What wide activations cost a user of a native engine on this machine: the price wide.decide
reads before it makes a fidelity choice the default (issue 53).

Three forwards after one prefilled context (PRICE_CONTEXT tokens), each as a server sends it:
a plain decode step (T=1), the verify of a speculative chain (VERIFY_ROWS rows, logits at every
row) and a prefill chunk (PREFILL_ROWS tokens, logits at the last). Wide activations double the
integer dots of the matrices they cover: a T=1 step bound by the weight read hides that, a
compute-bound prefill or verify pays most of it (the 3B shape's all-wide choice read +0.5% on a
one-thread step and cost prefill x1.82, perf-notes §37). Each shape is read in pairs, the two
settings one forward after the other, the order alternated pair by pair; its cost is the median
of the pairs' ratios (neighbours share the machine's state), and the price's cost the worst
shape's.

The thread count and the clock. The engine serves on all its threads, so the price runs there
too (the governor off: the configured count). Its OpenMP threads spin at the ~300 barriers of a
forward, so any CPU clock counts a thread's spinning while another process holds its partner's
core: at load 5 on the 2-vCPU Xeon, a 1B shape's 2-thread step read 441 ms wall and 145 ms of
CPU on each engine thread for ~20 ms of work, and every clock (wall, process CPU, the least or
the most busy thread's CPU) read `o` wide within a point of the others and diluted towards zero
(perf-notes §45). What stays honest is a forward no thread of this process was taken off its
core for (getrusage's involuntary context switches unchanged over it): on a machine whose cores
are all the engine's, nothing else ran meanwhile, so its wall time is the quiet machine's. A pair
counts only where both forwards were such. Where too few pairs are (a loaded machine preempts
almost every forward longer than a few ms), that shape is read on one engine thread by its CPU
time instead (no partner, no barrier, no spinning: perf-notes §38's robust clock, which misses
what a second thread changes), and the report says which clock each shape used. An engine
configured for one thread is read that way throughout.

Knows: the three forwards and how to read them. Does not know: which families to price, or what
the price decides (wide.py).
"""
from __future__ import annotations

import resource
import statistics
import time

import numpy as np

PRICE_CONTEXT = 128
VERIFY_ROWS, PREFILL_ROWS = 8, 64            # a speculative chain's verify; a prefill chunk
# pairs per shape: as many as fit SHAPE_S (after one forward of each setting, a warm-up), within
# [MIN_PAIRS, MAX_PAIRS]; at the serving count a shape gives up once more pairs were preempted
# than 2 x kept + 2 (3 in a row at first), or after SHAPE_S, and is then read on one thread
# (a loaded machine's 2-thread forwards spin: a 1B prefill chunk took 1.4 s there, ~0.3 s quiet)
SHAPE_S, MIN_PAIRS, MAX_PAIRS = 2.5, 3, 25
CLOCK_SERVING = "wall time of unpreempted forwards"
CLOCK_ONE = "thread CPU time, one engine thread"


class _Context:
    """Sequence 0 of `rt` prefilled with `context` (kept put); forward(ids, logits) runs one
    chain of len(ids) tokens after it and drops it again -> (wall s, thread CPU s, preempted)."""

    def __init__(self, rt, context: np.ndarray):
        self.rt, n = rt, context.size
        rt.alloc(0)
        rt.forward([0], context[None], np.arange(-1, n - 1, dtype=np.int32)[None], np.full((1, 1), n - 1))
        rt.commit([0], [np.arange(n)])

    def forward(self, ids: np.ndarray, logits: np.ndarray) -> tuple[float, float, bool]:
        t = ids.size
        switched, wall, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw, time.perf_counter(), time.thread_time()
        self.rt.forward([0], ids[None], np.arange(-1, t - 1, dtype=np.int32)[None], logits[None])
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        preempted = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw != switched
        self.rt.commit([0], [np.array([], np.int64)])
        return wall, cpu, preempted


def _pairs(ctx: _Context, set_wide, wide: tuple[str, ...], ids: np.ndarray, logits: np.ndarray,
           serving: bool) -> list[tuple[float, float]] | None:
    """(int8 ms, wide ms) pairs of one shape by the clock `serving` names; None where too many
    forwards at the serving count were preempted to read it."""
    def one(w) -> tuple[float, bool]:
        set_wide(w)
        wall, cpu, preempted = ctx.forward(ids, logits)
        return 1000 * (wall if serving else cpu), preempted and serving

    (warm, _), _ = one(()), one(wide)
    want = int(np.clip(SHAPE_S * 1000 / max(2 * warm, 1e-3), MIN_PAIRS, MAX_PAIRS))
    got, lost, t0 = [], 0, time.perf_counter()
    while len(got) < want:
        if serving and time.perf_counter() - t0 > SHAPE_S:
            return got if len(got) >= MIN_PAIRS else None
        order = ((), wide) if (len(got) + lost) % 2 else (wide, ())
        a, b = (one(w) for w in order)
        if a[1] or b[1]:
            lost += 1
            if lost > 2 * len(got) + 2:
                return got if len(got) >= MIN_PAIRS else None
            continue
        got.append((b[0], a[0]) if order[0] else (a[0], b[0]))     # (int8, wide); wide=() an A/A
    return got


def read(rt, wide: tuple[str, ...], prompt: list[int]) -> dict:
    """The three shapes' readings of `wide` against int8 after the prompt's first PRICE_CONTEXT
    tokens (fewer where the engine's positions leave no room) -> {"threads", "shapes": {name:
    {"rows", "clock", "threads", "ms_int8", "ms_wide", "cost", "pairs"}}, "cost", "worst"}; rt
    left with none wide, its governor as it was."""
    from backend.runtime.cores import CoreGovernor

    toks = np.asarray(list(prompt), np.int64)
    rows = min(PREFILL_ROWS, toks.size // 2)            # a tiny model's positions may be fewer
    ctx_n = min(PRICE_CONTEXT, toks.size - rows)
    chunk = np.resize(toks, ctx_n + rows)[ctx_n:]
    shapes = {"step": (chunk[:1], np.zeros(1, np.int64)),
              "verify": (chunk[:VERIFY_ROWS], np.arange(min(VERIFY_ROWS, rows))),
              "prefill": (chunk, np.array([rows - 1]))}
    threads = serving = rt.threads
    governor, rt.governor = rt.governor, CoreGovernor(threads, on=False)
    ctx, out = _Context(rt, toks[:ctx_n]), {}
    try:
        for name, (ids, logits) in shapes.items():
            # the shapes go shortest first: after one a loaded machine preempted, the longer
            # ones go straight to one thread
            got = _pairs(ctx, rt.model.set_wide, wide, ids, logits, serving=True) if serving > 1 else None
            used = serving = threads if got is not None else 1
            if got is None:
                rt.governor = CoreGovernor(1, on=False)
                got = _pairs(ctx, rt.model.set_wide, wide, ids, logits, serving=False)
                rt.governor = CoreGovernor(threads, on=False)
            a, b = (statistics.median(x) for x in zip(*got))
            out[name] = {"rows": int(ids.size), "clock": CLOCK_SERVING if used > 1 else CLOCK_ONE, "threads": used,
                         "ms_int8": round(a, 3), "ms_wide": round(b, 3),
                         "cost": round(statistics.median(w / i for i, w in got) - 1, 4), "pairs": len(got)}
    finally:
        rt.governor = governor
        rt.free(0)
        rt.model.set_wide(())
    worst = max(out, key=lambda k: out[k]["cost"])
    return {"threads": threads, "shapes": out, "cost": out[worst]["cost"], "worst": worst}
