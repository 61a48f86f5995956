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

import statistics
import time

import numpy as np

from backend.manifest import EngineManifest

GRID = (1, 2, 4, 8, 16, 32, 64)


class _Shape:
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


class _TimingSeq:
    """What a drafter reads of a sequence: id, prompt, output, root."""

    def __init__(self, seq_id: int, prompt: list[int]):
        self.seq_id, self.prompt_ids, self.output_ids = seq_id, tuple(prompt), [prompt[-1]]

    def all_ids(self) -> list[int]:
        return list(self.prompt_ids) + self.output_ids

    @property
    def root(self) -> int:
        return self.output_ids[-1]


def _time_eagle(manifest: EngineManifest, context: int, reps: int, steps: int = 6) -> tuple[float, float]:
    """-> (seconds of a drafting step per tree depth, seconds per catch-up token): the head's
    propose() at the largest tree, once right after a `context`-token prompt (the catch-up over
    all of it) and then `steps` times one token later; medians over `reps` sequences."""
    from backend.config import SpecConfig
    from backend.drafters.eagle import EagleDrafter

    spec = SpecConfig()
    drafter = EagleDrafter.from_manifest(manifest, spec)
    rng = np.random.default_rng(0)
    v = manifest.model.vocab_size
    h = manifest.model.hidden_size * (1 + len(manifest.engine().feature_layers))   # the target's features
    budget = spec.max_tree_nodes
    first, steady = [], []
    for r in range(reps + 1):                   # the first sequence warms up: not counted
        seq = _TimingSeq(40_000 + r, rng.integers(3, v, context).tolist())
        drafter.begin(seq, rng.standard_normal((context, h)).astype(np.float32))
        for i in range(steps + 1):
            t0 = time.perf_counter()
            draft, = drafter.propose([seq], [budget])
            dt = time.perf_counter() - t0
            if r:
                (steady if i else first).append(dt)
            drafter.observe(seq, draft, np.array([0]), rng.standard_normal((1, h)).astype(np.float32))
            seq.output_ids.append(int(draft.tokens[-1]))
        drafter.end(seq)
    drafter.rt.close()
    step = statistics.median(steady)
    per_depth = step / min(spec.eagle_depth, budget)
    return per_depth, max(0.0, (statistics.median(first) - step) / (context - 1))


def _time_medusa(manifest: EngineManifest, reps: int) -> float:
    """Seconds of one Medusa proposal of every head for one sequence (host numpy)."""
    from backend.drafters.medusa import MedusaDrafter

    drafter = MedusaDrafter.from_manifest(manifest)
    h = np.random.default_rng(0).standard_normal((1, manifest.model.hidden_size)).astype(np.float32)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        drafter.heads(h, drafter.k).argmax(-1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _time_round_robin(shapes: list[_Shape], reps: int) -> list[float]:
    for _ in range(reps):
        for s in shapes:
            s.time_one()
    return [s.close() for s in shapes]


def measure_cost_model(manifest: EngineManifest, context: int = 256, reps: int = 7) -> dict:
    from backend.engine import default_draft_model
    from backend.runtime import load_runtime

    context = min(context, manifest.max_seq_len - GRID[-1] - 1, (manifest.max_seq_len - 1) // 2)  # tiny engines
    rt = load_runtime(manifest)
    shapes = [_Shape(rt, 1, m, context, 20_000 + 10 * i) for i, m in enumerate(GRID)]
    shapes.append(_Shape(rt, 4, 1, context, 30_000))
    *seconds, batched = _time_round_robin(shapes, reps)
    ragged = rt.ragged
    rt.close()
    single4 = float(np.interp(4, GRID, seconds))
    per_seq = max(0.0, (batched - single4) / 3)
    draft_step = {"prompt-lookup": 0.0}
    catch_up = {}
    name = default_draft_model(manifest)
    if name is not None:
        drt = load_runtime(manifest, engine=name)
        one, whole = _time_round_robin([_Shape(drt, 1, 1, context, 20_000),
                                        _Shape(drt, 1, context, context, 20_010)], reps)
        drt.close()
        draft_step["draft-model"] = one
        catch_up["draft-model"] = max(0.0, (whole - one) / (context - 1))
    if "eagle" in manifest.drafts:
        draft_step["eagle"], catch_up["eagle"] = _time_eagle(manifest, context, reps)
    if "medusa" in manifest.drafts:
        draft_step["medusa"] = _time_medusa(manifest, reps)
    return {"tokens": list(GRID), "seconds": [round(s, 6) for s in seconds],
            "per_seq_s": round(per_seq, 6), "draft_step_s": draft_step,
            "catch_up_s": {k: round(c, 8) for k, c in catch_up.items()}, "context": context, "ragged": ragged}
