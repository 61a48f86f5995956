"""GPU numbers for the torch runtime, on random weights (timing needs no real weights; a real
GGUF is used for the speculative bench only when one is given). Needs only torch, triton and
numpy; no network. Called by benchmarks/gpu_check.sh, which also runs check-kernels.

    python benchmarks/gpu_check.py --out DIR [--quick]

Writes DIR/gpu_check.json:
  logits        the CUDA runtime (fp32 and bf16) vs the CPU runtime (fp32, the references) on the
                same random 135M-shaped weights: largest |logit difference|, top-1 agreement;
                and one verify of T tree nodes vs single steps on the GPU (batch invariance)
  cost_curve    cost(T)/cost(1) for T in 1..64 at batch 1, 8, 32, context 512, CUDA graphs on,
                for the 135M shape and the Llama-3-8B shape
  decode        bf16 vs FP8 plain decode tokens/s (batch 1 and 8) for the 8B shape
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.config import RuntimeOptions  # noqa: E402
from backend.manifest import ModelConfig  # noqa: E402
from backend.runtime.torch_model import FP8_MAX, fp8_quantize  # noqa: E402
from backend.runtime.torch_rt import TorchRuntime  # noqa: E402

SHAPES = {
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192, True),
    "llama3-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 8192, False),
}
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


def random_tensors(cfg: ModelConfig, fmt: str, device: str, seed: int = 0) -> dict:
    """Random weights of a Llama shape in the engine layout (build/torch_engine.py)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"q": (cfg.num_heads * d, h), "k": (cfg.num_kv_heads * d, h), "v": (cfg.num_kv_heads * d, h),
              "o": (h, cfg.num_heads * d), "gate": (cfg.intermediate_size, h), "up": (cfg.intermediate_size, h),
              "down": (h, cfg.intermediate_size)}
    dt = torch.float32 if fmt == "fp32" else torch.bfloat16
    rnd = lambda *s, std=0.02: (torch.randn(*s, generator=g, device=device, dtype=torch.float32) * std)
    t = {"embed": rnd(cfg.vocab_size, h, std=1.0).to(dt), "norm": torch.ones(h, device=device, dtype=dt)}
    if not cfg.tie_word_embeddings:
        t["lm_head"] = rnd(cfg.vocab_size, h).to(dt)
    for i in range(cfg.num_layers):
        t[f"layers.{i}.attn_norm"] = torch.ones(h, device=device, dtype=dt)
        t[f"layers.{i}.mlp_norm"] = torch.ones(h, device=device, dtype=dt)
        for n in LINEARS:
            w = rnd(*shapes[n])
            if fmt == "fp8":
                t[f"layers.{i}.{n}"], t[f"layers.{i}.{n}.scale"] = fp8_quantize(w)
            else:
                t[f"layers.{i}.{n}"] = w.to(dt)
        if fmt == "fp8":
            for key in ("qkv", "o", "gate_up", "down"):
                t[f"layers.{i}.{key}.act_scale"] = torch.tensor(4.0 / FP8_MAX)
    return t


def runtime(cfg, tensors, device, max_seq_len=1024, slots=33, dtype=None, graphs=True) -> TorchRuntime:
    return TorchRuntime(None, cfg, cfg.num_layers, max_seq_len, RuntimeOptions(max_sequences=slots, cuda_graphs=graphs),
                        device, tensors=tensors, dtype=dtype)


def chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)[None]


def prefill(rt, sids, context, rng):
    for s in sids:
        rt.alloc(s)
        rt.forward([s], rng.integers(3, rt.config.vocab_size, (1, context)), chain(context),
                   np.array([[context - 1]]))
        rt.commit([s], [np.arange(context)])


