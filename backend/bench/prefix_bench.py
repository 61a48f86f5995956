"""`specdec bench-prefix`: what the prefix cache saves, in one process on the built repository.

1. Time to first token of a prompt that shares a long prefix with an earlier one (a system
   prompt of --prefix-tokens, a question of --question-tokens): a miss (a prefix not seen
   before: the whole prompt is prefilled) against a hit (the same prefix, another question),
   each repetition with a prefix of its own. Plain decoding (TTFT does not depend on the
   drafter), max_tokens 1.
2. The drafting time of the first speculative step of a drafter with a model of its own (draft
   model, EAGLE head) after a miss and after a hit: its catch-up over the prompt, or over the
   part its own prefix cache did not hold, and its draft.
3. Throughput of a mixed workload whose requests share a system prompt (--system-tokens before
   each chat of the prompt file): the cache on and off, each its own decoder, scheduler and
   --concurrency client streams, time-sliced one scheduler iteration each in turn
   (paired_bench.run_level), so the machine's drift cancels out of the ratio.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

from backend.bench.paired_bench import _Mode, _serve_config, run_level
from backend.bench.prompt_sets import load_prompts, prompt_ids
from backend.bench.provenance import engine_threads, write_result
from backend.errors import ManifestMissing


def _filler(tok, prompts: list[dict], n: int, tag: str) -> list[int]:
    """n tokens of text: `tag`, then the prompt file's messages over and over."""
    text = tag + "\n" + "\n".join(m["content"] for p in prompts for m in p["messages"])
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _first_token(dec, ids: list[int], kind: str = "none", k: int | None = None) -> tuple[float, float | None, int, int]:
    """-> (seconds to the first token, drafting seconds of the first speculative step (its
    catch-up and its draft) or None, tokens the target's cache gave, tokens the drafter's own
    cache gave)."""
    from backend.config import DrafterKind, SamplingParams
    from backend.sequence import Request

    own = lambda: getattr(dec.prefix_stats().get(kind), "hit_tokens", 0)
    before = own()
    t0 = time.perf_counter()
    seq = dec.start(Request(tuple(ids), SamplingParams(max_tokens=1 if k is None else k + 2, ignore_eos=True),
                            DrafterKind(kind), k))
    out = None
    while out is None:
        out = dec.prefill(seq)
    ttft = time.perf_counter() - t0
    draft_s = dec.step([seq])[0].step_draft_s if k is not None else None
    dec.finish(seq)
    return ttft, draft_s, seq.cached_prompt_tokens, own() - before


def ttft(dec, tok, prompts, prefix_tokens: int, question_tokens: int, reps: int) -> dict:
    questions = [tok.encode(m["content"], add_special_tokens=False)[:question_tokens]
                 for p in prompts for m in p["messages"] if m["role"] == "user"]
    questions = [q for q in questions if len(q) == question_tokens] or questions
    miss, hit, cached = [], [], []
    for r in range(reps):
        prefix = _filler(tok, prompts, prefix_tokens, f"Session {r}.")
        m = _first_token(dec, prefix + questions[(2 * r) % len(questions)])
        h = _first_token(dec, prefix + questions[(2 * r + 1) % len(questions)])
        assert m[2] == 0, "a fresh prefix hit the cache"
        miss.append(m[0])
        hit.append(h[0])
        cached.append(h[2])
        print(f"  rep {r}: TTFT miss {m[0]:.3f} s, hit {h[0]:.3f} s ({h[2]} cached tokens)", flush=True)
    med_miss, med_hit = statistics.median(miss), statistics.median(hit)
    return {"prefix_tokens": prefix_tokens, "question_tokens": question_tokens, "reps": reps,
            "ttft_miss_s": [round(x, 4) for x in miss], "ttft_hit_s": [round(x, 4) for x in hit],
            "cached_tokens": cached, "median_ttft_miss_s": round(med_miss, 4), "median_ttft_hit_s": round(med_hit, 4),
            "hit_over_miss": round(med_hit / med_miss, 4)}


