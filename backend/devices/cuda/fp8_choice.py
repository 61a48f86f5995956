"""Which FP8 recipe a build uses (runtime/fp8.py), chosen by measured quality: the fastest that
keeps the model's answers.

The measure is `specdec quality`'s (bench/quality.py), on 12 prompts of the build's own set
(the stdlib-docstring prompts, never the benchmark's) held out from the static scales'
calibration, which would flatter them on the prompts they were fitted to (measured: Gemma-3-270M
channel-tensor, KL 0.0124 on calibration prompts, 0.0184 on the public ones): the fp32 model's
greedy continuation of each prompt, then one teacher-forced forward of prompt + continuation per
candidate, and at every continuation position whether the candidate's top-1 token is fp32's,
and KL(fp32 || candidate).
FP8 is emulated here (quantize, dequantize, compute in float32), as on every CPU.

The bar is BAR (top-1 agreement >= 0.97 and mean KL <= 0.015). Candidates, in order:
  1. each recipe of fp8.RECIPES, fastest first, its weights rounded by GPTQ where the calibration
     holds the linears' Hessians, as every build's does (buildlib/fp8_gptq.py: the same codes and
     scales, so no slower; KL lower than rounding to nearest in every recipe measured, e.g.
     SmolLM2-135M block128 0.0224 -> 0.0179), else to nearest;
  2. then the two best of them (lowest KL: top-1 is the noisier) with their worst linears
     weight-only (input unquantized, weights still FP8): an eighth, a quarter, then all of the
     linears, by the per-linear check: a linear's output error from quantizing its input by the
     recipe, ||x W^T - q(x) W^T|| / ||x W^T|| over the probe prompts (FALLBACKS).
The first candidate that meets the bar is chosen; if none does, the best measured (KL, then
agreement) is, and the report says the bar was missed. The report goes into the manifest
(record.py: Fp8Record): the choice, the bar, every candidate measured.
Knows: the measure and the order of candidates. Does not know: files, devices.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from backend.runtime import fp8

BAR = {"top1_agreement": 0.97, "kl_mean": 0.015}
PROBE_PROMPTS, PROBE_PROMPT_TOKENS, PROBE_NEW_TOKENS = 12, 256, 48     # 576 positions
FALLBACKS = (8, 4, 1)         # weight-only: the worst 1/8, 1/4, then all of the linears (at least 1)


@dataclass
class Probe:
    """The fp32 reference on the probe prompts: each sequence (prompt + greedy continuation) and
    fp32's log-probabilities [n, V] at its last n positions."""

    sequences: list[tuple[np.ndarray, int]]
    logprobs: list[np.ndarray]

    @property
    def positions(self) -> int:
        return sum(n for _, n in self.sequences)


def _runtime(ck, tensors, max_seq_len: int, recipe=None, rows: int = 1):
    from backend.config import RuntimeOptions
    from backend.runtime.torch_rt import TorchRuntime

    return TorchRuntime(None, ck.config, ck.config.num_layers, max_seq_len, RuntimeOptions(max_sequences=rows),
                        "cpu", tensors=tensors, fp8_recipe=recipe)


def _chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)[None]


def _logprobs(rt, ids: np.ndarray, n: int) -> np.ndarray:
    """[n, V] log-probabilities at the positions predicting the last n tokens of `ids`."""
    rt.alloc(0)
    out = rt.forward([0], ids[None], _chain(ids.size), np.arange(ids.size - n - 1, ids.size - 1)[None])
    rt.free(0)
    z = out.logits[0].astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def reference(ck, prompts: list[list[int]], max_seq_len: int, new_tokens: int) -> Probe:
    """fp32's greedy continuations of `prompts` (all rows in one batch per step) and its
    log-probabilities along them."""
    from backend.buildlib.fp8 import engine_tensors as _tensors
    from backend.manifest import WeightFormat

    rt = _runtime(ck, _tensors(ck, WeightFormat.FP32, ck.config.num_layers, None), max_seq_len, rows=len(prompts))
    ids = [np.asarray(p[: max_seq_len - new_tokens - 2], np.int64) for p in prompts]
    last = []
    for s, p in enumerate(ids):
        rt.alloc(s)
        out = rt.forward([s], p[None], _chain(p.size), np.array([[p.size - 1]]))
        rt.commit([s], [np.arange(p.size)])
        last.append(int(np.argmax(out.logits[0, 0])))
    cont = [[t] for t in last]
    rows = list(range(len(ids)))
    for _ in range(new_tokens - 1):
        out = rt.forward(rows, np.array([[c[-1]] for c in cont]), np.full((len(rows), 1), -1, np.int32),
                         np.zeros((len(rows), 1), np.int64))
        rt.commit(rows, [np.array([0])] * len(rows))
        for c, lg in zip(cont, out.logits[:, 0]):
            c.append(int(np.argmax(lg)))
    rt.close()
    seqs = [(np.concatenate([p, np.asarray(c, np.int64)]), len(c)) for p, c in zip(ids, cont)]
    ref = _runtime(ck, _tensors(ck, WeightFormat.FP32, ck.config.num_layers, None), max_seq_len)
    logprobs = [_logprobs(ref, s, n).astype(np.float32) for s, n in seqs]
    ref.close()
    return Probe(seqs, logprobs)


