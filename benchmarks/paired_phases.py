"""Where a mode's time goes under load: the paired bench's time-sliced loop (backend/bench/
paired_bench.py) with every decoder phase timed per mode, so an overhead of 1% in one mode shows
as the phase that carries it (perf-notes §13d found the adaptive controller's per-step choice so).

    .venv/bin/python benchmarks/paired_phases.py --concurrency 4 --rounds 3 --drafter eagle

Prints each round's throughput ratios against plain, their mean, then milliseconds per scheduler
iteration of each phase per mode. The wrappers cost the same in every mode.
"""
from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench import paired_bench as pb                       # noqa: E402
from backend.bench.concurrency_bench import level_requests         # noqa: E402
from backend.bench.prompt_sets import load_prompts              # noqa: E402
from backend.config import SamplingParams                          # noqa: E402
from backend.engine import make_decoder                            # noqa: E402
from backend.runtime.ort import shared_sessions                    # noqa: E402

DECODER = ("_budgets", "_propose", "prefill", "step", "start", "finish")
TARGET = ("forward", "verify", "commit")
CONTROLLER = ("observe_step", "observe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", default="model_repository")
    ap.add_argument("--prompts", default="benchmarks/prompts/public.jsonl")
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="plain,fixed,auto,control",
                    help="of plain, fixed (K=5), auto, control (plain again)")
    args = ap.parse_args()
    names = args.modes.split(",")
    cfg = pb._serve_config(Path(args.model_repository))
    with shared_sessions():
        dec = {m: make_decoder(cfg) for m in names}
    acc = {m: collections.Counter() for m in names}
    current = [names[0]]

    def wrap(obj, attr, label):
        f = getattr(obj, attr)

        @functools.wraps(f)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[current[0]][label] += time.perf_counter() - t0
        setattr(obj, attr, timed)

    for d in dec.values():
        for a in DECODER:
            wrap(d, a, a.lstrip("_"))
        for a in TARGET:
            wrap(d.target, a, f"target.{a}")
        for a in CONTROLLER:
            wrap(d.controller, a, f"controller.{a}")
        for dr in d.drafters.values():
            wrap(dr, "observe", "drafter.observe")

    tok = dec[names[0]].tok
    kind = {"plain": "none", "control": "none", "auto": args.drafter, "fixed": args.drafter}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    ids: dict = {}

    def modes(reqs, n):
        out = [pb._Mode(m, dec[m], cfg.max_batch,
                        pb.request_maker(tok, params, kind[m], 5 if m == "fixed" else None, ids), reqs, n)
               for m in names]
        for mode in out:
            def iterate(block=False, _it=mode.sched.iterate, _m=mode.name):
                current[0] = _m
                t0 = time.perf_counter()
                _it(block)
                acc[_m]["iterate"] += time.perf_counter() - t0
                acc[_m]["iterations"] += 1
            mode.sched.iterate = iterate
        return out

    prompts = load_prompts(args.prompts)
    pb.run_level(modes(list({p.get("kind"): p for p in prompts}.values()), 1), seed=0)   # warm-up
    for a in acc.values():
        a.clear()
    tps = collections.defaultdict(list)
    for r in range(args.rounds):
        ms = modes([p for lv in level_requests(prompts, args.concurrency, 2) for p in lv], args.concurrency)
        pb.run_level(ms, seed=r + 1)
        row = {m.name: m.row()["tokens_per_s"] for m in ms}
        for k, v in row.items():
            tps[k].append(v)
        print(f"round {r}: " + "  ".join(f"{k} x{v / row[names[0]]:.3f}" for k, v in row.items()), flush=True)
    base = np.sum(tps[names[0]])
    print("mean:    " + "  ".join(f"{k} x{np.sum(v) / base:.3f}" for k, v in tps.items()))
    print(f"\nms per iteration {''.join(f'{m:>12s}' for m in names)}")
    for key in sorted(set().union(*acc.values()) - {"iterations"}):
        print(f"{key:24s}" + "".join(f"{1000 * acc[m][key] / max(1, acc[m]['iterations']):12.4f}" for m in names))


if __name__ == "__main__":
    main()
