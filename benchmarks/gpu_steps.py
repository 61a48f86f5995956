"""The correctness steps of the GPU check (benchmarks/gpu_check.py runs them, each one a step
of the summary; the timing steps are benchmarks/gpu_timing.py), on random weights of real
shapes. Every function takes the device and builds the GPU's runtime (`runtime`: attention,
verification, linears, norms and the fused step by the Triton kernels, decode-sized steps by
captured graphs), so the dry run (`gpu_check.sh --dry-run`) runs the GPU's code on the CPU with
the small shapes of `Plan.dry()`: the kernels in Triton's interpreter, CUDA graphs by the
runtime's CPU stand-in (step_graph.EagerGraph: a capture runs the step on the static buffers, a
replay runs it again into the captured outputs); benchmarks/gpu_count.py counts which kernels
ran, and the check holds every step to the GPU branches it must reach (gpu_check.REQUIRED).
Two runs compared by a step see the same prompts and the same tokens: a difference is the
kernels', never the inputs'.
"""
from __future__ import annotations

import json
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
TINY = {     # the dry run's stand-ins, as small as covers the code: the interpreter's time goes with
             # the programs a step launches (its columns and tokens). block128 needs K >= 128; the
             # 8B one's down linear splits K (intermediate 1024, kernels.linear_plan) as the real
             # shapes' do, in one layer
    "smollm2-135m": ModelConfig("llama", 256, 64, 128, 2, 2, 1, 32, 1e-5, 10000.0, 1024, True),
    "llama3-8b": ModelConfig("llama", 256, 128, 1024, 1, 2, 1, 64, 1e-5, 10000.0, 1024, False),
}


@dataclass(frozen=True)
class Plan:
    device: str
    shapes: dict
    context: int            # committed tokens before timing
    widths: tuple           # tree nodes per row
    batches: tuple
    reps: int               # timed forwards per point
    decode_reps: int        # per decode point (fp8_decode)
    warmup: int             # untimed forwards before them
    prompt: int             # the logits check's prompt
    chain: int              # the invariance check's verified chain
    copy_mib: int           # the bandwidth step's copy

    @classmethod
    def real(cls) -> "Plan":
        return cls("cuda", SHAPES, 512, (1, 2, 4, 8, 16, 32, 64), (1, 8, 32), 10, 30, 2, 200, 16, 2048)

    @classmethod
    def dry(cls) -> "Plan":
        return cls("cpu", TINY, 4, (1, 2, 4), (1, 2), 1, 1, 0, 6, 4, 64)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def random_tensors(cfg: ModelConfig, fmt: str, device: str, recipe: fp8.Recipe | None = None, seed: int = 0) -> dict:
    """Random weights of a Llama shape in the engine layout (devices/cuda/export.py); FP8 by
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


def runtime(cfg, tensors, device, max_seq_len=1024, slots=33, dtype=torch.bfloat16, graphs=True, recipe=None,
            kernels: bool = True, invariant: bool = True) -> TorchRuntime:
    """The GPU's runtime on `device` (its defaults there): attention and verification by the
    Triton kernels (`kernels`), linears, LM head and norms by the fixed-tile and fused kernels
    (`invariant`), decode-sized steps by captured graphs (`graphs`), bf16. On a CPU the same
    code: the kernels in Triton's interpreter, graphs by step_graph.EagerGraph. False: the
    fallbacks (the CPU reference of the logits step: numpy attention and verification, torch's
    linears; invariant False on a GPU: cuBLAS)."""
    rt = TorchRuntime(None, cfg, cfg.num_layers, max_seq_len, RuntimeOptions(max_sequences=slots, cuda_graphs=graphs),
                      device, tensors=tensors, dtype=dtype, fp8_recipe=recipe)
    rt.kernels = rt.device_verify = kernels
    rt.model.invariant = invariant
    rt.use_graphs = graphs
    return rt


def chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)[None]


def prefill(rt, sids, prompts: np.ndarray) -> None:
    """Commit `prompts` into slots `sids`: one row per slot ([len(sids), n]), or one prompt
    [n] into every slot (the same tokens, so the slots' KV is the same bits)."""
    prompts = np.broadcast_to(prompts, (len(sids), np.shape(prompts)[-1]))
    n = prompts.shape[1]
    for s, ids in zip(sids, prompts):
        rt.alloc(s)
        rt.forward([s], ids[None].copy(), chain(n), np.array([[n - 1]]))
        rt.commit([s], [np.arange(n)])


def prompt_ids(cfg, n: int, seed: int, rows: int | None = None) -> np.ndarray:
    """Random token ids [n] (or [rows, n]) of the vocabulary, ids 0-2 left out (BOS/EOS/pad)."""
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, n if rows is None else (rows, n))


