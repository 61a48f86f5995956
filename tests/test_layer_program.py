"""The layer as a program (issue 51): a family that changes the order of a layer's steps or where
its norms sit is its program (manifest.ModelConfig.program, the ops of backend/program.py) and its
weights' names, nothing in any engine. Two toy families on a tiny Llama checkpoint, each nothing
but its program (set here on ModelConfig; a real family writes it in ModelConfig.program and its
tensor names in buildlib/checkpoint.py):
    parallel   x + attention(norm(x)) + MLP(norm'(x)): the attention's residual waits (a parallel
               block, as GPT-J, GPT-NeoX and Cohere run attention and MLP)
    post-norm  no input norms; each block's output normed before its residual (OLMo-2's placement)
Every engine runs them as built by the ordinary build: the native kernel (gguf), ONNX Runtime's
graph (fp32), the torch runtime (`--device cuda`, here on the CPU) and the engine graph
(`--device tensorrt`, on ONNX Runtime with the plugins' references). Each engine's prefill logits
are held to a numpy reading of the same program (the float engines within 1e-4, the native one
within its int8 quantization, its greedy tokens the reading's), every build measures its engine
batch invariant, and the fused GPU step's peephole pass declines what its kernels do not fuse (the
torch model then runs the ops one by one). Also the counts architecture.md's "where a change goes"
gives, from the tree: which files interpret the op kinds."""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import pytest

from backend import program
from backend.manifest import Device, ModelConfig, WeightFormat
from conftest import device_env, make_tiny_checkpoint, prefill_logits, rel_err

ROOT = Path(__file__).resolve().parents[1]
STANDARD = ModelConfig.program


def parallel(cfg: ModelConfig, layer: int, tap: bool = False, eagle3: bool = False) -> tuple:
    ops = list(STANDARD(cfg, layer, tap, eagle3))
    first = next(j for j, op in enumerate(ops) if isinstance(op, program.Residual))
    ops[first] = dataclasses.replace(ops[first], parallel=True)
    return tuple(ops)


def post_norm(cfg: ModelConfig, layer: int, tap: bool = False, eagle3: bool = False) -> tuple:
    ops = [op for op in STANDARD(cfg, layer, tap, eagle3) if not isinstance(op, program.Norm)]
    norms = iter(("attn_norm", "mlp_norm"))          # the checkpoint's two norms, placed after each block
    return tuple(dataclasses.replace(op, norm=next(norms)) if isinstance(op, program.Residual) else op for op in ops)


FAMILIES = {"parallel": parallel, "post-norm": post_norm}
ENGINES = [(Device.CPU, "gguf"), (Device.CPU, "fp32"), (Device.CUDA, "fp32"), (Device.TENSORRT, "fp32")]
PROMPT = [5, 17, 42, 9, 77, 3, 120, 8, 64, 11, 250, 30]


