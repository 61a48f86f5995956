"""Measure the cost model the adaptive controller uses (controller.CostModel): median time of one
target forward over M = B*T new tokens at a typical context, the extra cost of each additional
sequence in a batch, and the time of one draft-model step. Stored in the manifest at build time
(`specdec build`), so a server starts with numbers measured on its own machine."""
from __future__ import annotations

import statistics
import time

import numpy as np

from backend.manifest import EngineManifest

GRID = (1, 2, 4, 8, 16, 32, 64)


def _time_forward(rt, batch: int, t: int, context: int, reps: int, extra: dict | None = None) -> float:
    rng = np.random.default_rng(0)
    v = rt.config.vocab_size
    ids = list(range(20_000, 20_000 + batch))
    for sid in ids:
        rt.alloc(sid)
    ctx_extra = None
    if extra:
        ctx_extra = {k: np.zeros((batch, context) + a.shape[2:], a.dtype) for k, a in extra.items()}
    rt.forward(ids, rng.integers(3, v, (batch, context)),
               np.broadcast_to(np.arange(-1, context - 1, dtype=np.int32), (batch, context)).copy(),
               np.full((batch, 1), context - 1), ctx_extra)
    rt.commit(ids, [np.arange(context)] * batch)
    parents = np.broadcast_to(np.arange(-1, t - 1, dtype=np.int32), (batch, t)).copy()
    index = np.broadcast_to(np.arange(t), (batch, t)).copy()
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        rt.forward(ids, rng.integers(3, v, (batch, t)), parents, index, extra)
        times.append(time.perf_counter() - t0)
        rt.commit(ids, [np.zeros(0, np.int64)] * batch)
    for sid in ids:
        rt.free(sid)
    return statistics.median(times[1:])


def measure_cost_model(manifest: EngineManifest, context: int = 256, reps: int = 5) -> dict:
    from backend.engine import default_draft_model
    from backend.runtime import load_draft_runtime, load_runtime

    rt = load_runtime(manifest)
    seconds = [_time_forward(rt, 1, m, context, reps) for m in GRID]
    batched = _time_forward(rt, 4, 1, context, reps)
    rt.close()
    single4 = float(np.interp(4, GRID, seconds))
    per_seq = max(0.0, (batched - single4) / 3)
    draft_step = {"prompt-lookup": 0.0}
    name = default_draft_model(manifest)
    if name is not None:
        drt = load_draft_runtime(manifest, name)
        draft_step["draft-model"] = _time_forward(drt, 1, 1, context, reps)
        drt.close()
    if "eagle" in manifest.drafts:
        from backend.config import SpecConfig
        from backend.drafters.eagle import EagleDrafter

        spec = SpecConfig()
        head = EagleDrafter.from_manifest(manifest, spec).rt
        feats = {"features": np.zeros((1, spec.eagle_topk, manifest.model.hidden_size), np.float32)}
        draft_step["eagle"] = _time_forward(head, 1, spec.eagle_topk, context, reps, feats)
        head.close()
    return {"tokens": list(GRID), "seconds": [round(s, 6) for s in seconds],
            "per_seq_s": round(per_seq, 6), "draft_step_s": draft_step, "context": context}
