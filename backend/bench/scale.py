"""The large-model measurements of issue 53, our side: plain decode and time to first token on
given token ids, the verify's cost curve, this machine's DRAM read bandwidth, and the speed-up
speculation would buy at a size, modelled from acceptance measured on a real small model.

    python -m backend.bench.scale ours --repo R --ids-json IDS --new-tokens 64 --json OUT
    python -m backend.bench.scale bandwidth --gib 4 --threads 2 --json OUT
    python -m backend.bench.scale costs --repo R --json OUT                # cost(T)/cost(1), T = 1..16
    python -m backend.bench.scale acceptance --repo SMALL --prompts P --drafter prompt-lookup --json OUT
    python -m backend.bench.scale model --costs COSTS|MANIFEST --acceptance ACC [ACC ...] --json OUT
    python -m backend.bench.scale fidelity --repo R --prompts P --json OUT  # engine vs float32, same weights

benchmarks/vs_llamacpp_scale.py runs `ours` and `bandwidth` alternated with llama.cpp. The model
(`model`): a speculative step that drafted n tokens costs cost(n + 1) / cost(1) plain steps of the
large model (its measured curve) and emits what the small model's steps emitted; with the
small model's steps at a fixed draft length K (the share drafting each depth, E[tau]), the
speed-up is E[tau] / E[cost(n + 1) / cost(1)], the best K reported. The drafts' own time (prompt
lookup, suffix: ~0.03 ms a step) is left out; acceptance on a random-weight model is noise, so it
is taken from a real one: a model, labelled so, not a measurement.
Knows: the runtimes and the decoder through their public calls. Does not know: llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import resource
import threading
import time
from pathlib import Path

import numpy as np

from backend.bench.provenance import write_result

COST_TOKENS = tuple(range(1, 18))          # T = 1..16 and 17 (a 16-token draft's verify)
DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)


def _rss() -> int:
    """This process's resident bytes now (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def kv_bytes_per_token(cfg) -> int:
    """f16 K and V of every layer: the native runtime's cache per position."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def ours(repo: str, items: list[dict], new_tokens: int, threads: int | None, warmup: bool = True) -> dict:
    """Plain greedy decoding through the server's decoder on each item's token ids (EOS ignored),
    after one untimed warm-up item (unless not `warmup`): time to first token, decode tokens/s after it, and the
    process's resident memory against the engine file plus the KV its longest sequence holds."""
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.config import DrafterKind, RuntimeOptions, SamplingParams
    from backend.decoder import SpecDecoder
    from backend.devices import load_runtime
    from backend.devices.native import NativeRecord
    from backend.manifest import EngineManifest
    from backend.sequence import Request
    from backend.tokenizer import Tokenizer

    m = EngineManifest.load(Path(repo) / ENGINE_SUBDIR)
    tok = Tokenizer.from_manifest(m)
    base = _rss()                      # the interpreter, numpy, the tokenizer: not the engine's
    t0 = time.perf_counter()
    dec = SpecDecoder(load_runtime(m, options=RuntimeOptions(threads=threads)), tok, {})
    load_s, loaded = time.perf_counter() - t0, _rss()
    rows = []
    for i, item in enumerate(([items[0]] if warmup else [None]) + items):
        if item is None:
            continue
        req = Request(tuple(int(x) for x in item["token_ids"]), SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                      DrafterKind.NONE)
        t0 = time.perf_counter()
        first, out = None, []
        for step in dec.generate(req):
            out.extend(int(x) for x in step.new_ids)
            first = first or time.perf_counter()
        t1 = time.perf_counter()
        if i:
            rows.append({"id": item["id"], "kind": item.get("kind"), "prompt_tokens": len(item["token_ids"]),
                         "prefill_ms": round(1000 * (first - t0), 2), "decode_ms": round(1000 * (t1 - first), 2),
                         "new_tokens": len(out), "decode_tokens_per_s": (len(out) - 1) / (t1 - first),
                         "token_ids": out})
    longest = max(len(it["token_ids"]) for it in items) + new_tokens
    ef = m.engine()
    rss = _rss()
    work = getattr(dec.target, "_workspace", None)           # the native kernel's scratch, grown to the largest forward
    work = int(work.capacity) if work is not None else None
    dec.target.close()
    return {"engine": "specdec", "format": ef.weights.value, "isa": _isa(), "load_s": round(load_s, 2),
            "file_bytes": ef.size_bytes, "weight_bytes_per_token": ef.weight_bytes_per_token,
            "kv_bytes_per_token": kv_bytes_per_token(m.model), "kv_bytes_longest": kv_bytes_per_token(m.model) * longest,
            "rss_before_load": base, "rss_after_load": loaded, "rss_after": rss, "rss_engine": rss - base,
            "workspace_bytes": work,
            "wide_activations": list(NativeRecord.of(ef).wide_activations), "per_prompt": rows, **_overall(rows)}