def reference_logits(ck, ops_of, ids: list[int]) -> np.ndarray:
    """The program read in numpy over a prompt (causal attention, no cache) -> logits [T, V]."""
    from backend.engine_format import rope_tables

    cfg = ck.config
    w = lambda name: ck.tensor(name).float32()
    nh, nkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    rms = lambda v, g: v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g
    cos, sin = (tab[: len(ids)][:, None] for tab in rope_tables(cfg, len(ids)))
    rot = lambda v: np.concatenate([v[..., : d // 2] * cos - v[..., d // 2:] * sin,
                                    v[..., d // 2:] * cos + v[..., : d // 2] * sin], -1)
    causal = np.triu(np.full((len(ids), len(ids)), -np.inf), 1)
    x = w("embed")[ids] * np.float32(cfg.embed_scale)
    for i in range(cfg.num_layers):
        h, pending, lw = x, None, lambda n: w(f"layers.{i}.{n}")
        for op in ops_of(cfg, i):
            if isinstance(op, program.Norm):
                h = rms(h, lw(op.weight))
            elif isinstance(op, program.Linear):
                h = h @ np.concatenate([lw(p) for p in op.parts]).T
            elif isinstance(op, program.Rope):
                h = (rot(h[:, :nh * d].reshape(-1, nh, d)), rot(h[:, nh * d:(nh + nkv) * d].reshape(-1, nkv, d)),
                     h[:, (nh + nkv) * d:].reshape(-1, nkv, d))
            elif isinstance(op, program.Attention):
                q, k, v = h
                k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
                s = np.einsum("qhd,khd->hqk", q, k) * op.scale + causal
                p = np.exp(s - s.max(-1, keepdims=True))
                h = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(len(ids), nh * d)
            elif isinstance(op, program.Gate):
                g, u = np.split(h, 2, -1)
                h = g / (1 + np.exp(-g)) * u
            elif isinstance(op, program.Residual):
                t = rms(h, lw(op.norm)) if op.norm else h
                x, pending = ((x, t) if op.parallel else ((x if pending is None else x + pending) + t, None))
                h = x
            else:
                raise AssertionError(f"the reading has no {op}")
    return rms(x, w("norm")) @ w("embed").T


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("program") / "ckpt", seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_that_changes_the_order_is_its_program_on_every_engine(checkpoint, tmp_path, family, monkeypatch):
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices import load_runtime
    from backend.devices.native.backend import NativeOptions

    monkeypatch.setattr(ModelConfig, "program", FAMILIES[family])
    ck = load_checkpoint(checkpoint)
    want, llama = reference_logits(ck, FAMILIES[family], PROMPT), reference_logits(ck, STANDARD, PROMPT)
    for device, fmt in ENGINES:
        env = device_env(device.value)
        m = build(BuildConfig(target=str(checkpoint), output=tmp_path / f"{device.value}_{fmt}", device=device,
                              weights=(WeightFormat(fmt),), quiet=True, measure_costs=False,
                              options=(NativeOptions(wide_activations="none"),)))
        got = prefill_logits(load_runtime(m, fmt), 0, PROMPT)
        env.undo()
        assert m.engine(fmt).batch_invariant, (device, fmt)
        # int8 activations, Q8_0 weights and f16 KV (gguf): far closer to the family's reading than
        # to the Llama layer's (the same weights in the standard order)
        bound = 0.02 if fmt == "gguf" else 1e-4
        assert rel_err(got, want) < min(bound, rel_err(got, llama) / 4), (family, device, fmt, rel_err(got, want))
        assert (got.argmax(-1) == want.argmax(-1)).all(), (family, device, fmt)


def test_the_fused_gpu_step_fuses_the_llama_and_gemma_layers_and_declines_the_rest():
    """plugins/fused.py's kernels take a layer whose norms follow residuals and whose attention
    follows its rotary (runtime/torch_model._fused_steps); the toy families run op by op."""
    from backend.runtime.torch_model import _fused_steps

    class Layer:                                     # what the peephole pass reads of a torch layer
        def __init__(self, ops):
            self.ops, self.qk_norm = ops, "qk"
            self.norms = {n: n for n in program.norms(ops)}
            self.linear = {op.name: op.name for op in ops if isinstance(op, program.Linear)}

    cfg = ModelConfig(architecture="gemma3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=64, tie_word_embeddings=True, qk_norm=True, post_norms=True)
    for c in (cfg, cfg.llama_layer()):
        steps = _fused_steps(Layer(c.program(0, tap=True)))
        assert [s[0] for s in steps] == ["norm", "linear", "attend", "linear", "residual", "norm", "gated", "linear",
                                         "residual"], steps
        assert steps[0][2] is True                   # the feature tapped where the stream is whole
    for family in FAMILIES.values():
        assert _fused_steps(Layer(family(cfg, 0))) is None


def files_naming(pattern: str) -> list[str]:
    out = subprocess.run(["git", "grep", "-lE", pattern, "--", "backend", "plugins"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return sorted(out.split())


def test_the_op_kinds_are_interpreted_where_architecture_md_says():
    """The files that name an op kind: the program's declaration, the model description that
    writes programs, and the interpreters (architecture.md, "where a change goes": a new order or
    placement touches none of the interpreters; a new kind is a case in each)."""
    kinds = "|".join(k.__name__ for k in program.KINDS)
    named = files_naming(rf"\bprogram\.({kinds})\b|\b({kinds})\(|SD_OP_[A-Z_]+")
    interpreters = ["backend/buildlib/engine_graph.py", "backend/buildlib/graph.py", "backend/runtime/native.py",
                    "backend/runtime/torch_model.py", "backend/train/eagle_model.py", "plugins/native/forward.c"]
    assert named == sorted(interpreters + ["backend/manifest.py", "backend/program.py"]), named
    doc = " ".join((ROOT / "docs/architecture.md").read_text().split())
    bullet = doc[doc.index("**A new op kind**"):]
    bullet = bullet[:bullet.index("- **")]
    assert all(f"`{f.removeprefix('backend/')}`" in bullet for f in interpreters), bullet
