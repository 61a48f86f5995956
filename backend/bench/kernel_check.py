"""`specdec check-kernels`: every Triton kernel against its numpy reference on this machine
(compiled on a GPU, in Triton's interpreter on a CPU), the command to run after moving to a new
GPU. Writes {"device": str, "kernels": [{"name", "cases", "max_abs_err", "ok"}, ...]}; for
tree_attention also whether one verify of a tree gives every node the bits of single steps along
its path (`bitwise_invariant`), and for verify the number of rows whose accepted path or final
token differs (`mismatched_rows`, max_abs_err is then the largest token-id difference); the TensorRT
plugins' kernel variants on the same cases (`plugin_kernel_equal`: bitwise the runtime kernel's
result; `plugin_mismatched_rows`: against the reference with float32 parameters); and the TensorRT engine
graph against the standard CPU graph (`engine_graph`: largest logit difference, and whether its
rejection_sample equals backend/verify.py).
"""
from __future__ import annotations

import os

import numpy as np

from backend.bench.provenance import write_result


def _setup() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    os.environ.setdefault("TRITON_INTERPRET", "1")        # before the kernels are defined
    return "cpu (Triton interpreter)"


def _attention_cases(rng):
    from plugins.reference import paths_of

    trees = [[[-1]], [[-1, 0, 1, 2, 3, 4, 5, 6]], [[-1, 0, 0, 1, 1, 2, 3, 5, 5]],
             [[-1, 0, 1, 2, -2, -2], [-1, 0, 0, 1, 3, 4], [-1, -2, -2, -2, -2, -2]]]
    shapes = [(4, 4, 32, 0), (6, 2, 64, 31), (8, 2, 64, 33), (32, 8, 128, 300)]   # hq, hkv, d, ctx
    for parents, (hq, hkv, d, ctx) in zip(trees, shapes):
        parents = np.array(parents, np.int32)
        b, t = parents.shape
        kc = rng.standard_normal((b + 1, hkv, ctx + 2 * t + 8, d)).astype(np.float32)
        yield (rng.standard_normal((b, t, hq, d)).astype(np.float32), kc,
               rng.standard_normal(kc.shape).astype(np.float32), rng.permutation(b + 1)[:b].astype(np.int32),
               np.full(b, ctx, np.int32), paths_of(parents), d ** -0.5)


def check_attention(dev: str, rng, quick: bool = False) -> dict:
    import torch

    from plugins import kernels
    from plugins.reference import tree_attention_ref

    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
    err, n, invariant, plugin_equal = 0.0, 0, True, True
    for q, kc, vc, slots, ctx, paths, scale in list(_attention_cases(rng))[: 2 if quick else None]:
        got = kernels.tree_attention(t(q), t(kc), t(vc), t(slots), t(ctx), t(paths), scale).cpu().numpy()
        err = max(err, float(np.abs(got - tree_attention_ref(q, kc, vc, slots, ctx, paths, scale)).max()))
        n += 1
        # the TensorRT plugin's kernel: this forward's nodes from k / v, not the cache
        cols = ctx[:, None] + np.arange(q.shape[1])
        k_new = kc[slots[:, None], :, cols]                          # [B, T, Hkv, D]
        v_new = vc[slots[:, None], :, cols]
        plug = kernels.tree_attention_plugin(t(q), t(k_new), t(v_new), t(kc), t(vc), t(slots), t(ctx),
                                             t(np.zeros_like(ctx)), t(paths), scale).cpu().numpy()
        plugin_equal &= bool(np.array_equal(plug, got))
        for j in range(q.shape[1]):                      # node j alone, its path committed
            path = paths[0, j][paths[0, j] >= 0]
            if path.size == 0:
                continue
            k1, v1 = kc.copy(), vc.copy()
            s, c = slots[0], ctx[0]
            k1[s, :, c:c + path.size], v1[s, :, c:c + path.size] = kc[s][:, c + path], vc[s][:, c + path]
            one = kernels.tree_attention(t(q[:1, j:j + 1]), t(k1), t(v1), t(slots[:1]),
                                         t(np.array([c + path.size - 1], np.int32)),
                                         t(np.zeros((1, 1, 1), np.int32)), scale).cpu().numpy()
            invariant &= bool(np.array_equal(one[0, 0], got[0, j]))
    return {"name": "tree_attention", "cases": n, "max_abs_err": err, "ok": err <= 1e-3 and invariant and plugin_equal,
            "bitwise_invariant": invariant, "plugin_kernel_equal": plugin_equal}