def logits(plan: Plan) -> dict:
    """The runtime on `plan.device` (fp32, bf16) vs the CPU runtime with the kernels' references
    (fp32), same random weights, same prompt and tree."""
    cfg = plan.shapes["smollm2-135m"]
    cpu_t = random_tensors(cfg, "fp32", "cpu")
    prompt = prompt_ids(cfg, plan.prompt, 1)
    tree = np.array([[-1, 0, 0, 1, 1, 2, 3, 4]], np.int32)
    toks = prompt_ids(cfg, tree.shape[1], 2)[None]

    def run(rt):
        prefill(rt, [0], prompt)
        return rt.forward([0], toks, tree, np.arange(tree.shape[1])[None]).logits[0].copy()

    ref = run(runtime(cfg, cpu_t, "cpu", slots=2, dtype=torch.float32, graphs=False, kernels=False, invariant=False))
    dev_t = {k: v.to(plan.device) for k, v in cpu_t.items()}
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        got = run(runtime(cfg, dev_t, plan.device, slots=2, dtype=dtype, graphs=False))
        out[name] = {"max_rel_logit_diff": float(np.abs(got - ref).max() / np.abs(ref).max()),
                     "top1_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1)))}
    return out


BATCH = 4      # the invariance step's batch of identical rows


def invariance(plan: Plan) -> dict:
    """bf16, the GPU's fused step, eager: every slot prefilled with the same prompt; slot 0 takes
    `plan.chain` single steps, then the same tokens are verified as a chain by slot 1 alone (the
    full width), by slots 2.. as a batch of BATCH identical rows, and by the last slot at half the
    width. Every logit of a verify is the bits of its single step (max |diff| 0 for each) where
    the step is invariant across batch and verify widths."""
    cfg = plan.shapes["smollm2-135m"]
    dev_t = {k: v.to(plan.device) for k, v in random_tensors(cfg, "fp32", "cpu").items()}
    rt = runtime(cfg, dev_t, plan.device, slots=BATCH + 3, graphs=False)
    batch, half = list(range(2, 2 + BATCH)), 2 + BATCH
    prefill(rt, [0, 1, *batch, half], prompt_ids(cfg, plan.prompt, 1))
    toks, n = prompt_ids(cfg, plan.chain, 3), plan.chain
    single = []
    for tok in toks:
        single.append(rt.forward([0], np.array([[tok]]), chain(1), np.zeros((1, 1), np.int64)).logits[0, 0].copy())
        rt.commit([0], [np.array([0])])
    single = np.stack(single)
    verify = lambda sids, w: rt.forward(sids, np.broadcast_to(toks[:w], (len(sids), w)).copy(),
                                        np.broadcast_to(chain(w), (len(sids), w)).copy(),
                                        np.broadcast_to(np.arange(w), (len(sids), w)).copy()).logits
    got = {f"verify_{n}": verify([1], n), f"batch_{BATCH}_verify_{n}": verify(batch, n),
           f"verify_{n // 2}": verify([half], n // 2)}
    rt.close()
    diffs = {k: float(max(np.abs(v[r] - single[: v.shape[1]]).max() for r in range(v.shape[0])))
             for k, v in got.items()}
    same = all(np.array_equal(v[r].argmax(-1), single[: v.shape[1]].argmax(-1)) for v in got.values()
               for r in range(v.shape[0]))
    return {"nodes": n, "max_abs_logit_diff": max(diffs.values()), "by_comparison": diffs, "greedy_identical": same}


def graphs(plan: Plan) -> dict:
    """bf16, invariant mode: the same steps (prefills, a batch of 3 trees, then single tokens,
    then speculative steps through forward_verify: forward, LM head and verification in one
    graph, greedy and seeded sampled rows) with CUDA graphs (padded to their buckets) and
    eagerly, from the same prompts and tokens: the largest logit and hidden difference (0: replay
    is the eager computation's bits) and whether the verdicts are the same."""
    from backend.config import SamplingParams
    from backend.decoder import pack_drafts
    from backend.drafters.base import Draft
    from backend.runtime.base import forward_verify
    from backend.sampling import PositionNoise
    from backend.tree import TokenTree

    cfg = plan.shapes["smollm2-135m"]
    t = random_tensors(cfg, "bf16", plan.device)
    parents = np.array([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, -2, -2]], np.int32)
    prompts = prompt_ids(cfg, plan.context, 5, rows=3)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=50, seed=11),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2 ** 63 + 3)]
    trees = [TokenTree.from_parents(np.array([-1, 0, 0, 1, 1, 2], np.int32)), TokenTree.chain(3), TokenTree.chain(0)]
    outs, verdicts, counts = [], [], {}
    for use in (False, True):
        rt = runtime(cfg, t, plan.device, slots=4, graphs=use)      # on the dry run's CPU: EagerGraph
        prefill(rt, [0, 1, 2], prompts)
        rng = np.random.default_rng(6)
        got = [rt.forward([0, 1, 2], rng.integers(3, cfg.vocab_size, (3, 4)), parents,
                          np.broadcast_to(np.arange(4), (3, 4)).copy()).logits.copy()]
        rt.commit([0, 1, 2], [np.array([0, 1]), np.array([0]), np.array([0])])
        for _ in range(3):
            got.append(rt.forward([0, 1, 2], rng.integers(3, cfg.vocab_size, (3, 1)), np.full((3, 1), -1, np.int32),
                                  np.zeros((3, 1), np.int64)).logits.copy())
            rt.commit([0, 1, 2], [np.array([0])] * 3)
        noises, ver = [PositionNoise(p.seed or 0, cfg.vocab_size) for p in params], []
        for step in range(2):
            drafts = [Draft(tr, rng.integers(3, cfg.vocab_size, tr.num_nodes)) for tr in trees]
            fwd, vs = forward_verify(rt, [0, 1, 2], *pack_drafts(drafts), drafts, params, noises, [40 + step] * 3)
            got += [fwd.logits.copy(), fwd.hidden.copy()]
            ver.append([(v.accepted_nodes.tolist(), v.output_ids.tolist()) for v in vs])
            rt.commit([0, 1, 2], [v.accepted_nodes for v in vs])
        outs.append(got)
        verdicts.append(ver)
        counts = {"graphs_captured": sum(k[2] != "_step" for k in rt._graphs),
                  "step_graphs_captured": sum(k[2] == "_step" for k in rt._graphs)}
        rt.close()
    diff = max(float(np.abs(a - b).max()) for a, b in zip(*outs))
    return {"max_abs_logit_diff": diff, "verdicts_identical": verdicts[0] == verdicts[1], **counts}


