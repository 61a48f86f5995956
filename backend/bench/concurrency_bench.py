"""`specdec bench --concurrency 1,2,4,...`: speculation under load, against the real Triton server.

For each concurrency level n, n client threads (one gRPC stream each) send requests as fast as
they complete, in three modes on the same server: plain decoding (drafter none), fixed K = 5,
and auto (the adaptive controller). The level's requests (the prompt file cycled, every prompt
at least once, about 1.5 requests per stream per round) form rounds (at least `rounds`); every
mode runs every round's requests, in the order plain, fixed, auto in even rounds and reversed
in odd ones (ABC CBA), so a slow drift of the machine's speed cancels out of the ratios instead
of landing on whichever mode ran last. Reports total output tokens per second across all
streams (tokens / wall time, summed over rounds), TPOT and E[tau], each round's speedups (the
spread shows the noise), and draws speedup vs concurrency (PNG). With `--control`, a fourth mode
runs plain decoding again in the same rounds (an A/A control): its ratio to plain is what the
machine's noise alone reads, the yardstick for a 3% claim.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

from backend.bench.provenance import engine_threads, write_result
from backend.errors import ManifestMissing

MODES = ("plain", "fixed", "auto")


def _one_request(url: str, fields: dict) -> dict:
    from backend.serve import client

    t0 = time.perf_counter()
    times: list[float] = []

    def on_text(chunk: str) -> None:
        times.append(time.perf_counter())

    stats = client.stream_grpc(url, "specdec", fields, on_text)
    n = int(stats.get("output_token_count", 0))
    first = times[0] if times else time.perf_counter()
    return {"tokens": n, "seconds": time.perf_counter() - t0,
            "tpot_s": (times[-1] - first) / (n - 1) if n > 1 and times else 0.0,
            "tau": float(stats.get("mean_accepted_tokens", 0.0)),
            "draft_tokens": int(stats.get("total_draft_tokens", 0))}


def run_level(url: str, requests: list[dict], n: int, fields: dict) -> dict:
    work: queue.Queue = queue.Queue()
    for item in requests:
        work.put(item)
    results, errors = [], []
    lock = threading.Lock()

    def worker():
        while True:
            try:
                item = work.get_nowait()
            except queue.Empty:
                return
            msgs = json.dumps(item["messages"])
            try:
                r = _one_request(url, {**fields, "text_input": msgs})
            except Exception as exc:                   # report, keep measuring the rest
                errors.append(str(exc))
                continue
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    raw = {"tokens": sum(r["tokens"] for r in results), "seconds": wall, "results": results,
           "errors": errors}
    return {**_combine([raw]), "results": results}


def level_requests(prompts: list[dict], n: int, rounds: int) -> list[list[dict]]:
    """The prompt file cycled into rounds of about 1.5 requests per stream (so most of a round
    runs at n streams): at least `rounds` rounds and every prompt at least once per level. At
    low n that makes many short rounds, so the modes alternate every few seconds and slow
    drift of the machine (±5% over a minute here) cancels."""
    per_round = max(2, -(-3 * n // 2))
    rounds = max(rounds, -(-len(prompts) // per_round))
    cycled = [prompts[i % len(prompts)] for i in range(per_round * rounds)]
    return [cycled[r * per_round:(r + 1) * per_round] for r in range(rounds)]


def sweep_k_list(args, drafter: str) -> list[int]:
    """The other fixed K measured at n=1 (`--sweep-k`; tree sizes for tree drafters), 5 aside."""
    sweep = str(getattr(args, "sweep_k", "") or
                ("2,4,8,12,16" if drafter in ("eagle", "lookup+eagle") else "1,2,3,4,6,8"))
    return [int(k) for k in sweep.split(",") if k.strip() and int(k) != 5]


def add_best_fixed(row: dict, sweep_tokens_per_s: dict[int, float]) -> None:
    """Add the n=1 sweep to `row`: each fixed K's speedup, the best one, and auto / best."""
    fixed = {5: row["fixed_speedup"]}
    for k, tps in sweep_tokens_per_s.items():
        fixed[k] = round(tps / row["plain_tokens_per_s"], 3)
    best = max(fixed, key=fixed.get)
    row["fixed_k_speedup"] = {str(k): fixed[k] for k in sorted(fixed)}
    row["best_fixed_k"], row["best_fixed_speedup"] = best, fixed[best]
    row["auto_vs_best_fixed"] = round(row["auto_speedup"] / fixed[best], 3)
    print(f"n=1   fixed K sweep {row['fixed_k_speedup']}: best K={best} "
          f"x{fixed[best]:.2f}; auto / best fixed = {row['auto_vs_best_fixed']:.3f}", flush=True)