def catch_up(dec, tok, prompts, prefix_tokens: int, reps: int) -> dict:
    """The drafting time of the first speculative step (fixed budget 4) of each drafter with a
    model after a miss and after a hit: its catch-up over the prompt (or over what its own prefix
    cache did not hold) and its draft."""
    out = {}
    for kind in ("draft-model", "eagle"):
        if not any(k.value == kind for k in dec.drafters):
            continue
        miss, hit, own = [], [], []
        for r in range(reps):
            prefix = _filler(tok, prompts, prefix_tokens, f"Catch-up {kind} {r}.")
            q = tok.encode(f"Question {r}: what does this say?", add_special_tokens=False)
            m = _first_token(dec, prefix + q, kind, 4)
            h = _first_token(dec, prefix + q[::-1], kind, 4)
            assert m[3] == 0, "a fresh prefix hit the drafter's cache"
            miss.append(m[1])
            hit.append(h[1])
            own.append(h[3])
        out[kind] = {"first_draft_miss_s": [round(x, 4) for x in miss], "first_draft_hit_s": [round(x, 4) for x in hit],
                     "drafter_cached_tokens": own,
                     "median_first_draft_miss_s": round(statistics.median(miss), 4),
                     "median_first_draft_hit_s": round(statistics.median(hit), 4)}
        print(f"  {kind}: drafting in the first step after a miss {out[kind]['median_first_draft_miss_s']:.3f} s, "
              f"after a hit {out[kind]['median_first_draft_hit_s']:.3f} s (its own cache gave {own} tokens)",
              flush=True)
    return out


def throughput(cfg, tok, prompts, system_tokens: int, n: int, requests: int, max_new_tokens: int,
               drafter: str) -> dict:
    from backend.config import DrafterKind, SamplingParams
    from backend.engine import make_decoder
    from backend.sequence import Request

    system = tok.decode(_filler(tok, prompts, system_tokens, "You are a support assistant. Rules follow."))
    chats = [p for p in prompts for _ in range(-(-requests // len(prompts)))][:requests]
    ids = [tuple(prompt_ids(tok, [{"role": "system", "content": system}] + p["messages"])) for p in chats]
    params = SamplingParams(max_tokens=max_new_tokens)
    work = list(range(len(ids)))
    make = lambda i, _: Request(ids[i], params, DrafterKind(drafter))
    decs = {"cache_on": make_decoder(cfg), "cache_off": make_decoder(replace(cfg, prefix_cache_mb=0))}
    modes = [_Mode(name, d, cfg.max_batch, make, work, n) for name, d in decs.items()]
    t0 = time.perf_counter()
    run_level(modes, seed=n)
    failed = [f"{m.name}: {e}" for m in modes for e in m.errors]
    if failed:
        raise SystemExit(f"{len(failed)} request(s) failed, e.g. {failed[0]}")
    rows = {m.name: m.row() for m in modes}
    st = decs["cache_on"].prefix_stats()["target"]
    res = {"system_tokens": system_tokens, "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1),
           "concurrency": n, "requests": requests, "max_new_tokens": max_new_tokens, "drafter": drafter,
           "wall_s": round(time.perf_counter() - t0, 1),
           "cache_hit_tokens": st.hit_tokens, "prompt_tokens": st.lookup_tokens}
    for name, r in rows.items():
        res[f"{name}_tokens_per_s"] = round(r["tokens_per_s"], 2)
        res[f"{name}_output_tokens"] = r["tokens"]
        res[f"{name}_busy_s"] = round(r["busy_s"], 1)
    res["speedup"] = round(res["cache_on_tokens_per_s"] / res["cache_off_tokens_per_s"], 3)
    print(f"  mixed workload, n={n}: cache on {res['cache_on_tokens_per_s']:.1f} tok/s, off "
          f"{res['cache_off_tokens_per_s']:.1f} tok/s (x{res['speedup']:.2f}); {st.hit_tokens} of "
          f"{st.lookup_tokens} prompt tokens reused", flush=True)
    return res


def main(args) -> dict:
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.engine import make_decoder

    repo = Path(args.model_repository)
    if not (repo / ENGINE_SUBDIR / "manifest.json").exists():
        raise ManifestMissing(f"no engines in {repo}: run `specdec build` first")
    cfg = _serve_config(repo)
    prompts = load_prompts(args.prompts)
    dec = make_decoder(cfg)
    tok = dec.tok
    print(f"TTFT, {args.prefix_tokens}-token shared prefix + {args.question_tokens}-token question:", flush=True)
    result = {"prefix_cache_mb": cfg.prefix_cache_mb, "runtime": type(dec.target).__name__,
              "ttft": ttft(dec, tok, prompts, args.prefix_tokens, args.question_tokens, args.reps)}
    t = result["ttft"]
    print(f"  median miss {t['median_ttft_miss_s']:.3f} s, hit {t['median_ttft_hit_s']:.3f} s: "
          f"hit / miss {t['hit_over_miss']:.3f}", flush=True)
    print("drafter catch-up (first speculative step):", flush=True)
    result["catch_up"] = catch_up(dec, tok, prompts, args.prefix_tokens, args.reps)
    del dec
    if args.concurrency:
        print("throughput:", flush=True)
        result["throughput"] = [throughput(cfg, tok, prompts, args.system_tokens, int(n), args.requests,
                                           args.max_new_tokens, args.drafter)
                                for n in str(args.concurrency).split(",")]
    if args.json:
        result = write_result(args.json, result, engine_threads(cfg.runtime))
    return result
