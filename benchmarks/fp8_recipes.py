#!/usr/bin/env python3
"""bf16 and every FP8 recipe side by side against fp32 (issue 30): `specdec quality`'s measure
(backend/bench/quality.py: fp32's greedy continuation of each prompt, then teacher-forced top-1
agreement and KL(fp32 || format) at every continuation position) for each format, with the engines
made in memory from one checkpoint (the build's own functions: buildlib/fp8.engine_tensors, buildlib/calibration.calibrate)
instead of one repository per recipe. FP8 is emulated on a CPU, as `specdec quality` does.

    python benchmarks/fp8_recipes.py [--target PATH|PACKAGE] [--diagnose] --json OUT.json

Every recipe is measured twice: weights rounded to nearest, and by GPTQ on the calibration
prompts' Hessians (`<name>+gptq`, buildlib/fp8_gptq.py).
--diagnose adds where the error comes from: each weight granularity with every input unquantized
(weights alone; to nearest and by GPTQ), per-token inputs with fp32 weights (inputs alone), and channel-token with its
worst linears weight-only by the build's per-linear check (devices/cuda/fp8_choice.py).
Single-threaded torch: on a shared machine, spinning threads cost more than they give.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench import quality  # noqa: E402
from backend.bench.prompt_sets import default_prompts, load_prompts, prompt_ids  # noqa: E402
from backend.buildlib import calibration, fp8 as fp8_math  # noqa: E402
from backend.devices.cuda import fp8_choice  # noqa: E402
from backend.buildlib.checkpoint import load_checkpoint  # noqa: E402
from backend.builder.embedded import resolve_target  # noqa: E402
from backend.manifest import WeightFormat  # noqa: E402
from backend.runtime import fp8  # noqa: E402

GRANULARITIES = {"per channel": (1, 0), "128x128": (128, 128), "1x32": (1, 32)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--prompts", default=default_prompts())
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--recipes", default=None,
                    help="comma list of recipes to measure (default: each of runtime/fp8.RECIPES, and +gptq)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.time()
    ck = load_checkpoint(resolve_target(args.target))
    cfg, n = ck.config, ck.config.num_layers
    tok = _tokenizer(ck, Path(args.json).with_suffix(".tokenizer.json"))
    rt = lambda t, rec=None: fp8_choice._runtime(ck, t, 1024, rec, rows=2)
    ref_rt = rt(fp8_math.engine_tensors(ck, WeightFormat.FP32, n, None))
    probe = []
    for p in load_prompts(args.prompts):
        ids = prompt_ids(tok, p["messages"])
        full = ids + quality._greedy(ref_rt, ids, args.max_new_tokens)
        probe.append((np.asarray(full, np.int64), args.max_new_tokens,
                      quality._teacher_forced(ref_rt, full, args.max_new_tokens)))
    ref_rt.close()
    act = calibration.calibrate(ck, calibration.calibration_prompts(tok, calibration.FP8_CALIBRATION_PROMPTS), 1024,
                                 hessians=True)
    results = {"bf16": _score(rt(fp8_math.engine_tensors(ck, WeightFormat.BF16, n, None)), probe)}
    print("bf16", results["bf16"], flush=True)
    recipes = [fp8.recipe(r.strip()) for r in args.recipes.split(",")] if args.recipes else \
        [v for r in fp8.RECIPES for v in (r, r.with_gptq())]            # nearest, then GPTQ rounding
    for rec in recipes:
        results[rec.label] = _score(rt(fp8_math.engine_tensors(ck, WeightFormat.FP8, n, act, rec), rec), probe)
        print(rec.label, results[rec.label], flush=True)
    out = {"target": args.target or "embedded default", "source": ck.source, "prompts": args.prompts,
           "positions": sum(m for _, m, _ in probe), "bar": fp8_choice.BAR, "results": results,
           "command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d"),
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    if args.diagnose:
        out["diagnosis"] = _diagnose(ck, rt, probe, act)
    out["seconds"] = round(time.time() - t_start)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _tokenizer(ck, path: Path):
    from backend.tokenizer import Tokenizer, tokenizer_json_from_gguf

    path.write_text(ck.tokenizer.tokenizer_json or tokenizer_json_from_gguf(ck.tokenizer.gguf_vocab))
    return Tokenizer(path, ck.tokenizer.chat_template, ck.config.eos_token_ids, ck.config.bos_token_id,
                     ck.tokenizer.add_bos_token)


def _score(rt, probe) -> dict:
    agree, kl = [], []
    for ids, m, a in probe:
        b = quality._teacher_forced(rt, list(ids), m)
        agree.append(np.argmax(a, -1) == np.argmax(b, -1))
        kl.append(np.sum(np.exp(a) * (a - b), -1))
    rt.close()
    q = {"top1_agreement": round(float(np.concatenate(agree).mean()), 4),
         "kl_mean": round(float(np.concatenate(kl).mean()), 5)}
    return {**q, "meets_bar": fp8_choice.meets(q)}


def _diagnose(ck, rt, probe, act) -> dict:
    n = ck.config.num_layers
    linears = [f"layers.{i}.{k}" for i in range(n) for k in fp8_math.FUSED]
    d = {}
    for name, block in GRANULARITIES.items():           # weights alone, to nearest and by GPTQ
        for gptq in (False, True):
            rec = fp8.Recipe("weights", block, "token", gptq=gptq).with_weight_only(linears)
            key = f"weights alone, {name}" + (", GPTQ" if gptq else "")
            d[key] = _score(rt(fp8_math.engine_tensors(ck, WeightFormat.FP8, n, act, rec), rec), probe)
            print(key, d[key], flush=True)
    inputs = rt(fp8_math.engine_tensors(ck, WeightFormat.FP32, n, None))     # inputs alone, per token
    for name, lin in inputs.model.linears().items():
        lin.qin, lin.recipe, lin.act_scale = True, fp8.recipe("channel-token"), act.get(f"{name}.act_scale")
    d["inputs alone, per token"] = _score(inputs, probe)
    rec = fp8.recipe("channel-token")
    fp = fp8_choice.Probe([(ids, m) for ids, m, _ in probe], [a for *_, a in probe])
    errors = fp8_choice.linear_errors(ck, fp, rec, act, 1024)
    worst = sorted(errors, key=errors.get, reverse=True)
    d["per-linear input error, worst 8"] = {k: round(errors[k], 4) for k in worst[:8]}
    d["per-linear input error, range"] = [round(min(errors.values()), 4), round(max(errors.values()), 4)]
    for k in (len(linears) // 8, len(linears) // 4):
        r = rec.with_weight_only(worst[:k])
        tensors = fp8_math.engine_tensors(ck, WeightFormat.FP8, n, act, r)
        d[f"channel-token, worst {k} weight-only"] = _score(rt(tensors, r), probe)
    return d


if __name__ == "__main__":
    sys.exit(main())
