"""Measure the cost model the adaptive controller uses (controller.CostModel): median time of one
target forward over M = B*T new tokens at a typical context, the extra cost of each additional
sequence in a batch, and the time of one draft-model step. Stored in the manifest at build time
(`specdec build`), so a server starts with numbers measured on its own machine.

Drafters with a model of their own also pay a catch-up: before drafting, the model is fed every
token it has not seen (the whole prompt, the first time; the steps it did not draft, after a
plain spell). Its price per backlog token is `catch_up_s`. The EAGLE head is timed as the
drafter runs it (catch-up, tree forwards and the tree search in Python, which took as long as
the head's forwards: a bare-forward model under-priced a step by ~2x), at the largest tree.

The shapes are timed round-robin (one forward of each shape per round, medians over rounds), so
a noisy spell on a shared machine lands on every shape alike instead of on whichever shape was
being timed then: the controller uses ratios between shapes, and a single inflated shape used to
decide whether a cold server speculates at all."""
from __future__ import annotations

import numpy as np

from backend.manifest import EngineManifest

GRID = (1, 2, 4, 8, 16, 32, 64)


def measure_cost_model(manifest: EngineManifest, context: int = 256, reps: int = 7) -> dict:
    from backend import draft_kinds
    from backend.buildlib.timing import Shape, time_round_robin
    from backend.devices import load_runtime

    context = min(context, manifest.max_seq_len - GRID[-1] - 1, (manifest.max_seq_len - 1) // 2)  # tiny engines
    rt = load_runtime(manifest)
    shapes = [Shape(rt, 1, m, context, 20_000 + 10 * i) for i, m in enumerate(GRID)]
    shapes.append(Shape(rt, 4, 1, context, 30_000))
    *seconds, batched = time_round_robin(shapes, reps)
    ragged = rt.ragged
    rt.close()
    single4 = float(np.interp(4, GRID, seconds))
    per_seq = max(0.0, (batched - single4) / 3)
    draft_step, catch_up = {}, {}
    for kind in draft_kinds.KINDS:                 # each kind times the drafters it serves here
        for key, (step, catch) in kind.time(manifest, context, reps).items():
            draft_step[key] = step
            if catch is not None:
                catch_up[key] = catch
    return {"tokens": list(GRID), "seconds": [round(s, 6) for s in seconds],
            "per_seq_s": round(per_seq, 6), "draft_step_s": draft_step,
            "catch_up_s": {k: round(c, 8) for k, c in catch_up.items()}, "context": context, "ragged": ragged}