def _combine(parts: list[dict]) -> dict:
    results = [r for p in parts for r in p["results"]]
    tokens = sum(p["tokens"] for p in parts)
    seconds = sum(p["seconds"] for p in parts)
    taus = [r["tau"] for r in results if r["tau"] > 0]
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "tpot_ms": 1000 * sum(r["tpot_s"] for r in results) / max(1, len(results)),
            "mean_accepted_tokens": sum(taus) / len(taus) if taus else 1.0,
            "draft_tokens_per_output_token": sum(r["draft_tokens"] for r in results) / max(1, tokens),
            "errors": [e for p in parts for e in p["errors"]]}


def main(args) -> dict:
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.bench.prompt_sets import load_prompts
    from backend.serve.launcher import TritonServer

    levels = [int(x) for x in str(args.concurrency).split(",")]
    rounds = max(1, int(getattr(args, "rounds", 2)))
    prompts = load_prompts(args.prompts)
    drafter = args.drafter.partition(":")[0]
    base = {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "stream": True,
            "apply_chat_template": True}
    modes = {"plain": {**base, "drafter": "none"},
             "fixed": {**base, "drafter": drafter, "num_draft_tokens": 5},
             "auto": {**base, "drafter": drafter}}
    main_modes = MODES + (("control",) if getattr(args, "control", False) else ())
    if "control" in main_modes:
        modes["control"] = modes["plain"]
    # at n=1 also every other fixed K (tree sizes for tree drafters), same rounds: is auto
    # within 5% of the best fixed K?
    sweep_ks = sweep_k_list(args, drafter)
    for k in sweep_ks:
        modes[f"k{k}"] = {**base, "drafter": drafter, "num_draft_tokens": k}
    repo = Path(args.model_repository)
    if not (repo / ENGINE_SUBDIR / "manifest.json").exists():
        raise ManifestMissing(f"no engines in {repo}: run `specdec build` first")
    rows = []
    # every mode sends the same prompts: with the prefix cache every mode after the first would
    # skip the prefill, so the server runs without it (bench-prefix measures the cache)
    with TritonServer(repo, log_file=Path(args.json or "bench").with_suffix(".server.log"),
                      env={"SPECDEC_PREFIX_CACHE_MB": "0"}) as srv:
        # warm-up, not measured: the first prompt of each kind once per mode, so that ORT's
        # first-call allocations and the adaptive controller's first estimates (cost
        # corrections, pooled acceptance) are settled before n=1 rather than charged to it
        # alone (n=1 runs first; every later level finds them settled)
        kinds = {}
        for p in prompts:
            kinds.setdefault(p.get("kind"), p)
        for mode in MODES:
            run_level(srv.grpc_url, list(kinds.values()), 1, modes[mode])
        for n in levels:
            names = list(main_modes) + ([f"k{k}" for k in sweep_ks] if n == 1 else [])
            parts: dict[str, list[dict]] = {m: [] for m in names}
            for i, requests in enumerate(level_requests(prompts, n, rounds)):
                for mode in (names if i % 2 == 0 else names[::-1]):     # ABC CBA: drift cancels
                    parts[mode].append(run_level(srv.grpc_url, requests, n, modes[mode]))
            row = {"n": n, "requests_per_mode": sum(len(p["results"]) for p in parts["plain"])}
            for mode in main_modes:
                r = _combine(parts[mode])
                row[f"{mode}_tokens_per_s"] = round(r["tokens_per_s"], 2)
                row[f"{mode}_tpot_ms"] = round(r["tpot_ms"], 2)
                row[f"{mode}_mean_accepted_tokens"] = round(r["mean_accepted_tokens"], 3)
                row[f"{mode}_draft_tokens_per_output_token"] = round(r["draft_tokens_per_output_token"], 3)
                if r["errors"]:
                    row[f"{mode}_errors"] = r["errors"][:3]
            row["fixed_speedup"] = round(row["fixed_tokens_per_s"] / row["plain_tokens_per_s"], 3)
            row["auto_speedup"] = round(row["auto_tokens_per_s"] / row["plain_tokens_per_s"], 3)
            if "control" in main_modes:
                row["control_speedup"] = round(row["control_tokens_per_s"] / row["plain_tokens_per_s"], 3)
            for mode in main_modes[1:]:
                row[f"{mode}_speedup_per_round"] = [round(a["tokens_per_s"] / p["tokens_per_s"], 3)
                                                    for a, p in zip(parts[mode], parts["plain"])]
            if n == 1 and sweep_ks:
                add_best_fixed(row, {k: _combine(parts[f"k{k}"])["tokens_per_s"] for k in sweep_ks})
            rows.append(row)
            print(f"n={n:<3d} plain {row['plain_tokens_per_s']:7.1f} tok/s  fixed K=5 "
                  f"{row['fixed_tokens_per_s']:7.1f} (x{row['fixed_speedup']:.2f}, E[tau] "
                  f"{row['fixed_mean_accepted_tokens']:.2f})  auto {row['auto_tokens_per_s']:7.1f} "
                  f"(x{row['auto_speedup']:.2f}, E[tau] {row['auto_mean_accepted_tokens']:.2f}, drafts/token "
                  f"{row['auto_draft_tokens_per_output_token']:.2f})  per round: fixed "
                  f"{row['fixed_speedup_per_round']} auto {row['auto_speedup_per_round']}"
                  + (f"  A/A control x{row['control_speedup']:.2f} {row['control_speedup_per_round']}"
                     if "control" in main_modes else ""), flush=True)
    result = {"drafter": drafter, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "rounds": rounds, "order": "ABC CBA (plain, fixed, auto[, control][, fixed K sweep at n=1]; "
                                          "reversed in odd rounds)",
              "concurrency": rows}
    return write_outputs(result, args, engine_threads())     # the server inherits SPECDEC_THREADS from here


def write_outputs(result: dict, args, threads: int | None) -> dict:
    """Write a load bench's result where --json (with its provenance) and --plot ask (both
    benches); returns what --json holds."""
    if args.json:
        result = write_result(args.json, result, threads)
    if args.plot:
        plot(result, Path(args.plot))
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["concurrency"]
    n = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(n, [r["fixed_speedup"] for r in rows], marker="o", label="fixed K=5")
    ax.plot(n, [r["auto_speedup"] for r in rows], marker="s", label="auto (cost model + acceptance)")
    if all("control_speedup" in r for r in rows):
        ax.plot(n, [r["control_speedup"] for r in rows], marker="x", ls=":", color="gray",
                label="plain again (A/A control: the noise)")
    ax.axhline(1.0, color="gray", lw=1, ls="--", label="plain decoding")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(x) for x in n])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("throughput / plain throughput")
    where = "modes time-sliced in one process" if "method" in result else "on Triton"
    ax.set_title(f"specdec {where}: {result['drafter']}, {result['max_new_tokens']} tokens")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
