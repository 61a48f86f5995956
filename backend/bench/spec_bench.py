"""`specdec bench`: plain vs speculative decoding on the same prompts, in one run.

For every prompt, plain decoding and speculative decoding run back to back through the same
decoder (same engine, same sampling parameters and seed), so the speedup is a ratio measured
under the same machine conditions. Several drafters (`compare`) run time-sliced instead: the same
request in plain decoding and every drafter's own decoder, one decoder call of each in turn,
and their tokens/s ratios per prompt kind are reported (`versus`). Reports overall and per prompt kind: tokens/s, TPOT, TTFT,
acceptance rate, E[tau] (mean tokens per target forward), per-position acceptance and the
draft/verify time split; per prompt: speedup, E[tau], whether the speculative output is
token-identical to plain decoding (greedy, and sampled: both runs take the prompt's seed), and the
output itself (`output_ids`: the generated tokens only, `output_text`; the plain run's too where
they differ), so engines and checkpoints can be compared token for token. A model without a chat template (a base
model) gets each prompt's text as a plain continuation; the report says which ("prompt_format").
"""
from __future__ import annotations

import random
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from backend.bench.prompt_sets import PLAIN_CONTINUATION, prompt_format, prompt_ids
from backend.bench.provenance import engine_threads, write_result
from backend.config import DrafterKind, SamplingParams
from backend.decoder import SpecDecoder
from backend.sequence import Request
from backend.stats import SpecStats


@dataclass
class RunResult:
    tokens: list[int]
    seconds: float
    ttft_s: float
    stats: SpecStats
    cached: int = 0                 # prompt tokens the prefix cache gave (0 with the cache off)

    @property
    def tpot_s(self) -> float:
        n = len(self.tokens)
        return (self.seconds - self.ttft_s) / (n - 1) if n > 1 else 0.0


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    cached: int = 0

    def add(self, r: RunResult) -> None:
        self.tokens += len(r.tokens)
        self.cached += r.cached
        self.seconds += r.seconds
        self.ttft.append(r.ttft_s)
        self.tpot.append(r.tpot_s)
        self.stats.merge(r.stats)

    def to_json(self) -> dict:
        n = max(1, len(self.ttft))
        return {"tokens_per_s": round(self.tokens / self.seconds, 3) if self.seconds else 0.0,
                "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "tpot_ms": round(1000 * sum(self.tpot) / n, 3),
                "ttft_ms": round(1000 * sum(self.ttft) / n, 3), "cached_prompt_tokens": self.cached}


def run_one(decoder: SpecDecoder, ids: list[int], params: SamplingParams, drafter: DrafterKind,
            num_draft_tokens: int | None) -> RunResult:
    t0 = time.perf_counter()
    first, tokens, stats = None, [], SpecStats()
    for out in decoder.generate(Request(tuple(ids), params, drafter, num_draft_tokens)):
        tokens.extend(out.new_ids)
        stats = out.stats
        if first is None:
            first = time.perf_counter()
    t1 = time.perf_counter()
    return RunResult(tokens, t1 - t0, (first or t1) - t0, stats)


WARMUP_MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]


def run(decoder: SpecDecoder, prompts: list[dict], drafter: DrafterKind, max_new_tokens: int,
        temperature: float = 0.0, num_draft_tokens: int | None = None, ignore_eos: bool = False,
        out_json: Path | None = None, log=print, warmup_passes: int = 0) -> dict:
    """One drafter against plain decoding through one decoder, each prompt plain then
    speculative, back to back (several drafters at once: `compare`, time-sliced)."""
    tok = decoder.tok
    fmt = _format(tok)
    encoded = [(p, prompt_ids(tok, p["messages"])) for p in prompts]
    warm = prompt_ids(tok, WARMUP_MESSAGES)
    run_one(decoder, warm, SamplingParams(max_tokens=16), DrafterKind.NONE, None)   # warm-up
    run_one(decoder, warm, SamplingParams(max_tokens=16), drafter, num_draft_tokens)
    for _ in range(warmup_passes):
        for item, ids in encoded:
            run_one(decoder, ids, _params(item, temperature, max_new_tokens, ignore_eos), drafter, num_draft_tokens)
    plain_runs, spec_runs = [], []
    for item, ids in encoded:
        params = _params(item, temperature, max_new_tokens, ignore_eos)
        plain_runs.append(run_one(decoder, ids, params, DrafterKind.NONE, None))
        spec_runs.append(run_one(decoder, ids, params, drafter, num_draft_tokens))
        log(f"{item['id']:24s} {item['kind']:10s} plain {_tps(plain_runs[-1]):6.1f} tok/s  spec "
            f"{_tps(spec_runs[-1]):6.1f} tok/s  E[tau] {spec_runs[-1].stats.mean_accepted_tokens:.2f}")
    result = summarize(encoded, plain_runs, spec_runs, drafter, tok, fmt, max_new_tokens, temperature,
                       num_draft_tokens, warmup_passes, log)
    if out_json:
        result = write_result(out_json, result, engine_threads())      # the CLI's decoders: default options
    return result


