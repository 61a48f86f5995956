"""KV groups under continuous batching: sequences leave (idle rows), join (into an idle row or a
new row, without copying the batch) and are reordered, and every logit stays exactly what the
sequence gets decoded alone (the batch invariance greedy identity rests on)."""
import numpy as np


def _prefill(rt, sid, prompt):
    n = len(prompt)
    rt.alloc(sid)
    rt.forward([sid], np.asarray(prompt)[None], np.arange(-1, n - 1, dtype=np.int32)[None], np.array([[n - 1]]))
    rt.commit([sid], [np.arange(n)])


def _step(rt, sids, tokens):
    b = len(sids)
    out = rt.forward(sids, np.asarray(tokens)[:, None], np.full((b, 1), -1, np.int32), np.zeros((b, 1), np.int64))
    logits = out.logits[:, 0].copy()
    rt.commit(sids, [np.arange(1)] * b)
    return logits


def test_join_leave_reorder_is_exact_and_copies_only_when_needed(fp32_runtime):
    rt = fp32_runtime
    rng = np.random.default_rng(7)
    base = 9000
    prompts = {base + i: rng.integers(3, 40000, n).tolist()
               for i, n in enumerate((37, 80, 15, 52, 20, 300, 10))}
    feed = {sid: rng.integers(3, 40000, 12).tolist() for sid in prompts}
    regroups = []
    real = rt.groups._regroup
    rt.groups._regroup = lambda ids: regroups.append(list(ids)) or real(ids)
    try:
        got: dict[tuple[int, int], np.ndarray] = {}
        pos = {sid: 0 for sid in prompts}

        def step(sids):
            logits = _step(rt, sids, [feed[s][pos[s]] for s in sids])
            for s, row in zip(sids, logits):
                got[(s, pos[s])] = row
                pos[s] += 1

        a, b, c, d, e, f, g = sorted(prompts)
        for sid in (a, b, c, d):
            _prefill(rt, sid, prompts[sid])
        step([a, b, c, d])                        # four singletons merge: one copy
        n_first = len(regroups)
        step([a, b, c, d])
        rt.free(b)                                # leaves: its row idles
        step([a, c, d])
        step([a, c, d])
        _prefill(rt, e, prompts[e])
        step([a, c, d, e])                        # joins into the idle row
        _prefill(rt, g, prompts[g])
        step([d, a, e, c, g])                     # joins as a new row, order shuffled
        step([a, c, d, e, g])
        assert len(regroups) == n_first, regroups  # no copy of the batch since the first merge
        _prefill(rt, f, prompts[f])               # longer than the group: one copy
        step([a, c, d, e, g, f])
        step([a, c, d, e, g, f])
        for sid in (a, c, d, e, g, f):
            rt.free(sid)
    finally:
        rt.groups._regroup = real
    assert rt.num_sequences() == 0
    for sid in prompts:                           # reference: each sequence decoded alone
        n = max([k for (s, k) in got if s == sid], default=-1) + 1
        if not n:
            continue
        _prefill(rt, sid + 100, prompts[sid])
        for k in range(n):
            ref = _step(rt, [sid + 100], [feed[sid][k]])[0]
            assert np.array_equal(ref, got[(sid, k)]), (sid, k, float(np.abs(ref - got[(sid, k)]).max()))
        rt.free(sid + 100)
