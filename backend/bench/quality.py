"""`specdec quality --format fp8 --reference fp32`: what a weight format does to the model's
predictions, teacher-forced. For each prompt, the reference format's greedy continuation; then
one forward of prompt + continuation in both formats, and at every continuation position the
share where both pick the same top-1 token and KL(reference || format). FP8 on a machine without
FP8 tensor cores (this CPU) is the same recipe emulated: the build's scales, quantize then
dequantize. Writes {"top1_agreement", "kl_mean", "format", "reference", "prompts": [...]}.
"""
from __future__ import annotations

import numpy as np

from backend.bench.prompt_sets import prompt_ids
from backend.bench.provenance import engine_threads, write_result


def _greedy(rt, ids: list[int], n: int) -> list[int]:
    rt.alloc(0)
    out = rt.forward([0], np.asarray(ids)[None], np.arange(-1, len(ids) - 1, dtype=np.int32)[None],
                     np.array([[len(ids) - 1]]))
    rt.commit([0], [np.arange(len(ids))])
    cont = [int(np.argmax(out.logits[0, 0]))]
    while len(cont) < n:
        out = rt.forward([0], np.array([[cont[-1]]]), np.array([[-1]], np.int32), np.zeros((1, 1), np.int64))
        rt.commit([0], [np.array([0])])
        cont.append(int(np.argmax(out.logits[0, 0])))
    rt.free(0)
    return cont


def _teacher_forced(rt, ids: list[int], n: int) -> np.ndarray:
    """[n, V] float64 log-probabilities at the positions that predict the last n tokens of `ids`
    (position i predicts token i + 1)."""
    rt.alloc(1)
    rows = np.arange(len(ids) - n - 1, len(ids) - 1)[None]
    out = rt.forward([1], np.asarray(ids)[None], np.arange(-1, len(ids) - 1, dtype=np.int32)[None], rows)
    rt.free(1)
    z = out.logits[0].astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def run(engine_dir: str, fmt: str, reference: str, prompts: list[dict], max_new_tokens: int,
        json_path: str | None) -> dict:
    from backend.config import RuntimeOptions
    from backend.manifest import EngineManifest
    from backend.devices import load_runtime
    from backend.tokenizer import Tokenizer

    m = EngineManifest.load(engine_dir)
    tok = Tokenizer.from_manifest(m)
    opts = RuntimeOptions(max_sequences=2)
    ref_rt, rt = load_runtime(m, reference, options=opts), load_runtime(m, fmt, options=opts)
    per, agree, kls = [], [], []
    for p in prompts:
        ids = prompt_ids(tok, p["messages"])
        cont = _greedy(ref_rt, ids, max_new_tokens)
        full = ids + cont
        a, b = _teacher_forced(ref_rt, full, len(cont)), _teacher_forced(rt, full, len(cont))
        same = np.argmax(a, -1) == np.argmax(b, -1)
        kl = np.sum(np.exp(a) * (a - b), -1)
        agree.append(same)
        kls.append(kl)
        per.append({"id": p.get("id"), "kind": p.get("kind"), "positions": int(same.size),
                    "top1_agreement": float(same.mean()), "kl_mean": float(kl.mean())})
        print(f"{str(p.get('id')):24s} top-1 agreement {same.mean():.3f}  KL {kl.mean():.4f}")
    result = {"format": fmt, "reference": reference, "engine": str(m.root), "gpu": m.gpu,
              "max_new_tokens": max_new_tokens,
              "top1_agreement": float(np.concatenate(agree).mean()),
              "kl_mean": float(np.concatenate(kls).mean()), "prompts": per}
    print(f"overall: top-1 agreement {result['top1_agreement']:.4f}, mean KL {result['kl_mean']:.5f} "
          f"({sum(x['positions'] for x in per)} positions, {len(per)} prompts)")
    if json_path:
        result = write_result(json_path, result, engine_threads(opts))
    return result
