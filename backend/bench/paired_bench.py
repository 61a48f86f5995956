"""`specdec bench --concurrency 1,2,4,... --paired`: the modes time-sliced in one process.

The Triton bench (concurrency_bench) runs the modes one after another; on a shared 2-core VM the
machine's own speed drifts by ±10% from one minute to the next (identical plain rounds in one
process read 88-106 tok/s), and no number of rounds that fits in an hour resolves a 3% claim per
level. Here every mode has its own continuous-batching scheduler and its own n closed-loop
client streams, all in this process, and one driver runs ONE scheduler iteration (admit, at most
one prompt chunk, one batched step) of each mode in turn, in a fresh random order each cycle. A
mode's throughput is its output tokens over the time of its own iterations. The modes therefore
meet the machine's slow and fast spells alike, tens of milliseconds apart, and the drift cancels
out of their ratios. `control` (plain decoding again) reads what remains. Every request is seeded
(the same seed for the same request in every mode, from --seed) and --ignore-eos reaches it, so at
any temperature the modes decode the same tokens, which each level's row checks
(`identical_outputs`): a ratio of tokens per second compares the same work.

What it measures is the engine under the server's batching policy (the same Scheduler and
decoder the Triton model runs), without Triton's per-response cost. That cost is per streamed
response, and a speculative step streams one response for several tokens, so leaving it out is
conservative for speculation. Plain, the control and auto each get a decoder of their own (the
adaptive controller learns from auto's steps only, as in a server that serves auto traffic); the
fixed-K modes share a fourth (their choices do not depend on the controller's estimates). All
four share one ORT session per engine file, so they differ in state, not in where their weights
lie in memory.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
import time
from pathlib import Path

import numpy as np

from backend.bench.concurrency_bench import add_best_fixed, level_requests, sweep_k_list, write_outputs
from backend.bench.provenance import engine_threads
from backend.bench.prompt_sets import prompt_ids
from backend.errors import ManifestMissing, UserError


def _serve_config(repo: Path):
    """ServeConfig as the Triton model builds it, from config.pbtxt's parameters."""
    from backend.triton_glue import serve_config

    text = (repo / "generator" / "config.pbtxt").read_text()
    params = {k: {"string_value": v} for k, v in
              re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)}
    return serve_config({"model_config": json.dumps({"parameters": params}),
                         "model_repository": str(repo / "generator")})


class _Sink:
    __slots__ = ("done", "ids", "stats", "failed")

    def __init__(self):
        self.done = threading.Event()
        self.ids: list[int] = []
        self.stats, self.failed = None, None

    def send(self, out) -> None:
        self.ids.extend(out.new_ids)
        self.stats = out.stats

    def error(self, exc, internal) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"

    def cancelled(self) -> bool:
        return False

    def close(self) -> None:
        self.done.set()


class _Mode:
    """One mode at one level: a scheduler, n client threads, and its own accumulated time."""

    def __init__(self, name, decoder, max_batch, make_request, prompts, n):
        from backend.scheduler import Scheduler

        self.name = name
        self.sched = Scheduler(decoder, max_batch, start=False)
        self.work: queue.Queue = queue.Queue()
        for i, p in enumerate(prompts):
            self.work.put((i, p))
        self.make_request = make_request
        self.busy_s, self.iterations = 0.0, 0
        self.results: dict[int, tuple[tuple[int, ...], object]] = {}     # request index -> (ids, stats)
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(n)]

    def _client(self) -> None:
        while True:
            try:
                i, p = self.work.get_nowait()
            except queue.Empty:
                return
            sink = _Sink()
            self.sched.submit(self.make_request(i, p), sink)
            sink.done.wait()
            with self.lock:
                if sink.failed:
                    self.errors.append(sink.failed)
                else:
                    self.results[i] = (tuple(sink.ids), sink.stats)

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def outputs(self) -> list[tuple[int, ...]]:
        """Each request's output ids, in request order."""
        return [self.results[i][0] for i in sorted(self.results)]

    def row(self) -> dict:
        tokens = sum(len(ids) for ids, _ in self.results.values())
        taus = [s.mean_accepted_tokens for _, s in self.results.values() if s is not None]
        drafts = sum(s.num_draft_tokens for _, s in self.results.values() if s is not None)
        return {"tokens": tokens, "busy_s": self.busy_s, "tokens_per_s": tokens / self.busy_s,
                "step_ms": 1000 * self.busy_s / max(1, self.iterations),
                "mean_accepted_tokens": float(np.mean(taus)) if taus else 1.0,
                "draft_tokens_per_output_token": drafts / max(1, tokens)}