def _format(tok) -> str:
    fmt = prompt_format(tok)
    if fmt == PLAIN_CONTINUATION:
        print("bench: this model has no chat template (a base model): each prompt's text is a plain "
              "continuation", file=sys.stderr)
    return fmt


def compare(plain_decoder: SpecDecoder, decoders: dict[DrafterKind, SpecDecoder], prompts: list[dict],
            max_new_tokens: int, temperature: float = 0.0, num_draft_tokens: int | None = None,
            ignore_eos: bool = False, out_json: Path | None = None, log=print, warmup_passes: int = 0,
            prefix_cache_mb: float = 0) -> dict:
    """Plain decoding and each drafter (its own decoder: its own drafter state and controller)
    on every prompt, time-sliced (`run_sliced`). With `prefix_cache_mb` each decoder has its own
    prefix cache (as separate servers would) and the warm-up passes run plain decoding too, so
    every mode's cache has seen the same requests. The warm-up
    is a prompt outside the set (a drafter with history, suffix decoding, must not have seen a
    measured prompt's answer); `warmup_passes` then runs the whole set that many times through
    each drafter unmeasured: greedy or seeded, that writes exactly the answers measured after it
    (repeat traffic). One drafter: its result; several: each one's and their ratios per kind."""
    tok = plain_decoder.tok
    fmt = _format(tok)
    encoded = [(p, prompt_ids(tok, p["messages"])) for p in prompts]
    modes = {DrafterKind.NONE: plain_decoder, **decoders}
    rng = random.Random(0)
    run_sliced(modes, prompt_ids(tok, WARMUP_MESSAGES), SamplingParams(max_tokens=16), num_draft_tokens, rng)
    for _ in range(warmup_passes):
        for item, ids in encoded:
            run_sliced(modes if prefix_cache_mb else decoders, ids, _params(item, temperature, max_new_tokens, ignore_eos), num_draft_tokens, rng)
    runs: dict[DrafterKind, list[RunResult]] = {k: [] for k in modes}
    for item, ids in encoded:
        got = run_sliced(modes, ids, _params(item, temperature, max_new_tokens, ignore_eos), num_draft_tokens, rng)
        for k, r in got.items():
            runs[k].append(r)
        log(f"{item['id']:24s} {item['kind']:10s} " + "  ".join(
            f"{k.value} {_tps(r):6.1f} tok/s (E[tau] {r.stats.mean_accepted_tokens:.2f})" for k, r in got.items()))
    results = {k: summarize(encoded, runs[DrafterKind.NONE], runs[k], k, tok, fmt, max_new_tokens, temperature,
                            num_draft_tokens, warmup_passes, log) for k in decoders}
    if len(results) == 1:
        result = next(iter(results.values()))
    else:
        named = [(k.value, r) for k, r in results.items()]
        result = {"drafters": [a for a, _ in named], "warmup_passes": warmup_passes, "order": ORDER,
                  "results": dict(named),
                  "versus": {f"{a}/{b}": _versus(ra, rb) for a, ra in named for b, rb in named if a != b}}
        for pair, v in result["versus"].items():
            log(f"{pair:28s} tokens/s x{v['overall']:.3f}  " + "  ".join(f"{k} x{x:.3f}" for k, x in v["kinds"].items())
                + f"   decode (1/TPOT) x{v['decode_overall']:.3f}  "
                + "  ".join(f"{k} x{x:.3f}" for k, x in v["decode_kinds"].items()))
    result["prefix_cache_mb"] = prefix_cache_mb
    if out_json:
        result = write_result(out_json, result, engine_threads())      # the CLI's decoders: default options
    return result


