"""`specdec bench-engine`: the cost of one target forward and plain greedy decoding speed.

Measures, per weight format, the median time of one forward over T new tokens (T = 1, 2, 4, 8,
16, 32, 64) at context 256 and 1024 for batch sizes 1, 4, 8; batch invariance (largest logit
difference between one T-token verify forward and T single steps); and plain greedy
tokens/s on the public prompts. Prints a table, writes JSON and a PNG plot.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from backend.bench.prompt_sets import prompt_ids
from backend.manifest import EngineManifest

TOKENS = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (256, 1024)
BATCHES = (1, 4, 8)


def _forward_ms(rt, batch: int, context: int, t: int, reps: int) -> float:
    rng = np.random.default_rng(0)
    v = rt.config.vocab_size
    ids = list(range(10_000, 10_000 + batch))
    for sid in ids:
        rt.alloc(sid)
    # build the context in chunks (one group of `batch` sequences)
    done = 0
    while done < context:
        n = min(512, context - done)
        toks = rng.integers(3, v, (batch, n))
        rt.forward(ids, toks, np.broadcast_to(np.arange(-1, n - 1, dtype=np.int32), (batch, n)).copy(),
                   np.full((batch, 1), n - 1))
        rt.commit(ids, [np.arange(n)] * batch)
        done += n
    parents = np.broadcast_to(np.arange(-1, t - 1, dtype=np.int32), (batch, t)).copy()
    index = np.broadcast_to(np.arange(t), (batch, t)).copy()
    times = []
    for _ in range(reps + 2):
        toks = rng.integers(3, v, (batch, t))
        t0 = time.perf_counter()
        rt.forward(ids, toks, parents, index)
        times.append(time.perf_counter() - t0)
        rt.commit(ids, [np.array([], np.int64)] * batch)   # keep the context length fixed
    for sid in ids:
        rt.free(sid)
    return 1000 * statistics.median(times[2:])


def greedy_tokens_per_s(manifest: EngineManifest, fmt: str, prompts: list[dict], max_new: int,
                       decode_only: bool = True, drafter: str = "none", wide: tuple[str, ...] | None = None) -> dict:
    """Greedy decoding (EOS ignored) through the same decoder the server uses: plain (drafter
    "none": decode-only tokens/s by default) or speculative with `drafter` ("auto": the
    server's adaptive default, its drafters and cost model as `specdec serve` makes them).
    wide: plain decoding on the gguf engine with these wide families instead of its own."""
    from backend.config import DrafterKind, SamplingParams, ServeConfig
    from backend.decoder import SpecDecoder
    from backend.engine import make_decoder
    from backend.devices import load_runtime
    from backend.sequence import Request
    from backend.tokenizer import Tokenizer

    tok = Tokenizer.from_manifest(manifest)
    kind = DrafterKind(drafter)
    if kind is DrafterKind.NONE:
        dec = SpecDecoder(load_runtime(manifest, fmt), tok, {})
        if wide is not None:
            dec.target.model.set_wide(wide)
    else:
        dec = make_decoder(ServeConfig(engine_dir=str(manifest.root), weight_format=fmt), manifest)
    total_tokens, total_s, per_prompt = 0, 0.0, []
    for i, item in enumerate([prompts[0]] + prompts):   # first one is a warm-up
        ids = prompt_ids(tok, item["messages"])
        req = Request(tuple(ids), SamplingParams(max_tokens=max_new, ignore_eos=True), kind)
        t0 = time.perf_counter()
        first_at, n, out_ids = None, 0, []
        for out in dec.generate(req):
            n += len(out.new_ids)
            out_ids.extend(int(x) for x in out.new_ids)
            if first_at is None:
                first_at = time.perf_counter()
        t1 = time.perf_counter()
        if i == 0:
            continue
        tokens, secs = (n - 1, t1 - first_at) if decode_only else (n, t1 - t0)
        total_tokens += tokens
        total_s += secs
        per_prompt.append({"id": item["id"], "tokens": tokens, "seconds": round(secs, 4),
                           "prefill_ms": round(1000 * (first_at - t0), 2),
                           "tokens_per_s": round(tokens / secs, 2), "token_ids": out_ids})
    dec.target.close()
    return {"tokens_per_s": total_tokens / total_s, "per_prompt": per_prompt}


def run(manifest: EngineManifest, prompts: list[dict], out_json: Path | None, plot: Path | None,
        formats: list[str] | None = None, reps: int = 10, max_new: int = 64,
        quick: bool = False) -> dict:
    from backend.build.check import measure_invariance
    from backend.devices import load_runtime

    formats = formats or list(manifest.engines)
    tokens = TOKENS if not quick else (1, 2, 4, 8)
    contexts = CONTEXTS if not quick else (256,)
    batches = BATCHES if not quick else (1, 4)
    rows, invariance, plain = [], {}, {}
    for fmt in formats:
        rt = load_runtime(manifest, fmt)
        for b in batches:
            for ctx in contexts:
                for t in tokens:
                    ms = _forward_ms(rt, b, ctx, t, reps)
                    rows.append({"format": fmt, "batch": b, "context": ctx, "tokens": t, "ms": round(ms, 3)})
                    print(f"{fmt:5s} B={b:<2d} ctx={ctx:<5d} T={t:<3d} {ms:8.2f} ms", flush=True)
        rt.close()
        invariance[fmt] = measure_invariance(manifest, manifest.engine(fmt))
        plain[fmt] = greedy_tokens_per_s(manifest, fmt, prompts, max_new)
        print(f"{fmt}: plain greedy {plain[fmt]['tokens_per_s']:.1f} tok/s (decode only); "
              f"batch invariance max |diff| = {invariance[fmt]:.3g}", flush=True)
    default = manifest.default_format.value
    result = {
        "forward_ms": rows,
        "default_format": default,
        "plain_tokens_per_s": plain[default]["tokens_per_s"] if default in plain else None,
        "plain_tokens_per_s_by_format": {k: v["tokens_per_s"] for k, v in plain.items()},
        "plain_per_prompt": {k: v["per_prompt"] for k, v in plain.items()},
        "batch_invariance_max_abs_diff": invariance,
        "cost_ratio_t4_over_t1": _ratios(rows, 4),
        "max_new_tokens": max_new,
    }
    _print_table(result)
    if out_json:
        Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    if plot:
        _plot(result, Path(plot))
    return result


def wide_ab(manifest: EngineManifest, prompts: list[dict], specs: list[str], reps: int, max_new: int,
            out_json: Path | None) -> dict:
    """The cost of wide activations on the gguf engine, its settings in `specs` (wide_choice.parse's
    forms, or "built": the manifest's own) alternated in one process: the median forward at B=1,
    context 256, T = 1, 4, 8, and plain greedy decode-only tokens/s, each setting's runs
    interleaved with the others' (rep r runs the settings in rotated order)."""
    from backend.build import wide_choice
    from backend.devices import load_runtime

    built = manifest.engine("gguf").wide_activations
    sets = {s: built if s == "built" else wide_choice.parse(s) for s in specs}
    assert all(v is not None for v in sets.values()), "auto is a build-time choice: name it 'built'"
    ms: dict = {s: {t: [] for t in (1, 4, 8)} for s in sets}
    tps: dict = {s: [] for s in sets}
    rt = load_runtime(manifest, "gguf")
    for r in range(reps):
        order = list(sets)[r % len(sets):] + list(sets)[:r % len(sets)]
        for s in order:
            rt.model.set_wide(sets[s])
            for t in ms[s]:
                ms[s][t].append(_forward_ms(rt, 1, 256, t, 5))
            tps[s].append(greedy_tokens_per_s(manifest, "gguf", prompts, max_new, wide=sets[s])["tokens_per_s"])
    rt.close()
    base = specs[0]
    result = {"settings": {s: list(v) for s, v in sets.items()}, "reps": reps, "max_new_tokens": max_new,
              "forward_ms_b1_ctx256": {s: {t: round(statistics.median(v), 3) for t, v in d.items()} for s, d in ms.items()},
              "plain_tokens_per_s": {s: round(statistics.median(v), 2) for s, v in tps.items()}}
    result["plain_ratio_to_" + base] = {s: round(result["plain_tokens_per_s"][s] / result["plain_tokens_per_s"][base], 3)
                                        for s in sets}
    for s in sets:
        f = result["forward_ms_b1_ctx256"][s]
        print(f"{s:24s} {list(sets[s]) or 'none'}: forward T=1/4/8 {f[1]:.2f}/{f[4]:.2f}/{f[8]:.2f} ms, "
              f"plain {result['plain_tokens_per_s'][s]:.1f} tok/s (x{result['plain_ratio_to_' + base][s]:.3f})", flush=True)
    if out_json:
        Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _ratios(rows, t: int) -> dict:
    out = {}
    for r in rows:
        if r["batch"] == 1 and r["tokens"] == t:
            base = next(x for x in rows if x["format"] == r["format"] and x["batch"] == 1
                        and x["context"] == r["context"] and x["tokens"] == 1)
            out[f"{r['format']}@{r['context']}"] = round(r["ms"] / base["ms"], 3)
    return out


def _print_table(result: dict) -> None:
    rows = result["forward_ms"]
    keys = sorted({(r["format"], r["batch"], r["context"]) for r in rows})
    toks = sorted({r["tokens"] for r in rows})
    print("\nforward ms (median)   " + "".join(f"T={t:<7d}" for t in toks))
    for fmt, b, ctx in keys:
        cells = {r["tokens"]: r["ms"] for r in rows if (r["format"], r["batch"], r["context"]) == (fmt, b, ctx)}
        print(f"{fmt:5s} B={b:<2d} ctx={ctx:<5d}  " + "".join(f"{cells.get(t, float('nan')):<9.2f}" for t in toks))
    print(f"cost(T=4)/cost(T=1): {result['cost_ratio_t4_over_t1']}")
    print(f"plain greedy tok/s: {result['plain_tokens_per_s_by_format']} (default {result['default_format']})")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["forward_ms"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for key in sorted({(r["format"], r["batch"], r["context"]) for r in rows}):
        pts = sorted((r["tokens"], r["ms"]) for r in rows if (r["format"], r["batch"], r["context"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{key[0]} B={key[1]} ctx={key[2]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens per sequence (T)")
    ax.set_ylabel("forward time, ms (median)")
    ax.set_title("specdec CPU engine: cost of one target forward")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
