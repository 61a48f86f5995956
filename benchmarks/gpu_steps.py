"""The measurements of the GPU check (benchmarks/gpu_check.py runs them, each one a step of the
summary), on random weights of real shapes: timing needs no real weights. Every function takes
the device, so the dry run (`gpu_check.sh --dry-run`) runs the same code on the CPU with the
small shapes of `Plan.dry()`: the logits step with the kernels in Triton's interpreter (the
others with the kernels' numpy references: the interpreter's speed is the kernels step's
business), and CUDA graphs through `cpu_graph_stubs` (capture runs the forward eagerly, replay
does nothing), so everything up to the device calls executes.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from backend.config import RuntimeOptions
from backend.manifest import ModelConfig
from backend.runtime import fp8
from backend.runtime.torch_rt import TorchRuntime

LINEARS = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up", "down": "down"}
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
SHAPES = {   # the real run's shapes: the embedded model's and Llama-3-8B's
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192, True),
    "llama3-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 8192, False),
}
TINY = {     # the dry run's stand-ins (block128 needs K >= 128)
    "smollm2-135m": ModelConfig("llama", 512, 128, 256, 2, 4, 2, 32, 1e-5, 10000.0, 1024, True),
    "llama3-8b": ModelConfig("llama", 640, 256, 512, 2, 4, 2, 64, 1e-5, 10000.0, 1024, False),
}


@dataclass(frozen=True)
class Plan:
    device: str
    shapes: dict
    context: int            # committed tokens before timing
    widths: tuple           # tree nodes per row
    batches: tuple
    reps: int
    prompt: int             # the logits check's prompt
    chain: int              # the invariance check's verified chain

    @classmethod
    def real(cls) -> "Plan":
        return cls("cuda", SHAPES, 512, (1, 2, 4, 8, 16, 32, 64), (1, 8, 32), 10, 200, 16)

    @classmethod
    def dry(cls) -> "Plan":
        return cls("cpu", TINY, 24, (1, 2, 16), (1, 2), 2, 12, 4)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def cpu_graph_stubs():
    """CUDA graphs on the CPU for the dry run: capture runs the forward once eagerly, replay
    keeps its outputs, synchronize does nothing."""
    class Graph:
        def replay(self):
            pass

    saved = torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.synchronize
    torch.cuda.CUDAGraph, torch.cuda.graph = Graph, lambda g: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a: None
    try:
        yield
    finally:
        torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.synchronize = saved


def random_tensors(cfg: ModelConfig, fmt: str, device: str, recipe: fp8.Recipe | None = None, seed: int = 0) -> dict:
    """Random weights of a Llama shape in the engine layout (build/torch_engine.py); FP8 by
    `recipe` (fused linears quantized once, as the build writes them)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim
    rows = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d, "o": h,
            "gate": cfg.intermediate_size, "up": cfg.intermediate_size, "down": h}
    cols = {"q": h, "k": h, "v": h, "o": cfg.num_heads * d, "gate": h, "up": h, "down": cfg.intermediate_size}
    dt = torch.float32 if fmt == "fp32" else torch.bfloat16
    rnd = lambda *s, std=0.02: (torch.randn(*s, generator=g, device=device, dtype=torch.float32) * std)
    t = {"embed": rnd(cfg.vocab_size, h, std=1.0).to(dt), "norm": torch.ones(h, device=device, dtype=dt)}
    if not cfg.tie_word_embeddings:
        t["lm_head"] = rnd(cfg.vocab_size, h).to(dt)
    for i in range(cfg.num_layers):
        t[f"layers.{i}.attn_norm"] = torch.ones(h, device=device, dtype=dt)
        t[f"layers.{i}.mlp_norm"] = torch.ones(h, device=device, dtype=dt)
        for key, names in FUSED.items():
            ws = [rnd(rows[n], cols[n]) for n in names]
            if fmt != "fp8":
                t.update({f"layers.{i}.{n}": w.to(dt) for n, w in zip(names, ws)})
                continue
            q, t[f"layers.{i}.{key}.w_scale"] = fp8.quantize_weight(torch.cat(ws), recipe)
            t.update({f"layers.{i}.{n}": part for n, part in zip(names, q.split([rows[n] for n in names]))})
            if recipe.static:
                t[f"layers.{i}.{key}.act_scale"] = torch.tensor(4.0 / fp8.FP8_MAX)
    return t


