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
CPU on each engine thread for ~42 ms of work, and every clock (wall, process CPU, the least or
the most busy thread's CPU) scattered alike: `o` wide's verify +10% with an IQR of -3%..+25%
where one thread's CPU time read +3.4% (perf-notes §45). Nor does counting the forwards no
thread was preempted in help: getrusage's involuntary switches rose in every 2-thread forward here
even with other processes at 0.1 of a core (a kernel thread's). So the serving count's wall
clock is read where the machine is otherwise idle: other processes kept at most QUIET_OTHERS of
a core busy over the shape's readings (the governor's measure, runtime/cores.py OtherLoad:
/proc/stat's busy time less this process's CPU time). Elsewhere that shape and the longer ones after it are read on one engine
thread by its CPU time (no partner, no barrier, no spinning: perf-notes §38's robust clock, which
misses what a second thread changes), and the report says which clock each shape used. An engine
configured for one thread is read that way throughout.

Knows: the three forwards and how to read them. Does not know: which families to price, or what
the price decides (wide.py).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

PRICE_CONTEXT = 128
VERIFY_ROWS, PREFILL_ROWS = 8, 64            # a speculative chain's verify; a prefill chunk
# pairs per shape: as many as fit SHAPE_S (after one forward of each setting, a warm-up), within
# [MIN_PAIRS, MAX_PAIRS]
SHAPE_S, MIN_PAIRS, MAX_PAIRS = 2.5, 3, 25
# the serving count's readings stand where other processes kept at most QUIET_OTHERS of a core
# busy over them (the governor's measure, runtime/cores.py; a kernel thread here takes ~0.1);
# checked from CHECK_S on, so a loaded machine costs a shape ~CHECK_S before it goes to one thread
QUIET_OTHERS, CHECK_S = 0.3, 0.3
CLOCK_SERVING = "wall time, the cores otherwise idle"
CLOCK_ONE = "thread CPU time, one engine thread"


class _Context:
    """Sequence 0 of `rt` prefilled with `context` (kept put); forward(ids, logits) runs one
    chain of len(ids) tokens after it and drops it again -> (wall s, this thread's CPU s)."""

    def __init__(self, rt, context: np.ndarray):
        self.rt, n = rt, context.size
        rt.alloc(0)
        rt.forward([0], context[None], np.arange(-1, n - 1, dtype=np.int32)[None], np.full((1, 1), n - 1))
        rt.commit([0], [np.arange(n)])

    def forward(self, ids: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
        t = ids.size
        wall, cpu = time.perf_counter(), time.thread_time()
        self.rt.forward([0], ids[None], np.arange(-1, t - 1, dtype=np.int32)[None], logits[None])
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        self.rt.commit([0], [np.array([], np.int64)])
        return wall, cpu


def _pairs(ctx: _Context, set_wide, wide: tuple[str, ...], ids: np.ndarray, logits: np.ndarray,
           serving: bool) -> list[tuple[float, float]] | None:
    """(int8 ms, wide ms) pairs of one shape, by the wall clock (`serving`) or this thread's CPU
    time; None where other processes kept more than QUIET_OTHERS of a core busy meanwhile."""
    def one(w) -> float:
        set_wide(w)
        wall, cpu = ctx.forward(ids, logits)
        return 1000 * (wall if serving else cpu)

    from backend.runtime.cores import OtherLoad

    others = OtherLoad() if serving else None
    warm, _ = one(()), one(wide)
    want = int(np.clip(SHAPE_S * 1000 / max(2 * warm, 1e-3), MIN_PAIRS, MAX_PAIRS))
    got = []
    while len(got) < want:
        order = ((), wide) if len(got) % 2 else (wide, ())
        a, b = one(order[0]), one(order[1])
        got.append((b, a) if order[0] else (a, b))        # (int8, wide); wide=() an A/A
        if others is not None and (others.elapsed() > CHECK_S or len(got) == want) and others.cores() > QUIET_OTHERS:
            return None
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
            # the shapes go shortest first: after one found the cores busy, the longer ones go
            # straight to one thread
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
