"""`specdec bench`: plain vs speculative decoding on the same prompts, in one run.

For every prompt, plain decoding and speculative decoding run back to back through the same
decoder (same engine, same sampling parameters and seed), so the speedup is a ratio measured
under the same machine conditions. Reports overall and per prompt kind: tokens/s, TPOT, TTFT,
acceptance rate, E[tau] (mean tokens per target forward), per-position acceptance and the
draft/verify time split; per prompt: speedup, E[tau], whether the speculative output is
token-identical to plain decoding (greedy, and sampled: both runs take the prompt's seed), and the
output itself (`output_ids`: the generated tokens only, `output_text`; the plain run's too where
they differ), so engines and checkpoints can be compared token for token. A model without a chat template (a base
model) gets each prompt's text as a plain continuation; the report says which ("prompt_format").
"""
from __future__ import annotations

import json
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from backend.bench.prompt_sets import PLAIN_CONTINUATION, prompt_format, prompt_ids
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

    def add(self, r: RunResult) -> None:
        self.tokens += len(r.tokens)
        self.seconds += r.seconds
        self.ttft.append(r.ttft_s)
        self.tpot.append(r.tpot_s)
        self.stats.merge(r.stats)

    def to_json(self) -> dict:
        n = max(1, len(self.ttft))
        return {"tokens_per_s": round(self.tokens / self.seconds, 3) if self.seconds else 0.0,
                "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "tpot_ms": round(1000 * sum(self.tpot) / n, 3),
                "ttft_ms": round(1000 * sum(self.ttft) / n, 3)}


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


def run(decoder: SpecDecoder, prompts: list[dict], drafter: DrafterKind, max_new_tokens: int,
        temperature: float = 0.0, num_draft_tokens: int | None = None, ignore_eos: bool = False,
        out_json: Path | None = None, log=print) -> dict:
    tok = decoder.tok
    fmt = prompt_format(tok)
    if fmt == PLAIN_CONTINUATION:
        print("bench: this model has no chat template (a base model): each prompt's text is a plain "
              "continuation", file=sys.stderr)
    encoded = [(p, prompt_ids(tok, p["messages"])) for p in prompts]
    warm = encoded[0][1]
    run_one(decoder, warm, SamplingParams(max_tokens=16), DrafterKind.NONE, None)   # warm-up
    run_one(decoder, warm, SamplingParams(max_tokens=16), drafter, num_draft_tokens)
    plain_all, spec_all = Totals(), Totals()
    by_kind: dict[str, tuple[Totals, Totals]] = {}
    rows = []
    for item, ids in encoded:
        seed = zlib.crc32(item["id"].encode())
        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed,
                                ignore_eos=ignore_eos)
        plain = run_one(decoder, ids, params, DrafterKind.NONE, None)
        spec = run_one(decoder, ids, params, drafter, num_draft_tokens)
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
        log(f"{item['id']:24s} {item['kind']:10s} plain {p_tps:6.1f} tok/s  spec {s_tps:6.1f} tok/s  "
            f"x{row['speedup'] or 0:.2f}  E[tau] {row['mean_accepted_tokens']:.2f}  "
            f"identical={row['identical_to_plain']}")
    result = {
        "drafter": drafter.value, "prompt_format": fmt, "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "num_draft_tokens": num_draft_tokens if num_draft_tokens is not None else "auto",
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
    log(f"\noverall: speedup x{result['speedup']:.3f}  plain {result['plain']['tokens_per_s']:.1f} tok/s  "
        f"spec {result['spec']['tokens_per_s']:.1f} tok/s  acceptance {result['acceptance_rate']:.3f}  "
        f"E[tau] {result['mean_accepted_tokens']:.3f}  draft share {result['draft_share']:.3f}")
    for k, v in result["kinds"].items():
        log(f"  {k:10s} speedup x{v['speedup']:.3f}  E[tau] {v['mean_accepted_tokens']:.3f}  "
            f"TPOT plain {v['plain']['tpot_ms']:.1f} ms spec {v['spec']['tpot_ms']:.1f} ms")
    if out_json:
        Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result
