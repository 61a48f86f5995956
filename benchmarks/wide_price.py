"""The build's wide-activation price (backend/devices/native/wide.price: a step, an 8-row verify
and a 64-token prefill chunk, int8 against wide, at the engine's serving thread count) read on a
built repository's gguf engine as the build reads it, alternated with its A/A control (the price
of no family: int8 against int8), `--reps` times each. It prints every reading and writes them
with provenance; what it shows is how far the price's readings move from one to the next (the
A/A) against what the families cost, and which clock each shape used on this machine's load.

    .venv/bin/python benchmarks/wide_price.py --model-repository R --families o --reps 3 --json out.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", required=True, help="a built repository with a gguf engine")
    ap.add_argument("--families", default="o", help="the families to price (--wide-activations' forms)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the readings here")
    args = ap.parse_args()
    from backend.bench.provenance import engine_threads, write_result
    from backend.devices import load_runtime
    from backend.devices.native import wide
    from backend.manifest import EngineManifest

    families = wide.parse(args.families)
    if not isinstance(families, tuple) or not families:
        raise SystemExit(f"--families {args.families!r}: name the families to price")
    manifest = EngineManifest.load(Path(args.model_repository) / "specdec" / "engine")
    rt = load_runtime(manifest, "gguf")
    # the build prices on the calibration prompts' first; any tokens time the same forwards
    prompt = list(np.random.default_rng(0).integers(3, rt.config.vocab_size, wide.PROBE_TOKENS))
    readings = []
    try:
        for rep in range(args.reps):
            for w in ((), families) if rep % 2 == 0 else (families, ()):
                t0 = time.process_time()
                out = wide.price(rt, w, prompt, print)
                readings.append({"rep": rep, "aa": not w, "process_cpu_s": round(time.process_time() - t0, 1), **out})
    finally:
        rt.close()
    if args.json:
        write_result(args.json, {"command": "benchmarks/wide_price.py", "model_repository": args.model_repository,
                                 "families": list(families), "reps": args.reps, "readings": readings},
                     threads=engine_threads())


if __name__ == "__main__":
    main()