def measure(ck, probe: Probe, recipe: fp8.Recipe, act_scales: dict | None, max_seq_len: int) -> dict:
    """Top-1 agreement and mean KL(fp32 || recipe) over the probe's continuation positions."""
    from backend.buildlib.fp8 import engine_tensors as _tensors
    from backend.manifest import WeightFormat

    rt = _runtime(ck, _tensors(ck, WeightFormat.FP8, ck.config.num_layers, act_scales, recipe), max_seq_len, recipe)
    agree, kl = [], []
    for (ids, n), a in zip(probe.sequences, probe.logprobs):
        b = _logprobs(rt, ids, n)
        a = a.astype(np.float64)
        agree.append(np.argmax(a, -1) == np.argmax(b, -1))
        kl.append(np.sum(np.exp(a) * (a - b), -1))
    rt.close()
    return {"top1_agreement": round(float(np.concatenate(agree).mean()), 4),
            "kl_mean": round(float(np.concatenate(kl).mean()), 5)}


def linear_errors(ck, probe: Probe, recipe: fp8.Recipe, act_scales: dict | None, max_seq_len: int,
                  rows: int = 256) -> dict[str, float]:
    """The per-linear check: each layer linear's relative output error from its input quantized
    by `recipe` (weights as the recipe stores them), over up to `rows` rows of each probe
    forward, run through the fp32 model."""
    import torch

    from backend.buildlib.fp8 import engine_tensors as _tensors
    from backend.manifest import WeightFormat

    rt = _runtime(ck, _tensors(ck, WeightFormat.FP32, ck.config.num_layers, None), max_seq_len)
    sums: dict[str, list[float]] = {}
    from backend.buildlib.fp8 import quantize_fp8

    for name, lin in rt.model.linears().items():
        w = fp8.dequantize_weight(*quantize_fp8(lin.w.float(), recipe, act_scales, name), recipe)
        act = (act_scales or {}).get(f"{name}.act_scale")
        acc = sums.setdefault(name, [0.0, 0.0])

        def observe(x, w=w, act=act, acc=acc):
            x = x[-rows:].float()
            y = x @ w.T
            acc[0] += float(((fp8.fake_quant_input(x, recipe, act) @ w.T - y) ** 2).sum())
            acc[1] += float((y ** 2).sum())
        lin.observe = observe
    with torch.no_grad():
        for ids, _ in probe.sequences:
            rt.alloc(0)
            rt.forward([0], ids[None], _chain(ids.size), np.array([[ids.size - 1]]))
            rt.free(0)
    rt.close()
    return {name: (e / max(y, 1e-30)) ** 0.5 for name, (e, y) in sums.items()}


def meets(q: dict) -> bool:
    return q["top1_agreement"] >= BAR["top1_agreement"] and q["kl_mean"] <= BAR["kl_mean"]


def choose(ck, prompts: list[list[int]], max_seq_len: int, act_scales: dict, log,
           new_tokens: int = PROBE_NEW_TOKENS, candidates=fp8.RECIPES) -> tuple[fp8.Recipe, dict]:
    """The recipe (with its weight-only linears) and the report for the manifest."""
    t0 = time.time()
    max_seq_len = min(max_seq_len, max(map(len, prompts)) + new_tokens + 2)     # the probe's KV, no more
    probe = reference(ck, prompts, max_seq_len, new_tokens)
    tried, by_label = [], {}

    def run(rec: fp8.Recipe) -> bool:
        by_label[rec.label] = rec
        q = measure(ck, probe, rec, act_scales, max_seq_len)
        tried.append({"recipe": rec.label, **q, "weight_only": list(rec.weight_only), "meets_bar": meets(q)})
        log(f"FP8 recipe {rec.label}: top-1 agreement {q['top1_agreement']:.4f}, KL {q['kl_mean']:.5f}"
            f"{'  (meets the bar)' if meets(q) else ''}")
        return meets(q)

    gptq = any(k.endswith(".hessian") for k in (act_scales or {}))
    order = [r.with_gptq() if gptq else r for r in candidates]
    chosen = next((r for r in order if run(r)), None)
    linears = ck.config.num_layers * 4
    ranked = [] if chosen is not None else sorted(                  # KL first: top-1 is the noisier
        order, key=lambda r: next((t["kl_mean"], -t["top1_agreement"]) for t in tried if t["recipe"] == r.label))
    for rec in ranked[:2]:
        errors = linear_errors(ck, probe, rec, act_scales, max_seq_len)
        worst = sorted(errors, key=errors.get, reverse=True)
        for k in dict.fromkeys(max(1, linears // f) for f in FALLBACKS):
            if run(rec.with_weight_only(worst[:k])):
                chosen = rec.with_weight_only(worst[:k])
                break
        if chosen is not None:
            break
    met = chosen is not None
    if not met:
        best = min(tried, key=lambda t: (t["kl_mean"], -t["top1_agreement"]))
        chosen = by_label[best["recipe"]]
        log(f"no FP8 recipe meets the bar {BAR}: using the best measured, {chosen.label}")
    report = {"recipe": chosen.to_json(), "meets_bar": met, "bar": BAR, "prompts": len(probe.sequences),
              "positions": probe.positions, "measured": tried, "seconds": round(time.time() - t0, 1)}
    return chosen, report
