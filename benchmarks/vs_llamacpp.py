#!/usr/bin/env python3
"""Compare specdec's decode speed against llama.cpp on the same GGUF model and prompts.

Run with the project's main venv python:

    python benchmarks/vs_llamacpp.py --gguf MODEL.gguf --prompts prompts.jsonl \
        --max-new-tokens 64 --threads 2 --json out.json [--peer-only]

Steps:
  (a) make sure the peer virtualenv benchmarks/.peer-venv exists with a pinned
      llama-cpp-python (built from source with cmake: several minutes on 2 cores;
      llama.cpp's default GGML_NATIVE=ON compiles with -march=native, so it uses
      AVX2/AVX-512/VNNI where the CPU has them). On x86-64 we add CFLAGS/CXXFLAGS
      "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16": on an AMX Xeon -march=native turns
      on ggml's AMX matmul path, which dies with SIGILL (tileloadd) on the first
      forward pass unless the process asked Linux for the tile state, and with a
      general-protection fault in its repack even after the request (0.3.36;
      --peer-amx builds it with its defaults in .peer-venv-amx and records how it
      ran or died, issue 44). Extra CMake flags can be passed
      through the CMAKE_ARGS environment variable, which pip's build picks up.
      The flags used are recorded in .peer-venv/specdec-peer-build.json; a venv
      built with other flags/version is rebuilt.
  (b) run benchmarks/peer_llamacpp.py inside it and load its JSON;
  (c) run our engine via run_ours() (skipped with --peer-only);
  (d) print both, the ratio ours / llama.cpp, and write a combined JSON.

The orchestrator itself only uses the standard library and backend/bench/provenance.py (which
does too: the combined JSON's date, machine, commit and command); run_ours imports specdec.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from backend.bench.provenance import write_result  # noqa: E402

PEER_VENV = HERE / ".peer-venv"
PEER_SCRIPT = HERE / "peer_llamacpp.py"
# Pinned: this version built from source here (Python 3.11, gcc, cmake, 2 cores).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BUILD_MARKER = "specdec-peer-build.json"


# --------------------------------------------------------------------------------------
# (c) our engine
# --------------------------------------------------------------------------------------


def run_ours(gguf_path: str, prompts_path: str, max_new_tokens: int, weights: str | None = None) -> dict:
    """Benchmark specdec on the same GGUF and prompts, measuring what peer_llamacpp.py measures:
    the chat template rendered with add_generation_prompt=True (no BOS), greedy decoding of
    exactly `max_new_tokens` new tokens with EOS ignored, a fresh KV cache per prompt, one
    untimed warm-up generation, decode-only throughput = (new tokens after the first) / (time
    after the first new token). Every weight format built is measured; the fastest is "ours".
    Then end to end (prefill included, all new tokens over the whole time): plain decoding and
    speculative decoding with `--drafter auto` on the serving format, as `specdec serve` runs
    them (the embedded default's drafts, the build's cost model)."""
    from backend.bench.engine_bench import greedy_tokens_per_s
    from backend.builder.embedded import default_drafts, default_gguf
    from backend.builder.pipeline import ENGINE_SUBDIR, BuildConfig, build
    from backend.manifest import EngineManifest, WeightFormat

    # the embedded default with its drafts (self:4 and the trained EAGLE-3 head); another
    # model with a self-draft of its first quarter (prompt lookup needs no build)
    embedded = Path(gguf_path).resolve() == Path(default_gguf()).resolve()
    repo = HERE / ".ours-repo" / Path(gguf_path).stem
    engine_dir = repo / ENGINE_SUBDIR
    formats = tuple(WeightFormat(w) for w in weights.split(",")) if weights else None
    try:
        manifest = EngineManifest.load(engine_dir)
        if Path(manifest.source).resolve() != Path(gguf_path).resolve() or manifest.cost_model is None \
                or (formats and set(manifest.engines) != {f.value for f in formats}):
            raise FileNotFoundError
    except (FileNotFoundError, ValueError):
        if embedded:
            drafts = default_drafts()
        else:
            from backend.buildlib.checkpoint import load_checkpoint

            drafts = (f"self:{max(1, load_checkpoint(gguf_path).config.num_layers // 4)}",)
        manifest = build(BuildConfig(target=str(gguf_path), output=repo, drafts=drafts, quiet=True, weights=formats))
    prompts = [json.loads(line) for line in Path(prompts_path).read_text().splitlines() if line.strip()]
    by_format = {fmt: greedy_tokens_per_s(manifest, fmt, prompts, max_new_tokens)
                 for fmt in manifest.engines}
    best = max(by_format, key=lambda f: by_format[f]["tokens_per_s"])
    serving = manifest.default_format.value
    e2e = {d: greedy_tokens_per_s(manifest, serving, prompts, max_new_tokens, decode_only=False, drafter=d)
           for d in ("none", "auto")}
    return {
        "decode_tokens_per_s": by_format[best]["tokens_per_s"],
        "format": best,
        "decode_tokens_per_s_by_format": {f: r["tokens_per_s"] for f, r in by_format.items()},
        "per_prompt": [{"id": p["id"], "decode_tokens_per_s": p["tokens_per_s"], "prefill_ms": p["prefill_ms"],
                        "token_ids": p["token_ids"]} for p in by_format[best]["per_prompt"]],
        "end_to_end": {"format": serving,
                       **{f"{d}_tokens_per_s": r["tokens_per_s"] for d, r in e2e.items()},
                       "auto_outputs_equal_plain": all(a["token_ids"] == b["token_ids"] for a, b in
                                                       zip(e2e["none"]["per_prompt"], e2e["auto"]["per_prompt"]))},
    }


def peer_end_to_end(peer: dict) -> float:
    """llama.cpp's end-to-end tokens/s: all new tokens over all prefill + decode time."""
    rows = peer["per_prompt"]
    return sum(r["new_tokens"] for r in rows) / (sum(r["prefill_ms"] + r["decode_ms"] for r in rows) / 1000)