def _isa() -> str | None:
    try:
        from backend.runtime import native
        return native.isa()
    except Exception:          # noqa: BLE001 - an ONNX-only install: recorded as unknown
        return None


def _overall(rows: list[dict]) -> dict:
    dec = [r for r in rows if r["new_tokens"] > 1]
    steps = sum(r["new_tokens"] - 1 for r in dec)
    return {"decode_tokens_per_s": steps / (sum(r["decode_ms"] for r in dec) / 1000) if dec else None,
            "prefill_ms": {str(r["id"]): r["prefill_ms"] for r in rows}}


def bandwidth(gib: float, threads: int, passes: int = 5) -> dict:
    """DRAM read bandwidth: `threads` threads each summing its part of a gib-GiB float64 buffer
    (numpy's reduction releases the GIL; far larger than any last-level cache: the Xeon's L3 is
    large and shared with the host), the best of `passes` reads, and the CPU time they got
    (a reading on a busy machine is low: cpu_share < threads says by how much)."""
    a = np.ones(int(gib * 2 ** 30) // 8)           # written once: every page resident
    parts = np.array_split(a, threads)
    best, readings = 0.0, []
    for _ in range(passes):
        sums = [0.0] * threads
        work = [threading.Thread(target=lambda i=i: sums.__setitem__(i, float(parts[i].sum()))) for i in range(threads)]
        c0, t0 = time.process_time(), time.perf_counter()
        for w in work:
            w.start()
        for w in work:
            w.join()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert sum(sums) == a.size, sums
        readings.append({"gb_per_s": round(a.nbytes / wall / 1e9, 2), "cpu_share": round(cpu / wall, 2)})
        best = max(best, a.nbytes / wall / 1e9)
    return {"buffer_bytes": a.nbytes, "threads": threads, "read_gb_per_s": round(best, 2), "readings": readings}


def costs(repo: str, context: int = 256, reps: int = 5, threads: int | None = None) -> dict:
    """Median forward ms of T = COST_TOKENS new tokens at batch 1 after `context`, and cost(T)/cost(1)."""
    from backend.bench.engine_bench import _forward_ms
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.config import RuntimeOptions
    from backend.devices import load_runtime
    from backend.manifest import EngineManifest

    m = EngineManifest.load(Path(repo) / ENGINE_SUBDIR)
    rt = load_runtime(m, options=RuntimeOptions(threads=threads, max_sequences=1))
    ms = {t: _forward_ms(rt, 1, context, t, reps) for t in COST_TOKENS}
    rt.close()
    return {"context": context, "reps": reps, "isa": _isa(), "forward_ms": {str(t): round(v, 3) for t, v in ms.items()},
            "cost_ratio": {str(t): round(v / ms[1], 4) for t, v in ms.items()}}


def acceptance(repo: str, prompts: str, drafter: str, lengths=DRAFT_LENGTHS, new_tokens: int = 128) -> dict:
    """On a real (small) model: greedy speculation with `drafter` at each fixed draft length K ->
    per K, E[tau] (tokens a step emits) and the share of steps drafting each depth; the outputs
    checked identical to plain."""
    from backend.bench.prompt_sets import load_prompts, prompt_ids
    from backend.bench.spec_bench import run_one
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.config import DrafterKind, SamplingParams, ServeConfig, SpecConfig
    from backend.engine import make_decoder
    from backend.manifest import EngineManifest

    m = EngineManifest.load(Path(repo) / ENGINE_SUBDIR)
    items = load_prompts(prompts)
    kind = DrafterKind(drafter)
    out = {"repo": str(Path(repo).resolve()), "model": m.model.architecture, "source": m.source, "drafter": drafter,
           "prompts": prompts, "new_tokens": new_tokens, "by_length": {}}
    plain_dec = make_decoder(ServeConfig(engine_dir=str(m.root)), m)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    encoded = [prompt_ids(plain_dec.tok, it["messages"]) for it in items]
    plain = [list(run_one(plain_dec, ids, params, DrafterKind.NONE, None).tokens) for ids in encoded]
    plain_dec.target.close()
    for k in lengths:
        spec = SpecConfig(num_draft_tokens=k, max_draft_tokens=max(lengths), prompt_lookup_width=1)   # chains
        dec = make_decoder(ServeConfig(engine_dir=str(m.root), spec=spec), m)
        steps, emitted, nodes, depth, same = 0, 0, 0, [], True
        for ids, want in zip(encoded, plain):
            r = run_one(dec, ids, params, kind, k)
            same &= list(r.tokens) == want
            steps += r.stats.num_steps
            emitted += r.stats.num_step_tokens
            nodes += r.stats.num_draft_tokens
            drafted = r.stats.drafted_per_pos
            depth += [0] * (len(drafted) - len(depth))
            for d, n in enumerate(drafted):
                depth[d] += n
        at_least = [n / steps for n in depth]                     # share of steps drafting >= d + 1
        exactly = [1 - (at_least[0] if at_least else 0)] + [a - b for a, b in zip(at_least, at_least[1:] + [0])]
        dec.target.close()
        out["by_length"][str(k)] = {"steps": steps, "mean_tokens_per_step": emitted / steps,
                                    "drafted_share": [round(x, 5) for x in exactly], "mean_nodes": nodes / steps,
                                    "chains": nodes == sum(depth), "identical_to_plain": same}
        print(f"{drafter} K={k}: E[tau] {emitted / steps:.3f} over {steps} steps; identical to plain: {same}", flush=True)
    return out


def fidelity(repo: str, prompts: str, max_tokens: int = 256) -> dict:
    """The serving engine against the float32 model on the same (dequantized) weights (the torch
    runtime, buildlib/calibration.py's reference), teacher-forced over each prompt's positions: top-1
    agreement, the logits' relative error ||a - b|| / ||b|| and KL(float || engine)."""
    from backend.bench.prompt_sets import load_prompts, prompt_ids
    from backend.buildlib.calibration import _fp32_runtime
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.config import RuntimeOptions
    from backend.devices import load_runtime
    from backend.devices.native import NativeRecord
    from backend.manifest import EngineManifest
    from backend.tokenizer import Tokenizer

    m = EngineManifest.load(Path(repo) / ENGINE_SUBDIR)
    tok = Tokenizer.from_manifest(m)
    ids = [np.asarray(prompt_ids(tok, p["messages"])[:max_tokens], np.int64) for p in load_prompts(prompts)]
    engine = load_runtime(m, options=RuntimeOptions(max_sequences=1))
    ref = _fp32_runtime(load_checkpoint(m.source), max(len(x) for x in ids) + 1)

    def logits(rt, x):                  # [n, V] float64, one prompt at a time (a 128k vocabulary)
        rt.alloc(0)
        o = rt.forward([0], x[None], np.arange(-1, x.size - 1, dtype=np.int32)[None], np.arange(x.size)[None])
        rt.free(0)
        return np.asarray(o.logits[0], np.float64)

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    n = agree = 0
    diff2 = ref2 = kl = 0.0
    margins = []
    for x in ids:
        a, b = logits(engine, x), logits(ref, x)
        la, lb = log_softmax(a), log_softmax(b)
        n += x.size
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        diff2, ref2 = diff2 + float(((a - b) ** 2).sum()), ref2 + float((b ** 2).sum())
        kl += float((np.exp(lb) * (lb - la)).sum())
        top2 = np.sort(b, -1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
    engine.close()
    ref.close()
    return {"source": m.source, "positions": n, "wide_activations": list(NativeRecord.of(m.engine()).wide_activations),
            "top1_agreement": round(agree / n, 4), "relative_error": round((diff2 / ref2) ** 0.5, 5),
            "kl_mean": round(kl / n, 6), "float_top1_margin_median": round(float(np.median(np.concatenate(margins))), 4)}


def curve(doc: dict) -> dict:
    """cost(T)/cost(1) from a `costs` result, or from a manifest's cost model (the build's forward
    ms at M = 1, 2, 4, ..., 64; T between them interpolated)."""
    if "cost_ratio" in doc:
        return {"cost_ratio": doc["cost_ratio"], "from": "costs"}
    cm = doc["cost_model"]
    t, sec = np.asarray(cm["tokens"], float), np.asarray(cm["seconds"], float)
    return {"cost_ratio": {str(n): float(np.interp(n, t, sec) / sec[0]) for n in COST_TOKENS},
            "from": f"the build's cost model (M = {cm['tokens']}, interpolated)"}


def model(cost: dict, acc: dict) -> dict:
    """The modelled speed-up (module docstring) of `acc`'s drafter on the cost curve `cost`."""
    cost = curve(cost)
    ratio = {int(t): r for t, r in cost["cost_ratio"].items()}
    rows = {}
    for k, a in acc["by_length"].items():
        if a["chains"]:           # a step's nodes are its depth: the cost of each depth's share
            c = sum(share * ratio[min(n + 1, max(ratio))] for n, share in enumerate(a["drafted_share"]))
        else:                     # trees (suffix): the cost at the mean nodes per step, interpolated
            c = float(np.interp(1 + a["mean_nodes"], sorted(ratio), [ratio[t] for t in sorted(ratio)]))
        rows[k] = {"mean_tokens_per_step": round(a["mean_tokens_per_step"], 4), "mean_step_cost": round(c, 4),
                   "identical_to_plain": a["identical_to_plain"],
                   "speedup": round(a["mean_tokens_per_step"] / c, 4)}
    best = max(rows, key=lambda k: rows[k]["speedup"])
    return {"kind": "model (not a measurement)", "drafter": acc["drafter"], "acceptance_from": acc["source"],
            "costs_from": cost["from"],
            "by_length": rows, "best_length": int(best), "speedup": rows[best]["speedup"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.scale", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    o = sub.add_parser("ours")
    o.add_argument("--repo", required=True)
    o.add_argument("--ids-json", required=True)
    o.add_argument("--new-tokens", type=int, default=64)
    o.add_argument("--threads", type=int, default=None)
    o.add_argument("--no-warmup", action="store_true", help="no untimed first item (a long-context check)")
    b = sub.add_parser("bandwidth")
    b.add_argument("--gib", type=float, default=4.0)
    b.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("costs")
    c.add_argument("--repo", required=True)
    c.add_argument("--context", type=int, default=256)
    c.add_argument("--threads", type=int, default=None)
    a = sub.add_parser("acceptance")
    a.add_argument("--repo", required=True)
    a.add_argument("--prompts", required=True)
    a.add_argument("--drafter", default="prompt-lookup")
    a.add_argument("--new-tokens", type=int, default=128)
    f = sub.add_parser("fidelity")
    f.add_argument("--repo", required=True)
    f.add_argument("--prompts", required=True)
    f.add_argument("--max-tokens", type=int, default=256)
    md = sub.add_parser("model")
    md.add_argument("--costs", required=True)
    md.add_argument("--acceptance", nargs="+", required=True)
    for p in (o, b, c, a, f, md):
        p.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    threads = getattr(args, "threads", None)
    if args.what == "ours":
        result = ours(args.repo, json.loads(Path(args.ids_json).read_text()), args.new_tokens, args.threads,
                      not args.no_warmup)
    elif args.what == "bandwidth":
        result = bandwidth(args.gib, args.threads)
    elif args.what == "costs":
        result = costs(args.repo, args.context, threads=args.threads)
    elif args.what == "acceptance":
        result = acceptance(args.repo, args.prompts, args.drafter, new_tokens=args.new_tokens)
    elif args.what == "fidelity":
        result = fidelity(args.repo, args.prompts, args.max_tokens)
    else:
        cost = json.loads(Path(args.costs).read_text())
        result = {"costs": args.costs, "models": [model(cost, json.loads(Path(f).read_text())) for f in args.acceptance]}
    write_result(args.json, result, threads)
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_prompt", "readings")}, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