def logits_check(quick: bool) -> dict:
    """CUDA vs CPU runtime on the same fp32 weights; GPU verify-vs-single-steps invariance."""
    cfg = SHAPES["smollm2-135m"]
    cpu_t = random_tensors(cfg, "fp32", "cpu")
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, 200)
    tree = np.array([[-1, 0, 0, 1, 1, 2, 3, 4]], np.int32)
    toks = rng.integers(3, cfg.vocab_size, (1, tree.shape[1]))
    out = {}

    def run(rt):
        prefill(rt, [0], prompt.size, np.random.default_rng(1))
        o = rt.forward([0], toks, tree, np.arange(tree.shape[1])[None])
        return o.logits[0].copy()

    ref = run(runtime(cfg, cpu_t, "cpu", slots=2))
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        got = run(runtime(cfg, {k: v.cuda() for k, v in cpu_t.items()}, "cuda", slots=2, dtype=dtype))
        out[f"cuda_{name}_vs_cpu_fp32"] = {
            "max_abs_logit_diff": float(np.abs(got - ref).max()),
            "top1_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1)))}
    rt = runtime(cfg, {k: v.cuda() for k, v in cpu_t.items()}, "cuda", slots=4, dtype=torch.bfloat16)
    prefill(rt, [1, 2], prompt.size, np.random.default_rng(1))
    chain_toks = rng.integers(3, cfg.vocab_size, 16)
    single = []
    for tok in chain_toks:
        single.append(rt.forward([1], np.array([[tok]]), chain(1), np.zeros((1, 1), np.int64)).logits[0, 0].copy())
        rt.commit([1], [np.array([0])])
    verify = rt.forward([2], chain_toks[None], chain(16), np.arange(16)[None]).logits[0]
    out["gpu_bf16_verify16_vs_single_steps"] = {
        "max_abs_logit_diff": float(np.abs(verify - np.stack(single)).max()),
        "greedy_token_identical": bool(np.array_equal(verify.argmax(-1), np.stack(single).argmax(-1)))}
    return out


def time_forward(rt, b: int, t: int, reps: int, first_id: int) -> float:
    sids = list(range(first_id, first_id + b))
    rng = np.random.default_rng(t)
    parents = np.broadcast_to(chain(t), (b, t)).copy()
    index = np.broadcast_to(np.arange(t), (b, t)).copy()
    times = []
    for i in range(reps + 2):
        ids = rng.integers(3, rt.config.vocab_size, (b, t))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.forward(sids, ids, parents, index)
        rt.commit(sids, [np.zeros(0, np.int64)] * b)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cost_curve(name: str, fmt: str, quick: bool) -> dict:
    cfg = SHAPES[name]
    rt = runtime(cfg, random_tensors(cfg, fmt, "cuda"), "cuda")
    widths = [1, 2, 4, 8, 16, 32, 64] if quick else [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    out = {}
    first = 0
    for b in (1, 8, 32):
        prefill(rt, list(range(first, first + b)), 512, np.random.default_rng(b))
        secs = {t: time_forward(rt, b, t, 5 if quick else 10, first) for t in widths}
        out[f"b{b}"] = {"seconds": {str(t): round(s, 6) for t, s in secs.items()},
                        "ratio": {str(t): round(s / secs[1], 3) for t, s in secs.items()}}
        print(f"{name} {fmt} B={b}: " + " ".join(f"T{t}={out[f'b{b}']['ratio'][str(t)]}" for t in widths), flush=True)
        for s in range(first, first + b):
            rt.free(s)
        first += b
    rt.close()
    del rt
    torch.cuda.empty_cache()
    return out


def decode_speed(fmt: str, quick: bool) -> dict:
    cfg = SHAPES["llama3-8b"]
    rt = runtime(cfg, random_tensors(cfg, fmt, "cuda"), "cuda", slots=9)
    out = {"hardware_fp8": rt.model.hw_fp8}
    for b in (1, 8):
        prefill(rt, list(range(b)), 512, np.random.default_rng(b))
        s = time_forward(rt, b, 1, 20 if quick else 50, 0)
        out[f"b{b}_tokens_per_s"] = round(b / s, 1)
        for i in range(b):
            rt.free(i)
    rt.close()
    del rt
    torch.cuda.empty_cache()
    print(f"llama3-8b {fmt} decode: {out}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "gpu_check needs a CUDA device"
    result = {"gpu": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    steps = [("logits", lambda: logits_check(args.quick)),
             ("cost_curve", lambda: {f"{n}_{f}": cost_curve(n, f, args.quick)
                                     for n, f in (("smollm2-135m", "bf16"), ("llama3-8b", "bf16"), ("llama3-8b", "fp8"))}),
             ("decode", lambda: {f: decode_speed(f, args.quick) for f in ("bf16", "fp8")})]
    path = Path(args.out) / "gpu_check.json"
    for key, fn in steps:
        t0 = time.time()
        try:
            result[key] = fn()
        except Exception as exc:                        # keep what the other steps measured
            result[key] = {"error": f"{type(exc).__name__}: {exc}"}
        result[f"{key}_seconds"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"[{key}] done in {result[f'{key}_seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