def fp8_hardware(plan: Plan) -> dict:
    """Which recipes torch._scaled_mm runs on this device and gives the emulation's numbers
    (on the dry run's CPU: its own _scaled_mm, where it has the form)."""
    from backend.runtime.torch_model import probe_scaled_mm

    return {r.name: probe_scaled_mm(torch.device(plan.device), r) for r in fp8.RECIPES}


def spec_bench(repo: str, out_json: str, limit: int | None, max_new_tokens: int, k: int = 4,
               gpu_path: bool = False) -> dict:
    """`specdec bench --drafter prompt-lookup --num-draft-tokens k` on a built model repository,
    after one unmeasured pass of the same prompts in every mode (plain and speculative: every
    prompt's kernels compiled and graphs captured before the clock runs; prompt lookup keeps no
    state between requests, so the pass flatters neither mode). The result as the bench writes
    it (`out_json`), with the warm-up pass's tokens/s, TPOT and first token beside.
    `gpu_path` (the dry run's CPU): the target runtime as a GPU runs it (gpu_path())."""
    from pathlib import Path

    from backend.bench import spec_bench as sb
    from backend.bench.prompt_sets import default_prompts, load_prompts
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.config import DrafterKind, ServeConfig, SpecConfig
    from backend.engine import make_decoder

    prompts = load_prompts(default_prompts())[:limit]
    spec = SpecConfig(num_draft_tokens=k, prompt_lookup_width=1)        # the CLI's defaults
    dec = make_decoder(ServeConfig(engine_dir=str(Path(repo) / ENGINE_SUBDIR), spec=spec))
    if gpu_path:        # the shortest prompt: the interpreter's prefill grows with its square
        set_gpu_path(dec.target)
        prompts = [min(load_prompts(default_prompts()), key=lambda p: len(json.dumps(p["messages"])))]
    warm = sb.run(dec, prompts, DrafterKind.PROMPT_LOOKUP, max_new_tokens, num_draft_tokens=k, log=lambda *a: None)
    sb.run(dec, prompts, DrafterKind.PROMPT_LOOKUP, max_new_tokens, num_draft_tokens=k, out_json=Path(out_json))
    result = json.loads(Path(out_json).read_text())
    result["warmup_pass"] = {m: {x: warm[m][x] for x in ("tokens_per_s", "tpot_ms", "ttft_ms")}
                             for m in ("plain", "spec")}
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def set_gpu_path(rt: TorchRuntime) -> None:
    """A runtime a serving build made for this CPU, switched to what the same build makes on a
    GPU (attention, verification, linears, norms and the fused step by the Triton kernels, in
    the interpreter here; graphs by EagerGraph). The dry run's only: a CPU serves the other way
    because the interpreter is slow, not because the results differ."""
    rt.kernels = rt.device_verify = True
    rt.model.invariant = True
    rt.use_graphs = True


if __name__ == "__main__":        # the spec bench's subprocess (gpu_check.Run.spec_bench)
    import sys

    repo, out_json, limit, new, gpu = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
    spec_bench(repo, out_json, limit or None, new, gpu_path=gpu == ["--gpu-path"])