def request_seed(seed: int, index: int) -> int:
    """The sampling seed of a level's request `index` under the run's `seed` (--seed): the same
    in every mode, so at a temperature > 0 every mode samples the same answer (seeded speculative
    output equals seeded plain sampling, DESIGN.md) and the modes' output tokens stay comparable."""
    assert 0 <= seed < 2**32 and 0 <= index < 2**32, (seed, index)
    return (seed << 32) | index


def sampling_params(args):
    """Every request's sampling (--temperature, --max-new-tokens, --ignore-eos); each request
    then takes its own seed (request_seed)."""
    from backend.config import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)


def request_maker(tok, params, kind: str, k: int | None, cache: dict, seed: int = 0):
    """(request index, prompt record) -> Request for one mode (drafter `kind`, fixed budget `k`
    or None), seeded by request_seed(seed, index); the chat-templated ids are tokenized once per
    prompt across modes (`cache`)."""
    from backend.config import DrafterKind
    from backend.sequence import Request

    def make(index: int, p: dict):
        key = json.dumps(p["messages"])
        if key not in cache:
            cache[key] = tuple(prompt_ids(tok, p["messages"]))
        return Request(cache[key], dataclasses.replace(params, seed=request_seed(seed, index)), DrafterKind(kind), k)
    return make


def run_level(modes: list[_Mode], seed: int) -> None:
    """Drive the modes' schedulers one iteration each, in a random order per cycle, until every
    client has finished; each iteration's time is charged to its mode."""
    rng = np.random.default_rng(seed)
    for m in modes:
        for t in m.threads:
            t.start()
    live = list(modes)
    while live:
        did = False
        for i in rng.permutation(len(live)):
            m = live[i]
            if not m.sched.has_work():
                continue
            t0 = time.perf_counter()
            m.sched.iterate(block=False)
            m.busy_s += time.perf_counter() - t0
            m.iterations += 1
            did = True
        if not did:
            live = [m for m in live if m.running() or m.sched.has_work()]
            time.sleep(0.0005)        # clients are resubmitting (they need the GIL) or done
    for m in modes:
        m.sched.close()


def level_row(n: int, modes: list[_Mode], main_modes: list[str], sweep_ks: list[int], wall: float) -> dict:
    """One level's row (printed too): each main mode's throughput, step time, E[tau] and drafts
    per token, the ratios to plain, whether every mode's outputs equal plain's request for
    request, and the fixed-K sweep where it ran."""
    failed = [f"{m.name}: {e}" for m in modes for e in m.errors]
    if failed:
        raise SystemExit(f"n={n}: {len(failed)} request(s) failed, e.g. {failed[0]}")
    res = {m.name: m.row() for m in modes}
    plain = next(m for m in modes if m.name == "plain").outputs()
    row = {"n": n, "requests_per_mode": len(plain), "wall_s": round(wall, 1),
           "identical_outputs": all(m.outputs() == plain for m in modes)}
    for m in main_modes:
        r = res[m]
        row[f"{m}_tokens_per_s"] = round(r["tokens_per_s"], 2)
        row[f"{m}_output_tokens"] = r["tokens"]
        row[f"{m}_step_ms"] = round(r["step_ms"], 2)
        row[f"{m}_mean_accepted_tokens"] = round(r["mean_accepted_tokens"], 3)
        row[f"{m}_draft_tokens_per_output_token"] = round(r["draft_tokens_per_output_token"], 3)
    for m in ("fixed", "auto", "control"):
        row[f"{m}_speedup"] = round(row[f"{m}_tokens_per_s"] / row["plain_tokens_per_s"], 3)
    if sweep_ks:
        add_best_fixed(row, {k: res[f"k{k}"]["tokens_per_s"] for k in sweep_ks})
    print(f"n={n:<3d} plain {row['plain_tokens_per_s']:7.1f} tok/s  fixed K=5 x{row['fixed_speedup']:.3f} "
          f"(E[tau] {row['fixed_mean_accepted_tokens']:.2f})  auto x{row['auto_speedup']:.3f} (E[tau] "
          f"{row['auto_mean_accepted_tokens']:.2f}, drafts/token {row['auto_draft_tokens_per_output_token']:.2f})"
          f"  A/A control x{row['control_speedup']:.3f}  outputs identical: {row['identical_outputs']}"
          f"  [{wall:.0f} s]", flush=True)
    return row


