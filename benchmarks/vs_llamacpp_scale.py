#!/usr/bin/env python3
"""specdec against llama.cpp at the sizes users run (issue 53, points 3 and 5): plain decode
tokens/s and time to first token on the same GGUF, the same token ids and the same threads,
llama.cpp with flash attention off and on, each engine's decode as a share of this machine's DRAM
read bandwidth measured by the same run; alternated so a busy machine lands on every engine alike.

    python benchmarks/vs_llamacpp_scale.py --gguf /work/wt/_big/llama-8b.Q4_K_M.gguf \\
        --repo /work/wt/_big/repo-llama-8b.Q4_K_M --json docs/results/scale_llama-8b_Q4_K_M.json

Steps: the peer venv (vs_llamacpp.ensure_peer_venv); our repository built with the default command
`specdec build --target GGUF --output REPO` where it is missing (its wall time, CPU time and peak
memory recorded); the token ids, once, with our tokenizer: each --prompts item as the server
renders it (chat template, or plain text for a base model), plus --ttft prompts of random ids
(512 and 2,048 tokens); then --rounds rounds, each running in turn, one process at a time (an 8B
is never held twice): the bandwidth reader, llama.cpp (flash attention off), llama.cpp (on), ours,
the order rotated every round. Each engine's rounds give its A/A spread; ours/llama.cpp is taken
per round (the two read in the same round) and its median reported.
Every number is wall clock on whatever else the machine runs: `cpu_share` of the bandwidth reads
and the load average say how busy it was; a run where they say busy needs a quiet rerun.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from backend.bench.provenance import write_result  # noqa: E402
from vs_llamacpp import PEER_SCRIPT, ensure_peer_venv, peer_python  # noqa: E402

ENGINES = ("bandwidth", "llamacpp_fa_off", "llamacpp_fa_on", "specdec")


DEFAULT_MAX_SEQ = 2048       # `specdec build`'s --max-seq-len


def context_needed(args) -> int:
    """The longest sequence the run makes: its longest --ttft prompt and its new tokens."""
    return max([int(x) for x in args.ttft.split(",") if x] + [0]) + args.new_tokens + 1


def build_default(gguf: str, repo: str, need: int = 0) -> dict:
    """`specdec build --target GGUF --output REPO`, the README's command (with `--max-seq-len`, the
    next power of two, only where the run's longest sequence exceeds the default's 2,048: a
    2,048-token time-to-first-token prompt and its new tokens): wall and CPU seconds and the peak
    memory of its process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    cmd = [str(Path(sys.executable).parent / "specdec"), "build", "--target", gguf, "--output", repo]
    if need > DEFAULT_MAX_SEQ:
        cmd += ["--max-seq-len", str(1 << (need - 1).bit_length())]
    done = subprocess.run(cmd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"the default build failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(done.stderr[-1500:], file=sys.stderr)
    return {"command": " ".join(cmd), "wall_s": round(time.time() - t0, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "peak_rss_bytes": after.ru_maxrss * 1024, "log_tail": done.stderr[-4000:]}


def token_ids(repo: str, prompts: str, ttft: list[int], seed: int = 0) -> list[dict]:
    """The prompts as the server tokenizes them, and random-id prompts of each --ttft length."""
    import numpy as np

    from backend.bench.prompt_sets import load_prompts, prompt_ids
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.manifest import EngineManifest
    from backend.tokenizer import Tokenizer

    m = EngineManifest.load(Path(repo) / ENGINE_SUBDIR)
    tok = Tokenizer.from_manifest(m)
    items = [{"id": p["id"], "kind": p["kind"], "token_ids": prompt_ids(tok, p["messages"])} for p in load_prompts(prompts)]
    rng = np.random.default_rng(seed)
    normal = min(m.model.vocab_size, tok.vocab_size) - 300          # below the special tokens at the end
    for n in ttft:
        items.append({"id": f"ttft-{n}", "kind": "ttft", "token_ids": rng.integers(300, normal, n).tolist()})
    return items


def run_one(engine: str, args, ids_json: str, out: str) -> dict:
    if engine == "bandwidth":
        cmd = [sys.executable, "-m", "backend.bench.scale", "bandwidth", "--gib", str(args.gib),
               "--threads", str(args.threads), "--json", out]
    elif engine == "specdec":
        cmd = [sys.executable, "-m", "backend.bench.scale", "ours", "--repo", args.repo, "--ids-json", ids_json,
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--json", out]
    else:
        cmd = [str(peer_python()), str(PEER_SCRIPT), "--gguf", args.gguf, "--ids-json", ids_json,
               "--max-new-tokens", str(args.new_tokens), "--threads", str(args.threads),
               "--flash-attn", engine.rsplit("_", 1)[1], "--json", out]
    print(f"[scale] {engine}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=str(HERE.parent), stdout=subprocess.DEVNULL)
    return json.loads(Path(out).read_text())


def summary(engine: str, r: dict) -> dict:
    """One run's figures: decode tokens/s over the --prompts items, each --ttft prompt's ms."""
    if engine == "bandwidth":
        return {"read_gb_per_s": r["read_gb_per_s"], "cpu_share": max(x["cpu_share"] for x in r["readings"])}
    rows = r["per_prompt"]
    dec = [x for x in rows if x["kind"] != "ttft"]
    steps = sum(x["new_tokens"] - 1 for x in dec)
    out = {"decode_tokens_per_s": round(steps / (sum(x["decode_ms"] for x in dec) / 1000), 3),
           "ttft_ms": {str(x["prompt_tokens"]): round(x["prefill_ms"], 1) for x in rows if x["kind"] == "ttft"},
           "token_ids": {str(x["id"]): x["token_ids"] for x in rows}}
    if engine == "specdec":
        out.update({k: r[k] for k in ("rss_engine", "file_bytes", "kv_bytes_longest", "weight_bytes_per_token", "isa")})
    else:
        out["max_rss_bytes"] = r["meta"].get("max_rss_bytes")
    return out


def report(runs: dict[str, list[dict]], source_bytes: int, ours_bytes: int) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None
    bw = med([r["read_gb_per_s"] for r in runs["bandwidth"]])
    out: dict = {"bandwidth_gb_per_s": bw, "engines": {}}
    for e in ENGINES[1:]:
        tps = [r["decode_tokens_per_s"] for r in runs[e]]
        per_token = ours_bytes if e == "specdec" else source_bytes
        ttft = {n: med([r["ttft_ms"][n] for r in runs[e]]) for n in runs[e][0]["ttft_ms"]}
        out["engines"][e] = {"decode_tokens_per_s": med(tps), "rounds": tps,
                             "aa_spread": round(max(tps) / min(tps) - 1, 4) if len(tps) > 1 else None,
                             "bandwidth_share": round(med(tps) * per_token / 1e9 / bw, 4) if bw else None,
                             "ttft_ms": ttft, "prefill_tokens_per_s": {n: round(int(n) / (ms / 1000), 1) for n, ms in ttft.items()}}
    for peer in ("llamacpp_fa_off", "llamacpp_fa_on"):
        ratios = [o["decode_tokens_per_s"] / p["decode_tokens_per_s"] for o, p in zip(runs["specdec"], runs[peer])]
        ttft = {n: statistics.median([p["ttft_ms"][n] / o["ttft_ms"][n] for o, p in zip(runs["specdec"], runs[peer])])
                for n in runs[peer][0]["ttft_ms"]}
        out[f"decode_ratio_vs_{peer}"] = {"median": round(med(ratios), 4), "rounds": [round(x, 4) for x in ratios]}
        out[f"prefill_speedup_vs_{peer}"] = {n: round(v, 3) for n, v in ttft.items()}
    a, b = runs["specdec"][0]["token_ids"], runs["llamacpp_fa_off"][0]["token_ids"]
    out["greedy_match_prefix_vs_llamacpp"] = {k: next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), len(a[k]))
                                              for k in a}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--repo", required=True, help="our model repository for the GGUF (built with the default command if missing)")
    ap.add_argument("--prompts", default=str(HERE / "prompts" / "public.jsonl"))
    ap.add_argument("--limit", type=int, default=4, help="the first N prompts (default 4)")
    ap.add_argument("--ttft", default="512,2048", help="prompt lengths of random ids for time to first token")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gib", type=float, default=4.0, help="the bandwidth reader's buffer (>> the last-level cache)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    args.gguf, args.repo = os.path.abspath(args.gguf), os.path.abspath(args.repo)
    ensure_peer_venv()
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.manifest import EngineManifest

    need = context_needed(args)
    built = None if (Path(args.repo) / ENGINE_SUBDIR / "manifest.json").exists() else \
        build_default(args.gguf, args.repo, need)
    m = EngineManifest.load(Path(args.repo) / ENGINE_SUBDIR)
    if m.max_seq_len < need:       # refused before any engine runs, not a traceback mid-run
        raise SystemExit(f"{args.repo} takes {m.max_seq_len} tokens; --ttft {args.ttft} with --new-tokens "
                         f"{args.new_tokens} needs {need}: build it with --max-seq-len {1 << (need - 1).bit_length()}")
    items = token_ids(args.repo, args.prompts, [int(x) for x in args.ttft.split(",") if x])
    items = [x for x in items if x["kind"] != "ttft"][:args.limit] + [x for x in items if x["kind"] == "ttft"]
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    raw: dict[str, list[dict]] = {e: [] for e in ENGINES}
    with tempfile.TemporaryDirectory(prefix="scale_") as td:
        ids_json = os.path.join(td, "ids.json")
        Path(ids_json).write_text(json.dumps(items))
        for r in range(args.rounds):
            for e in ENGINES[r % len(ENGINES):] + ENGINES[:r % len(ENGINES)]:
                out = run_one(e, args, ids_json, os.path.join(td, f"{e}_{r}.json"))
                raw[e].append(out)
                runs[e].append(summary(e, out))
                print(f"[scale] round {r} {e}: " + json.dumps({k: v for k, v in runs[e][-1].items() if k != "token_ids"}),
                      flush=True)
    result = {"gguf": args.gguf, "repo": args.repo, "file_bytes": os.path.getsize(args.gguf), "build": built,
              "model": {k: getattr(m.model, k) for k in ("architecture", "hidden_size", "num_layers", "vocab_size")}, "config": {k: v for k, v in vars(args).items()},
              "loadavg_end": os.getloadavg(), "prompt_tokens": {x["id"]: len(x["token_ids"]) for x in items},
              **report(runs, m.source_bytes_per_token, m.engine().weight_bytes_per_token),
              "runs": {e: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for e, rs in runs.items()},
              "bandwidth_readings": [x["readings"] for x in raw["bandwidth"]]}
    write_result(args.json, result, args.threads)
    print(json.dumps({k: result[k] for k in result if k.startswith(("decode_ratio", "prefill_speedup", "bandwidth_gb"))}, indent=1))
    for e, v in result["engines"].items():
        print(f"{e:16s} decode {v['decode_tokens_per_s']:.2f} tok/s (rounds {v['rounds']}, A/A {v['aa_spread']}), "
              f"{v['bandwidth_share']} of the read bandwidth; TTFT ms {v['ttft_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
