"""`specdec bench-engine`: the cost of one target forward and plain greedy decoding speed.

Measures, per weight format, the median time of one forward over T new tokens (T = 1, 2, 4, 8,
16, 32, 64) at context 256 and 1024 for batch sizes 1, 4, 8; batch invariance (largest logit
difference between one T-token verify forward and T single steps); and plain greedy
tokens/s on the public prompts. Prints a table, writes JSON and a PNG plot.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from backend.bench.prompt_sets import prompt_ids
from backend.bench.provenance import engine_threads, write_result
from backend.errors import UserError
from backend.manifest import EngineManifest

TOKENS = (1, 2, 4, 8, 16, 32, 64)
ISAS = ("amx", "avx512", "default")      # bench-engine --isa: tiles, the vector path, tiles where there are
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
    from backend.builder.check import measure_invariance
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
        write_result(out_json, result, threads=engine_threads())
    if plot:
        _plot(result, Path(plot))
    return result


def _prefill_tokens_per_s(rt, n: int, reps: int) -> float:
    """Prompt tokens per second of one n-token prefill forward (a new request's time to first token)."""
    rng = np.random.default_rng(1)
    parents = np.arange(-1, n - 1, dtype=np.int32)[None]
    times = []
    for _ in range(reps + 1):
        rt.alloc(20_000)
        t0 = time.perf_counter()
        rt.forward([20_000], rng.integers(3, rt.config.vocab_size, (1, n)), parents, np.full((1, 1), n - 1))
        times.append(time.perf_counter() - t0)
        rt.free(20_000)
    return n / statistics.median(times[1:])


def _ab_point(rt, manifest, prompts, max_new: int, wide) -> dict:
    """One setting's readings: forward ms at B=1 ctx 256 (T = 1, 4, 8, 16) and B=8 (T = 1, 4), a
    256-token prefill's tokens/s, plain greedy decode-only tokens/s."""
    out = {f"b1_t{t}": _forward_ms(rt, 1, 256, t, 5) for t in (1, 4, 8, 16)}
    out.update({f"b8_t{t}": _forward_ms(rt, 8, 256, t, 3) for t in (1, 4)})
    out["prefill_tokens_per_s"] = _prefill_tokens_per_s(rt, 256, 2)
    out["plain_tokens_per_s"] = greedy_tokens_per_s(manifest, "gguf", prompts, max_new, wide=wide)["tokens_per_s"]
    return out


def ab(manifest: EngineManifest, prompts: list[dict], wides: list[str], isas: list[str], reps: int, max_new: int,
       out_json: Path | None) -> dict:
    """The gguf engine under every (matmul path, wide families) setting alternated in one process:
    paths from `isas` ("amx" tiles, the build's vector path "avx512", or "default": tiles where the
    CPU has them; runtime/native.use_tiles),
    wide families from `wides` (devices/native/wide.parse's forms, or "built": the manifest's own). Each
    rep runs the settings in rotated order; medians over reps. Ratios: each setting against the
    first (the baseline), forward costs against T = 1 of the same setting."""
    from backend.devices.native import NativeRecord, wide as wide_choice
    from backend.devices import load_runtime
    from backend.runtime import native

    built = NativeRecord.of(manifest.engine("gguf")).wide_activations
    sets = {f"{i}/{w}": (i, built if w == "built" else wide_choice.parse(w)) for i in isas for w in wides}
    assert all(v[1] is not None for v in sets.values()), "auto is a build-time choice: name it 'built'"
    assert all(i in ISAS for i in isas), isas
    got: dict = {s: [] for s in sets}
    loaded = native.isa() == "amx"                   # the path SPECDEC_ISA gave at load, restored after
    rt = load_runtime(manifest, "gguf")
    for r in range(reps):
        order = list(sets)[r % len(sets):] + list(sets)[:r % len(sets)]
        for s in order:
            isa, wide = sets[s]
            if native.use_tiles(isa != "avx512") != "amx" and isa == "amx":
                raise UserError("--isa amx: this CPU or OS gives no AMX tiles")
            rt.model.set_wide(wide)
            got[s].append(_ab_point(rt, manifest, prompts, max_new, wide))
    rt.close()
    native.use_tiles(loaded)
    med = {s: {k: round(statistics.median(p[k] for p in v), 3) for k in v[0]} for s, v in got.items()}
    base = next(iter(sets))
    result = {"settings": {s: {"isa": v[0], "wide": list(v[1])} for s, v in sets.items()}, "reps": reps,
              "max_new_tokens": max_new, "context": 256, "median": med,
              "cost_over_t1": {s: {k: round(m[k] / m[k.split("_")[0] + "_t1"], 3) for k in m if k.startswith("b")}
                               for s, m in med.items()},
              "ratio_to_" + base: {s: {k: round(m[k] / med[base][k], 3) for k in m} for s, m in med.items()}}
    for s, m in med.items():
        c = result["cost_over_t1"][s]
        print(f"{s:22s} T=1 {m['b1_t1']:.2f} ms, cost(4/8/16)/cost(1) {c['b1_t4']:.2f}/{c['b1_t8']:.2f}/"
              f"{c['b1_t16']:.2f}, B=8 T=4/T=1 {c['b8_t4']:.2f}, prefill {m['prefill_tokens_per_s']:.0f} tok/s, "
              f"plain {m['plain_tokens_per_s']:.1f} tok/s (x{result['ratio_to_' + base][s]['plain_tokens_per_s']:.3f})",
              flush=True)
    if out_json:
        write_result(out_json, result, threads=engine_threads())
    return result


def verify_ms(rt, toks: np.ndarray, clock) -> tuple[float, np.ndarray]:
    """One forward of toks [1, T] as a chain after the runtime's sequence 0 (its context kept) ->
    (ms by `clock`, the logits); benchmarks/ab_native_trees.py times its trees with it too."""
    t = toks.shape[1]
    t0 = clock()
    out = rt.forward([0], toks, np.arange(-1, t - 1, dtype=np.int32)[None], np.arange(t)[None])
    ms = 1000 * (clock() - t0)
    rt.commit([0], [np.array([], np.int64)])
    return ms, out.logits.copy()


def ab_builds(manifest: EngineManifest, builds: dict[str, str], isas: list[str], reps: int,
              out_json: Path | None, tokens=(1, 2, 4, 8, 16), context: int = 256) -> dict:
    """Builds of the kernel (name -> library, runtime/native.build_at; the same library under two
    names is an A/A control) x matmul paths, alternated in one process: B=1 forwards of T tokens
    after `context` tokens, each rep the settings in rotated order on the same tokens; medians
    over reps after the first. The clock: this thread's CPU time where the engine runs on one
    thread (SPECDEC_THREADS=1: a shared machine's other processes then cost the reading little),
    else wall time. Every setting's logits are compared bit for bit with the first's."""
    from backend.devices import load_runtime
    from backend.runtime import native

    settings = [(b, i) for b in builds for i in isas]
    rts, rng = {}, np.random.default_rng(0)
    prompt = rng.integers(3, manifest.model.vocab_size, (1, context))
    for name, path in builds.items():
        with native.build_at(path):
            rt = rts[name] = load_runtime(manifest, "gguf")
            rt.alloc(0)
            rt.forward([0], prompt, np.arange(-1, context - 1, dtype=np.int32)[None], np.full((1, 1), context - 1))
            rt.commit([0], [np.arange(context)])
    one_thread = all(rt.threads == 1 for rt in rts.values())
    clock = time.thread_time if one_thread else time.perf_counter
    got = {s: {t: [] for t in tokens} for s in settings}
    mismatched = set()
    for r in range(reps + 1):
        order = settings[r % len(settings):] + settings[:r % len(settings)]
        for t in tokens:
            toks, first = rng.integers(3, manifest.model.vocab_size, (1, t)), {}
            for b, isa in order:
                with native.build_at(builds[b]):
                    native.use_tiles(isa != "avx512")
                    ms, first[(b, isa)] = verify_ms(rts[b], toks, clock)
                if r:
                    got[(b, isa)][t].append(ms)
            ref = first[settings[0]]
            mismatched |= {f"{b}/{i}" for (b, i), v in first.items() if not np.array_equal(v.view(np.uint32), ref.view(np.uint32))}
    for rt in rts.values():
        rt.close()
    med = {f"{b}/{i}": {t: round(statistics.median(v[t]), 3) for t in tokens} for (b, i), v in got.items()}
    result = {"builds": builds, "isas": isas, "reps": reps, "context": context, "tokens": list(tokens),
              "clock": "thread CPU time, one engine thread" if one_thread else "wall",
              "median_ms": med, "cost_over_t1": {s: {t: round(m[t] / m[tokens[0]], 3) for t in tokens} for s, m in med.items()},
              "logits_bitwise_equal_to_first": not mismatched, "mismatched": sorted(mismatched)}
    for s, m in med.items():
        print(f"{s:24s} " + " ".join(f"T={t}:{m[t]:.2f}ms" for t in tokens) + "  cost(T)/cost(1) " +
              "/".join(f"{result['cost_over_t1'][s][t]:.2f}" for t in tokens[1:]), flush=True)
    print("logits bitwise equal across settings:", "yes" if not mismatched else f"NO: {sorted(mismatched)}")
    if out_json:
        write_result(out_json, result, threads=1 if one_thread else engine_threads())
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