# --------------------------------------------------------------------------------------
# (a) peer venv
# --------------------------------------------------------------------------------------


def peer_python(venv: Path = PEER_VENV) -> Path:
    return venv / "bin" / "python"


def installed_peer_version(venv: Path = PEER_VENV) -> str | None:
    py = peer_python(venv)
    if not py.exists():
        return None
    try:
        out = subprocess.run(
            [str(py), "-c", "import llama_cpp, numpy, jinja2; print(llama_cpp.__version__)"],
            capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


PEER_VENV_AMX = HERE / ".peer-venv-amx"    # llama.cpp's defaults: its AMX path where the CPU has AMX


def build_flags(amx: bool = False) -> dict[str, str]:
    """Compiler/CMake settings for building llama-cpp-python (see module docstring); amx: its
    defaults, AMX left on (the --peer-amx attempt)."""
    flags: dict[str, str] = {}
    if platform.machine().lower() in ("x86_64", "amd64") and not amx:
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags["CFLAGS"] = (os.environ.get("CFLAGS", "") + " " + no_amx).strip()
        flags["CXXFLAGS"] = (os.environ.get("CXXFLAGS", "") + " " + no_amx).strip()
    if os.environ.get("CMAKE_ARGS"):
        flags["CMAKE_ARGS"] = os.environ["CMAKE_ARGS"]
    return flags


def ensure_peer_venv(base_python: str = "python3", version: str = LLAMA_CPP_PYTHON_VERSION,
                     venv: Path = PEER_VENV, amx: bool = False) -> str:
    """Create/repair the peer venv; returns the installed llama-cpp-python version."""
    flags = build_flags(amx)
    want = {"llama_cpp_python": version, "build_env": flags}
    marker = venv / BUILD_MARKER
    have = installed_peer_version(venv)
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        recorded = None
    if have == version and recorded == want:
        return have
    if have is not None:
        print(f"[vs] peer venv has llama-cpp-python {have} built with {recorded}, "
              f"want {want}: rebuilding", flush=True)
    if not peer_python(venv).exists():
        print(f"[vs] creating peer venv {venv} with {base_python}", flush=True)
        subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ)
    env.update(flags)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    print(f"[vs] pip install llama-cpp-python=={version} with {flags} "
          f"(compiles llama.cpp: ~8 min on 2 cores)", flush=True)
    t = time.time()
    # --no-cache-dir: pip would otherwise reuse a wheel cached from a build with other flags
    subprocess.run([str(peer_python(venv)), "-m", "pip", "install", "--no-input",
                    "--no-cache-dir", "--force-reinstall", "--no-deps",
                    f"llama-cpp-python=={version}"], check=True, env=env)
    subprocess.run([str(peer_python(venv)), "-m", "pip", "install", "--no-input",
                    f"llama-cpp-python=={version}"], check=True, env=env)  # its deps
    print(f"[vs] peer build/install took {time.time() - t:.0f} s", flush=True)
    have = installed_peer_version(venv)
    if have != version:
        raise RuntimeError(f"llama-cpp-python import check failed after install (got {have!r})")
    marker.write_text(json.dumps(want, indent=1) + "\n")
    return have