def runtime(cfg, tensors, device, max_seq_len=1024, slots=33, dtype=None, graphs=True, recipe=None,
            kernels: bool | None = None) -> TorchRuntime:
    """kernels: attention by the Triton kernels (on a CPU: the interpreter); default: on a GPU."""
    rt = TorchRuntime(None, cfg, cfg.num_layers, max_seq_len, RuntimeOptions(max_sequences=slots, cuda_graphs=graphs),
                      device, tensors=tensors, dtype=dtype, fp8_recipe=recipe)
    rt.kernels = device == "cuda" if kernels is None else kernels
    return rt


def chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)[None]


def prefill(rt, sids, context, rng):
    for s in sids:
        rt.alloc(s)
        rt.forward([s], rng.integers(3, rt.config.vocab_size, (1, context)), chain(context), np.array([[context - 1]]))
        rt.commit([s], [np.arange(context)])


def logits(plan: Plan) -> dict:
    """The runtime on `plan.device` (fp32, bf16) vs the CPU runtime with the kernels' references
    (fp32), same random weights; and a bf16 verify of a chain (16 nodes) vs single steps."""
    cfg = plan.shapes["smollm2-135m"]
    cpu_t = random_tensors(cfg, "fp32", "cpu")
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, plan.prompt)
    tree = np.array([[-1, 0, 0, 1, 1, 2, 3, 4]], np.int32)
    toks = rng.integers(3, cfg.vocab_size, (1, tree.shape[1]))

    def run(rt):
        prefill(rt, [0], prompt.size, np.random.default_rng(1))
        return rt.forward([0], toks, tree, np.arange(tree.shape[1])[None]).logits[0].copy()

    ref = run(runtime(cfg, cpu_t, "cpu", slots=2, graphs=False, kernels=False))
    dev_t = {k: v.to(plan.device) for k, v in cpu_t.items()}
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        got = run(runtime(cfg, dev_t, plan.device, slots=2, dtype=dtype, graphs=False, kernels=True))
        out[name] = {"max_rel_logit_diff": float(np.abs(got - ref).max() / np.abs(ref).max()),
                     "top1_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1)))}
    rt = runtime(cfg, dev_t, plan.device, slots=4, dtype=torch.bfloat16, graphs=False, kernels=True)
    prefill(rt, [1, 2], prompt.size, np.random.default_rng(1))
    chain_toks = rng.integers(3, cfg.vocab_size, plan.chain)
    single = []
    for tok in chain_toks:
        single.append(rt.forward([1], np.array([[tok]]), chain(1), np.zeros((1, 1), np.int64)).logits[0, 0].copy())
        rt.commit([1], [np.array([0])])
    verify = rt.forward([2], chain_toks[None], chain(plan.chain), np.arange(plan.chain)[None]).logits[0]
    out["bf16_verify_vs_single_steps"] = {"nodes": plan.chain,
        "max_abs_logit_diff": float(np.abs(verify - np.stack(single)).max()),
        "greedy_identical": bool(np.array_equal(verify.argmax(-1), np.stack(single).argmax(-1)))}
    return out


def graphs(plan: Plan) -> dict:
    """The same steps (a batch of 3 trees, then single tokens) with CUDA graphs and eagerly: the
    largest logit difference (0: replay is the eager computation)."""
    cfg = plan.shapes["smollm2-135m"]
    t = random_tensors(cfg, "bf16", plan.device)
    parents = np.array([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, -2, -2]], np.int32)
    outs = []
    for use in (False, True):
        rt = runtime(cfg, t, plan.device, slots=4, graphs=use)
        rt.use_graphs = use                 # on the dry run's CPU too (cpu_graph_stubs)
        prefill(rt, [0, 1, 2], plan.context, np.random.default_rng(5))
        rng = np.random.default_rng(6)
        got = [rt.forward([0, 1, 2], rng.integers(3, cfg.vocab_size, (3, 4)), parents,
                          np.broadcast_to(np.arange(4), (3, 4)).copy()).logits.copy()]
        rt.commit([0, 1, 2], [np.array([0, 1]), np.array([0]), np.array([0])])
        for _ in range(3):
            got.append(rt.forward([0, 1, 2], rng.integers(3, cfg.vocab_size, (3, 1)), np.full((3, 1), -1, np.int32),
                                  np.zeros((3, 1), np.int64)).logits.copy())
            rt.commit([0, 1, 2], [np.array([0])] * 3)
        outs.append(got)
        graphs_made = len(rt._graphs)
        rt.close()
    diff = max(float(np.abs(a - b).max()) for a, b in zip(*outs))
    return {"max_abs_logit_diff": diff, "graphs_captured": graphs_made}