ORDER = ("time-sliced: the same request in every mode, one decoder call (a prompt chunk or a step) "
         "of each in turn, in a fresh random order every round; a mode's time is its own calls'")


def run_sliced(modes: dict[DrafterKind, SpecDecoder], ids: list[int], params: SamplingParams,
               num_draft_tokens: int | None, rng: random.Random) -> dict[DrafterKind, RunResult]:
    """One request in every mode (plain: DrafterKind.NONE), advanced one decoder call per mode
    in turn, so the machine's slow and fast spells (+-50% on a shared machine, minute to minute)
    fall on every mode alike and cancel out of their ratios; each mode's clock runs only during
    its own calls (as --paired does under load). Modes may share a decoder (distinct sequences)."""
    seqs = {k: dec.start(Request(tuple(ids), params, k, None if k is DrafterKind.NONE else num_draft_tokens))
            for k, dec in modes.items()}
    clock = dict.fromkeys(modes, 0.0)
    first: dict[DrafterKind, float] = {}
    tokens: dict[DrafterKind, list[int]] = {k: [] for k in modes}
    stats = {k: SpecStats() for k in modes}
    live = list(modes)
    while live:
        rng.shuffle(live)
        for k in list(live):
            dec, seq = modes[k], seqs[k]
            t0 = time.perf_counter()
            out = dec.prefill(seq) if k not in first else dec.step([seq])[0]
            if out is not None and seq.finished:
                dec.finish(seq)
            clock[k] += time.perf_counter() - t0
            if out is None:
                continue
            first.setdefault(k, clock[k])
            tokens[k].extend(out.new_ids)
            stats[k] = out.stats
            if seq.finished:
                live.remove(k)
    return {k: RunResult(tokens[k], clock[k], first[k], stats[k], seqs[k].cached_prompt_tokens) for k in modes}


def decoders_for(cfg, kinds: list[DrafterKind]) -> tuple[SpecDecoder, dict[DrafterKind, SpecDecoder]]:
    """A plain decoder and one per drafter kind, each with its own drafters and controller (as a
    server serving only that traffic) and its own target runtime (their sequences are live at
    the same time); ONNX Runtime engines share one session per file, as --paired does."""
    from backend.engine import make_decoder
    from backend.runtime.ort import shared_sessions

    with shared_sessions():
        return make_decoder(cfg), {k: make_decoder(cfg) for k in kinds}


def _params(item: dict, temperature: float, max_new_tokens: int, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=zlib.crc32(item["id"].encode()),
                          ignore_eos=ignore_eos)


def _tps(r: RunResult) -> float:
    return len(r.tokens) / r.seconds if r.seconds else 0.0


def _versus(a: dict, b: dict) -> dict:
    """a's tokens/s over b's, overall and per prompt kind (the same run, the same prompts); and
    b's TPOT over a's (decoding after the first token: the part a drafter changes, where the
    prompt's prefill, the same for both, weighs on short answers' tokens/s)."""
    def ratio(x, y):
        return round(x["spec"]["tokens_per_s"] / y["spec"]["tokens_per_s"], 3) if y["spec"]["tokens_per_s"] else None

    def tpot(x, y):
        return round(y["spec"]["tpot_ms"] / x["spec"]["tpot_ms"], 3) if x["spec"]["tpot_ms"] else None
    return {"overall": ratio(a, b), "kinds": {k: ratio(a["kinds"][k], b["kinds"][k]) for k in a["kinds"]},
            "decode_overall": tpot(a, b), "decode_kinds": {k: tpot(a["kinds"][k], b["kinds"][k]) for k in a["kinds"]}}


