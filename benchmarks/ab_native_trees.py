"""The native decode step of two source trees, alternated in one process, where the trees' kernel ABIs
differ (so `specdec bench-engine --builds`, which runs every library through this tree's ctypes
mirror, cannot load the other's): each side is its own tree's Python (runtime/native.py, its model
records) over its own compiled library, the other tree's `backend` and `plugins` imported under
other names (a copy whose imports are renamed; nothing else changes). Settings: base (the other
tree), new (this tree), base_AA (the other tree again, a second runtime: the A/A control). B=1
forwards of T tokens after `--context` tokens, one engine thread and this thread's CPU time (or
`--threads N`: N engine threads and wall time, for a quiet machine), each rep
the settings in rotated order on the same tokens; medians over reps after the first; every
setting's logits compared bit for bit with base's.

    .venv/bin/python benchmarks/ab_native_trees.py --base /tmp/base_tree --repository R --json out.json

`--base` is a checkout (git worktree) whose plugins/_native*.so were compiled from its own sources
(`python setup.py build_ext --inplace` there); R a built repository with a gguf engine (the same
engine file serves both sides: its format did not change).
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def import_tree(root: Path, prefix: str):
    """root's backend/ and plugins/ (with the compiled library) as <prefix>backend and
    <prefix>plugins -> (its runtime.native, its manifest module)."""
    tmp = Path(tempfile.mkdtemp(prefix="ab_tree_"))
    for pkg in ("backend", "plugins"):
        shutil.copytree(root / pkg, tmp / f"{prefix}{pkg}", ignore=shutil.ignore_patterns("__pycache__"))
    for py in tmp.rglob("*.py"):
        src = re.sub(r"\b(from|import) (backend|plugins)\b", rf"\1 {prefix}\2", py.read_text())
        py.write_text(re.sub(r"(?<![\w/.])(backend|plugins)\.(?=\w)", rf"{prefix}\1.", src))
    sys.path.insert(0, str(tmp))
    return (importlib.import_module(f"{prefix}backend.runtime.native"),
            importlib.import_module(f"{prefix}backend.manifest"), importlib.import_module(f"{prefix}backend.config"))


def runtime(native, manifest_mod, config_mod, repo: Path, context: int, prompt: np.ndarray, threads: int):
    """A `threads`-thread native runtime of the repository's gguf engine, `prompt` committed. The
    manifest is read by this tree (the other may read another manifest version; the engine file is
    the same), its model description handed to the tree's own type."""
    from backend.devices.native import NativeRecord
    from backend.manifest import EngineManifest

    m = EngineManifest.load(repo)
    e = m.engine("gguf")
    rt = native.NativeRuntime(m.resolve(e.path), manifest_mod.ModelConfig.from_json(m.model.to_json()), e.num_layers,
                              m.max_seq_len, config_mod.RuntimeOptions(threads=threads, max_sequences=1), (),
                              NativeRecord.of(e).wide_activations)
    rt.alloc(0)
    rt.forward([0], prompt, np.arange(-1, context - 1, dtype=np.int32)[None], np.full((1, 1), context - 1))
    rt.commit([0], [np.arange(context)])
    return rt


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--repository", type=Path, required=True, help="a built repository (its specdec/engine)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=1, help="engine threads; above 1 the clock is wall time")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from backend.bench.engine_bench import verify_ms      # the same timed forward as bench-engine's
    repo = args.repository / "specdec" / "engine" if (args.repository / "specdec").exists() else args.repository
    sides = {"new": (importlib.import_module("backend.runtime.native"), importlib.import_module("backend.manifest"),
                     importlib.import_module("backend.config"))}
    sides["base"] = import_tree(args.base.resolve(), "ab_base_")
    rng = np.random.default_rng(0)
    vocab = sides["new"][1].EngineManifest.load(repo).model.vocab_size
    prompt = rng.integers(3, vocab, (1, args.context))
    settings = ("base", "new", "base_AA")
    rts = {s: runtime(*sides[s.split("_")[0]], repo, args.context, prompt, args.threads) for s in settings}
    # one thread's CPU time misses the other threads' work: wall time where there are several
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    tokens = [int(t) for t in args.tokens.split(",")]
    got, mismatched = {s: {t: [] for t in tokens} for s in settings}, set()
    for r in range(args.reps + 1):
        order = settings[r % 3:] + settings[:r % 3]
        for t in tokens:
            toks, first = rng.integers(3, vocab, (1, t)), {}
            for s in order:
                ms, first[s] = verify_ms(rts[s], toks, clock)
                if r:
                    got[s][t].append(ms)
            mismatched |= {s for s, v in first.items() if not np.array_equal(v.view(np.uint32), first["base"].view(np.uint32))}
    med = {s: {t: round(statistics.median(v[t]), 3) for t in tokens} for s, v in got.items()}
    result = {"reps": args.reps, "context": args.context, "tokens": tokens, "threads": args.threads,
              "clock": "thread CPU time" if args.threads == 1 else "wall time",
              "base": {"tree": str(args.base), "commit": git(args.base, "rev-parse", "HEAD")},
              "new": {"tree": str(ROOT), "commit": git(ROOT, "rev-parse", "HEAD"),
                      "dirty": bool(git(ROOT, "status", "--short", "--untracked-files=no"))},
              "library": {side: {"path": mods[0].library()._name, "abi": mods[0].expected_abi()["abi version"]}
                          for side, mods in sides.items()},
              "isa": sides["new"][0].isa(), "median_ms": med,
              "ratio_to_base": {s: {t: round(med[s][t] / med["base"][t], 3) for t in tokens} for s in settings},
              "logits_bitwise_equal_to_base": not mismatched, "mismatched": sorted(mismatched)}
    for s in settings:
        print(f"{s:8s} " + " ".join(f"T={t}:{med[s][t]:.3f}ms(x{result['ratio_to_base'][s][t]:.3f})" for t in tokens))
    print("logits bitwise equal to base:", "yes" if not mismatched else f"NO: {sorted(mismatched)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