def check_verify(dev: str, rng, quick: bool = False) -> dict:
    import torch

    from plugins import kernels
    from plugins.reference import verify_ref

    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
    params = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (0.9, 0, 0.8, 0.0),
              (1.3, 0, 1.0, 0.1), (0.8, 25, 0.9, 0.02)]
    parents = np.array([[-1, 0, 1, 2, 3, -2], [-1, 0, 0, 1, 2, 4], [-1, -2, -2, -2, -2, -2],
                        [-1, 0, 1, 1, 2, 2], [-1, 0, 0, 0, 0, 0], [-1, 0, 1, 2, 3, 4]], np.int32)
    err, bad, n, plugin_bad = 0, 0, 0, 0
    for v in (1000,) if quick else (1000, 4099, 49152):
        b, tt = parents.shape
        logits = (rng.standard_normal((b, tt, v)) * 3).astype(np.float32)
        tokens = rng.integers(0, v, (b, tt))
        for r in range(b):
            for j in range(1, tt):
                if parents[r, j] >= 0 and rng.random() < 0.7:
                    tokens[r, j] = int(np.argmax(logits[r, parents[r, j]]))
        temp, topk, topp, minp = (np.array([p[i] for p in params]) for i in range(4))
        seeds = rng.integers(0, 2 ** 63, b, dtype=np.uint64)
        pos = rng.integers(0, 4000, b)
        ref = verify_ref(logits, tokens, parents, temp, topk, topp, minp, seeds, pos)
        got = kernels.verify(t(logits), t(tokens), t(parents), t(temp), t(topk.astype(np.int32)), t(topp),
                             t(minp), t(seeds.view(np.int64)), t(pos))
        for g, r in zip(got, ref):
            g = g.cpu().numpy()
            err = max(err, int(np.abs(g.astype(np.int64) - r.astype(np.int64)).max()))
        bad += int(np.sum(np.any(got[1].cpu().numpy() != ref[1], axis=1)))
        n += 1
        f32 = [a.astype(np.float32) for a in (temp, topp, minp)]          # the plugin's parameters
        ref32 = verify_ref(logits, tokens, parents, f32[0].astype(np.float64), topk, f32[1].astype(np.float64),
                           f32[2].astype(np.float64), seeds, pos)
        plug = kernels.verify_plugin(t(logits), t(tokens), t(parents), t(f32[0]), t(topk.astype(np.int32)),
                                     t(f32[1]), t(f32[2]), t(seeds.view(np.int64)), t(pos))
        plugin_bad += sum(int(np.sum(np.any(g.cpu().numpy() != r, axis=-1))) if r.ndim > 1 else
                          int(np.sum(g.cpu().numpy() != r)) for g, r in zip(plug, ref32))
    return {"name": "verify", "cases": n, "max_abs_err": float(err), "ok": err == 0 and plugin_bad == 0,
            "mismatched_rows": bad, "plugin_mismatched_rows": plugin_bad}


def check_engine_graph() -> dict:
    """The TensorRT engine graph on ONNX Runtime's CPU provider (its specdec:: ops by the
    references) against the standard CPU graph (bench/engine_check.py)."""
    import importlib.util

    missing = [m for m in ("onnxruntime", "onnxruntime_extensions") if importlib.util.find_spec(m) is None]
    if missing:                              # the `engine` extra; a GPU image may lack it (no ORT there)
        return {"name": "engine_graph", "cases": 0, "max_abs_err": float("nan"), "ok": False,
                "skipped": f"no module {', '.join(missing)} (the `engine` extra) on this machine"}
    from backend.bench import engine_check

    r = engine_check.compare()
    return {"name": "engine_graph", "cases": r["cases"], "max_abs_err": r["max_abs_err"],
            "ok": r["max_abs_err"] <= 1e-4 and r["verify_equal"], "rejection_sample_equal": r["verify_equal"]}


def run(json_path: str | None, quick: bool = False) -> dict:
    """quick: the two smallest attention cases and one vocabulary (the GPU check's dry run)."""
    device = _setup()
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    result = {"device": device, "quick": quick,
              "kernels": [check_attention(dev, rng, quick), check_verify(dev, rng, quick), check_engine_graph()]}
    if json_path:
        result = write_result(json_path, result)              # a correctness check: no thread count
    for k in result["kernels"]:
        print(f"{k['name']:15s} cases {k['cases']:3d}  max |err| {k['max_abs_err']:.3g}  "
              f"{'ok' if k['ok'] else 'FAILED'}")
    return result