def main(args) -> dict:
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.bench.prompt_sets import load_prompts
    from backend.engine import make_decoder
    from backend.runtime.ort import shared_sessions

    levels = [int(x) for x in str(args.concurrency).split(",")]
    if not 0 <= args.seed < 2**32:
        raise UserError(f"--seed must be in [0, 2**32), got {args.seed}")
    rounds = max(1, int(getattr(args, "rounds", 2)))
    prompts = load_prompts(args.prompts)
    drafter = args.drafter.partition(":")[0]
    repo = Path(args.model_repository)
    if not (repo / ENGINE_SUBDIR / "manifest.json").exists():
        raise ManifestMissing(f"no engines in {repo}: run `specdec build` first")
    # the modes decode the same prompts, several on one decoder: with the prefix cache every mode
    # after the first would skip the prefill, so it is off here (bench-prefix measures it)
    cfg = dataclasses.replace(_serve_config(repo), prefix_cache_mb=0)
    # a decoder each for plain, the control and auto (so the A/A control also reads any
    # difference between two loaded copies of the same engines, and the adaptive controller
    # learns from auto's steps only); the fixed-K modes share one (fixed K needs no estimates)
    # ... all sharing one ORT session per engine file: two loaded copies of the weights can
    # differ in speed by ~2% (memory placement), which is not what the control should read
    with shared_sessions():
        dec = {m: make_decoder(cfg) for m in ("plain", "control", "auto", "fixed")}
    tok = dec["plain"].tok
    params = sampling_params(args)
    ids: dict = {}

    specs = {"plain": (dec["plain"], "none", None), "fixed": (dec["fixed"], drafter, 5),
             "auto": (dec["auto"], drafter, None), "control": (dec["control"], "none", None)}
    sweep_ks = sweep_k_list(args, drafter)
    for k in sweep_ks:
        specs[f"k{k}"] = (dec["fixed"], drafter, k)
    main_modes = ["plain", "fixed", "auto", "control"]

    def modes_for(names, reqs, n):
        return [_Mode(m, specs[m][0], cfg.max_batch,
                      request_maker(tok, params, specs[m][1], specs[m][2], ids, args.seed), reqs, n) for m in names]

    # warm-up, not measured: ORT's first-call allocations, the controller's first estimates
    kinds = list({p.get("kind"): p for p in prompts}.values())
    run_level(modes_for(["plain", "fixed", "auto", "control"], kinds, 1), seed=0)
    rows = []
    for n in levels:
        reqs = [p for r in level_requests(prompts, n, rounds) for p in r]
        names = main_modes + ([f"k{k}" for k in sweep_ks] if n == 1 else [])
        modes = modes_for(names, reqs, n)
        t0 = time.perf_counter()
        run_level(modes, seed=n)
        wall = time.perf_counter() - t0
        rows.append(level_row(n, modes, main_modes, sweep_ks if n == 1 else [], wall))
    result = {"drafter": drafter, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "seed": args.seed, "ignore_eos": args.ignore_eos,
              "method": "paired: the modes time-sliced in one process, one scheduler iteration each in "
                        "random order per cycle; tokens per second of each mode's own iteration time; "
                        "request i of a level sampled with seed (seed << 32) | i in every mode",
              "concurrency": rows}
    return write_outputs(result, args, engine_threads(cfg.runtime))