def summarize(encoded, plain_runs: list[RunResult], spec_runs: list[RunResult], drafter: DrafterKind, tok, fmt: str,
              max_new_tokens: int, temperature: float, num_draft_tokens: int | None, warmup_passes: int, log) -> dict:
    """One drafter's report against the plain runs of the same prompts."""
    plain_all, spec_all = Totals(), Totals()
    by_kind: dict[str, tuple[Totals, Totals]] = {}
    rows = []
    for (item, ids), plain, spec in zip(encoded, plain_runs, spec_runs):
        seed = zlib.crc32(item["id"].encode())
        plain_all.add(plain)
        spec_all.add(spec)
        kp, ks = by_kind.setdefault(item["kind"], (Totals(), Totals()))
        kp.add(plain)
        ks.add(spec)
        p_tps, s_tps = len(plain.tokens) / plain.seconds, len(spec.tokens) / spec.seconds
        # a base model may end a prompt at once (EOS first; --ignore-eos measures a fixed length)
        row = {"id": item["id"], "kind": item["kind"], "speedup": round(s_tps / p_tps, 3) if p_tps else None,
               "mean_accepted_tokens": round(spec.stats.mean_accepted_tokens, 3),
               "acceptance_rate": round(spec.stats.acceptance_rate, 3),
               "identical_to_plain": spec.tokens == plain.tokens,
               "plain_tokens_per_s": round(p_tps, 2), "spec_tokens_per_s": round(s_tps, 2),
               "tokens": len(spec.tokens), "prompt_tokens": len(ids), "seed": seed,
               "output_ids": list(map(int, spec.tokens)), "output_text": tok.decode(spec.tokens)}
        if spec.tokens != plain.tokens:
            row.update(plain_output_ids=list(map(int, plain.tokens)), plain_output_text=tok.decode(plain.tokens))
        rows.append(row)
    result = {
        "drafter": drafter.value, "prompt_format": fmt, "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "num_draft_tokens": num_draft_tokens if num_draft_tokens is not None else "auto",
        "warmup_passes": warmup_passes,
        "speedup": round(spec_all.to_json()["tokens_per_s"] / plain_all.to_json()["tokens_per_s"], 3),
        "plain": plain_all.to_json(), "spec": spec_all.to_json(),
        "acceptance_rate": round(spec_all.stats.acceptance_rate, 4),
        "mean_accepted_tokens": round(spec_all.stats.mean_accepted_tokens, 4),
        "per_position_acceptance": [round(x, 4) for x in spec_all.stats.per_position()],
        "draft_share": spec_all.stats.to_json()["draft_share"],
        "verify_share": round(1 - spec_all.stats.to_json()["draft_share"], 4) if spec_all.stats.num_steps else 0.0,
        "kinds": {k: {"speedup": round(s.to_json()["tokens_per_s"] / p.to_json()["tokens_per_s"], 3),
                      "plain": p.to_json(), "spec": s.to_json(),
                      "acceptance_rate": round(s.stats.acceptance_rate, 4),
                      "mean_accepted_tokens": round(s.stats.mean_accepted_tokens, 4),
                      "per_position_acceptance": [round(x, 4) for x in s.stats.per_position()],
                      "draft_share": s.stats.to_json()["draft_share"]}
                  for k, (p, s) in by_kind.items()},
        "prompts": rows,
        "all_identical_to_plain": all(r["identical_to_plain"] for r in rows),
    }
    log(f"\n{drafter.value}: speedup x{result['speedup']:.3f}  plain {result['plain']['tokens_per_s']:.1f} tok/s  "
        f"spec {result['spec']['tokens_per_s']:.1f} tok/s  acceptance {result['acceptance_rate']:.3f}  "
        f"E[tau] {result['mean_accepted_tokens']:.3f}  draft share {result['draft_share']:.3f}")
    for k, v in result["kinds"].items():
        log(f"  {k:10s} speedup x{v['speedup']:.3f}  E[tau] {v['mean_accepted_tokens']:.3f}  "
            f"TPOT plain {v['plain']['tpot_ms']:.1f} ms spec {v['spec']['tpot_ms']:.1f} ms")
    return result