# --------------------------------------------------------------------------------------
# (b) peer run
# --------------------------------------------------------------------------------------


def run_peer(gguf: str, prompts: str, max_new_tokens: int, threads: int,
             out_json: str, flash_attn: str = "off", extra: list[str] | None = None,
             venv: Path = PEER_VENV) -> dict:
    cmd = [str(peer_python(venv)), str(PEER_SCRIPT), "--gguf", gguf, "--prompts", prompts,
           "--max-new-tokens", str(max_new_tokens), "--threads", str(threads),
           "--flash-attn", flash_attn, "--json", out_json, *(extra or [])]
    print("[vs] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(out_json, encoding="utf-8") as f:
        return json.load(f)


def try_peer_amx(gguf: str, prompts: str, max_new_tokens: int, threads: int, out_json: str,
                 base_python: str) -> dict:
    """llama.cpp's own AMX path (issue 44, point 6): built with its defaults (AMX on where the CPU
    has it), run with the tile permission asked first; where it dies (llama-cpp-python 0.3.36:
    a general-protection fault in libggml-cpu's AMX repack on this Xeon), how -> a record."""
    version = ensure_peer_venv(base_python, venv=PEER_VENV_AMX, amx=True)
    try:
        peer = run_peer(gguf, prompts, max_new_tokens, threads, out_json, "off", ["--request-amx"], PEER_VENV_AMX)
    except subprocess.CalledProcessError as exc:
        died = f"signal {-exc.returncode}" if exc.returncode < 0 else f"exit code {exc.returncode}"
        print(f"[vs] llama.cpp's AMX build died ({died}): the -mno-amx build stays the peer", flush=True)
        return {"llama_cpp_python_version": version, "ran": False, "died": died}
    sysinfo = peer["meta"].get("system_info", "")
    return {"llama_cpp_python_version": version, "ran": True, "amx_in_build": "AMX_INT8 = 1" in sysinfo,
            "amx_permission": peer["meta"].get("amx_permission"),
            "decode_tokens_per_s": peer["overall"]["decode_tokens_per_s"], "run": peer}


# --------------------------------------------------------------------------------------
# (d) report
# --------------------------------------------------------------------------------------


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(peer: dict, ours: dict | None) -> dict[str, Any]:
    p_tps = peer["overall"]["decode_tokens_per_s"]
    res: dict[str, Any] = {"llamacpp_decode_tokens_per_s": p_tps,
                           "llamacpp_median_ms_per_token": peer["overall"].get("median_ms_per_token"),
                           "ours_decode_tokens_per_s": None, "ratio_ours_over_llamacpp": None,
                           "per_prompt": []}
    ours_by_id = {}
    if ours is not None:
        o_tps = ours.get("decode_tokens_per_s")
        res["ours_decode_tokens_per_s"] = o_tps
        if o_tps and p_tps:
            res["ratio_ours_over_llamacpp"] = o_tps / p_tps
        ours_by_id = {str(r.get("id")): r for r in ours.get("per_prompt", [])}
    for pr in peer["per_prompt"]:
        row: dict[str, Any] = {"id": pr["id"], "kind": pr.get("kind"),
                               "prompt_tokens": pr["prompt_tokens"],
                               "llamacpp_prefill_ms": pr["prefill_ms"],
                               "llamacpp_decode_tokens_per_s": pr["decode_tokens_per_s"]}
        o = ours_by_id.get(str(pr["id"]))
        if o is not None:
            row["ours_prefill_ms"] = o.get("prefill_ms")
            row["ours_decode_tokens_per_s"] = o.get("decode_tokens_per_s")
            if o.get("decode_tokens_per_s") and pr["decode_tokens_per_s"]:
                row["ratio"] = o["decode_tokens_per_s"] / pr["decode_tokens_per_s"]
            if o.get("token_ids") is not None:
                row["greedy_match_prefix"] = _common_prefix(o["token_ids"], pr["token_ids"])
        res["per_prompt"].append(row)
    return res


def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def print_report(cmp: dict) -> None:
    print()
    hdr = (f"{'id':<28} {'p_tok':>6} {'lc_prefill_ms':>13} {'lc_tok/s':>9} "
           f"{'our_prefill_ms':>14} {'our_tok/s':>9} {'ratio':>6} {'match':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in cmp["per_prompt"]:
        print(f"{str(r['id'])[:28]:<28} {r['prompt_tokens']:>6} {_f(r['llamacpp_prefill_ms']):>13} "
              f"{_f(r['llamacpp_decode_tokens_per_s']):>9} {_f(r.get('ours_prefill_ms')):>14} "
              f"{_f(r.get('ours_decode_tokens_per_s')):>9} {_f(r.get('ratio'), '.2f'):>6} "
              f"{_f(r.get('greedy_match_prefix'), 'd'):>5}")
    print("-" * len(hdr))
    print(f"llama.cpp decode-only: {_f(cmp['llamacpp_decode_tokens_per_s'])} tok/s "
          f"(median {_f(cmp['llamacpp_median_ms_per_token'], '.2f')} ms/token)")
    print(f"ours      decode-only: {_f(cmp['ours_decode_tokens_per_s'])} tok/s")
    print(f"ratio ours/llama.cpp : {_f(cmp['ratio_ours_over_llamacpp'], '.3f')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="specdec vs llama.cpp decode benchmark")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", dest="json_out", default=None, help="combined JSON output")
    ap.add_argument("--peer-only", action="store_true", help="only run llama.cpp")
    ap.add_argument("--peer-flash-attn", choices=["both", "auto", "on", "off"], default="both",
                    help="llama.cpp flash attention for the peer run(s). Default both: 'off' (the "
                         "faster setting on this CPU, the main comparison) and 'auto' (llama.cpp's "
                         "stock default, which decodes ~30%% slower here)")
    ap.add_argument("--weights", default=None,
                    help="our weight formats to build and measure (default: the device's: gguf,fp32,q4)")
    ap.add_argument("--peer-amx", action="store_true",
                    help="also try llama.cpp's own AMX path: a second peer build with its defaults, run with "
                         "the tile permission asked; recorded as it ran or as it died")
    ap.add_argument("--peer-python", default="python3",
                    help="interpreter used to create the peer venv (default: python3)")
    args = ap.parse_args(argv)

    gguf = os.path.abspath(args.gguf)
    prompts = os.path.abspath(args.prompts)
    for p in (gguf, prompts):
        if not os.path.exists(p):
            ap.error(f"not found: {p}")
    if shutil.which(args.peer_python) is None and not os.path.exists(args.peer_python):
        ap.error(f"peer python not found: {args.peer_python}")

    version = ensure_peer_venv(args.peer_python)
    modes = ["off", "auto"] if args.peer_flash_attn == "both" else [args.peer_flash_attn]
    peers = {}
    with tempfile.TemporaryDirectory(prefix="vs_llamacpp_") as td:
        for mode in modes:   # "auto" is llama.cpp's stock setting; "off" is faster here
            peers[mode] = run_peer(gguf, prompts, args.max_new_tokens, args.threads,
                                   os.path.join(td, f"peer_{mode}.json"), flash_attn=mode)
        peer_amx = (try_peer_amx(gguf, prompts, args.max_new_tokens, args.threads, os.path.join(td, "peer_amx.json"),
                                 args.peer_python) if args.peer_amx else None)
    peer = peers[modes[0]]
    sysinfo = peer["meta"].get("system_info", "")
    if "AVX2 = 1" not in sysinfo:
        print(f"[vs] WARNING: llama.cpp build does not report AVX2: {sysinfo}", file=sys.stderr)

    ours = None if args.peer_only else run_ours(gguf, prompts, args.max_new_tokens, args.weights)
    ours_error = None
    cmp = compare(peer, ours)
    print_report(cmp)
    by_mode = {m: compare(p, ours) for m, p in peers.items()}
    e2e = {}
    for mode, c in by_mode.items():
        e2e[mode] = {"llamacpp_tokens_per_s": peer_end_to_end(peers[mode])}
        print(f"llama.cpp flash_attn={mode}: {_f(c['llamacpp_decode_tokens_per_s'])} tok/s; "
              f"ours/llama.cpp = {_f(c['ratio_ours_over_llamacpp'], '.3f')}")
        if ours is not None:
            ours_e2e = ours["end_to_end"]
            e2e[mode].update({f"ratio_{d}_over_llamacpp": ours_e2e[f"{d}_tokens_per_s"] / e2e[mode]["llamacpp_tokens_per_s"]
                              for d in ("none", "auto")})
            print(f"  end to end (prefill included): llama.cpp {_f(e2e[mode]['llamacpp_tokens_per_s'])} tok/s; "
                  f"ours {ours_e2e['format']} plain {_f(ours_e2e['none_tokens_per_s'])} "
                  f"(x{_f(e2e[mode]['ratio_none_over_llamacpp'], '.3f')}), --drafter auto "
                  f"{_f(ours_e2e['auto_tokens_per_s'])} (x{_f(e2e[mode]['ratio_auto_over_llamacpp'], '.3f')}); "
                  f"auto outputs equal plain: {ours_e2e['auto_outputs_equal_plain']}")
    combined = {
        "by_flash_attn": {m: {"llamacpp_decode_tokens_per_s": c["llamacpp_decode_tokens_per_s"],
                              "ratio_ours_over_llamacpp": c["ratio_ours_over_llamacpp"],
                              "end_to_end": e2e[m]}
                          for m, c in by_mode.items()},
        "config": {"gguf": gguf, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
                   "threads": args.threads, "peer_only": args.peer_only,
                   "peer_flash_attn": args.peer_flash_attn,
                   "llama_cpp_python_version": version},
        "comparison": cmp,
        "llamacpp": peer,
        "llamacpp_amx": peer_amx,
        "ours": ours,
        "ours_error": ours_error,
    }
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        write_result(args.json_out, combined, args.threads)     # date, machine, commit, command
        print(f"[vs] wrote {args.json_out}")
    return 3 if ours_error else 0


if __name__ == "__main__":
    sys.exit(main())