def time_forward(rt, device: str, b: int, t: int, reps: int, first_id: int) -> float:
    sids = list(range(first_id, first_id + b))
    rng = np.random.default_rng(t)
    parents = np.broadcast_to(chain(t), (b, t)).copy()
    index = np.broadcast_to(np.arange(t), (b, t)).copy()
    times = []
    for i in range(reps + 2):
        ids = rng.integers(3, rt.config.vocab_size, (b, t))
        sync(device)
        t0 = time.perf_counter()
        rt.forward(sids, ids, parents, index)
        rt.commit(sids, [np.zeros(0, np.int64)] * b)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cost_curve(plan: Plan, name: str, fmt: str = "bf16", batches=None, recipe=None, log=print) -> dict:
    """cost(T) / cost(1) at each batch, CUDA graphs on, context plan.context."""
    cfg = plan.shapes[name]
    rt = runtime(cfg, random_tensors(cfg, fmt, plan.device, recipe), plan.device, recipe=recipe)
    out, first = {}, 0
    for b in batches or plan.batches:
        prefill(rt, list(range(first, first + b)), plan.context, np.random.default_rng(b))
        secs = {t: time_forward(rt, plan.device, b, t, plan.reps, first) for t in plan.widths}
        out[f"b{b}"] = {"seconds": {str(t): round(s, 6) for t, s in secs.items()},
                        "ratio": {str(t): round(s / secs[1], 3) for t, s in secs.items()}}
        log(f"{name} {fmt} B={b}: " + " ".join(f"T{t}={out[f'b{b}']['ratio'][str(t)]}" for t in plan.widths))
        for s in range(first, first + b):
            rt.free(s)
        first += b
    rt.close()
    return out


def decode_speed(plan: Plan, fmt: str, recipe: fp8.Recipe | None = None, log=print) -> dict:
    """Plain decode tokens/s (batch 1 and 8) on the 8B shape; FP8 by `recipe`, with whether
    torch._scaled_mm runs it here (else emulated)."""
    cfg = plan.shapes["llama3-8b"]
    rt = runtime(cfg, random_tensors(cfg, fmt, plan.device, recipe), plan.device, slots=9, recipe=recipe)
    out = {"hardware_fp8": rt.model.hw_fp8}
    for b in (1, 8):
        prefill(rt, list(range(b)), plan.context, np.random.default_rng(b))
        s = time_forward(rt, plan.device, b, 1, plan.reps * 3, 0)
        out[f"b{b}_tokens_per_s"] = round(b / s, 1)
        for i in range(b):
            rt.free(i)
    rt.close()
    del rt
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    log(f"8B-shape decode {recipe.label if recipe else fmt}: {out}")
    return out


def fp8_hardware(plan: Plan) -> dict:
    """Which recipes torch._scaled_mm runs on this device and gives the emulation's numbers
    (on the dry run's CPU: its own _scaled_mm, where it has the form)."""
    from backend.runtime.torch_model import probe_scaled_mm

    return {r.name: probe_scaled_mm(torch.device(plan.device), r) for r in fp8.RECIPES}
