"""The attention-logit soft-cap (Gemma-2's attn_logit_softcapping: scores = cap tanh(q.k scale /
cap), then the mask and the softmax) on every engine, from conftest.make_tiny_checkpoint's tiny
random Gemma-3 with the cap set in its config.json (small, so it bends this model's scores). The
reference is transformers with Gemma-2's eager attention (which applies the cap) in the Gemma-3
layer: transformers' Gemma-3 attention does not pass the config's cap on (Gemma-3 has none). The
tree-attention op's reference and Triton kernels (interpreted) against a brute-force computation;
the ONNX fp32 graph against transformers within 1e-4 and the native engine within its
quantization (prefill past the window, incremental decode, every branch of a tree equal to the
branch alone); the torch model of a `--device cuda` build (by the reference, and by the Triton
kernel) and the TensorRT engine graph (ONNX Runtime with the reference ops) against transformers;
greedy speculation identical to plain decoding on the ONNX and native engines."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import (assert_compiles, assert_greedy_identity, decode_and_branch_errors, hf_logits,
                      make_tiny_checkpoint, prefill_logits, rel_err, spec_decoder)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from backend.manifest import Device, WeightFormat  # noqa: E402

WINDOW = 6
CAP = 2.0


HF_ATTENTION = "gemma2_eager_softcap"


def _gemma2_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    return eager_attention_forward(module, query, key, value, attention_mask,
                                   softcap=module.config.attn_logit_softcapping, **kwargs)


def _hf(ckpt):
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(HF_ATTENTION, _gemma2_attention)
    AttentionMaskInterface.register(HF_ATTENTION, eager_mask)
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                             attn_implementation=HF_ATTENTION).eval()


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """(directory, the capped checkpoint, transformers on it, transformers without the cap: the
    same weights and attention code, attn_logit_softcapping None)."""
    d = tmp_path_factory.mktemp("softcap")
    ckpt = make_tiny_checkpoint(d / "ckpt", "gemma3", layers=3)
    plain = _hf(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["attn_logit_softcapping"] = CAP
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return d, ckpt, _hf(ckpt), plain


@pytest.fixture(scope="module")
def cpu_build(capped):
    from backend.builder.pipeline import BuildConfig, build

    d, ckpt, hf, _ = capped
    return build(BuildConfig(target=str(ckpt), output=d / "cpu", quiet=True, measure_costs=False,
                             weights=(WeightFormat.FP32, WeightFormat.GGUF), drafts=("self:1",))), hf


def test_the_cap_is_read_bends_the_logits_and_every_device_implements_it(capped):
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.devices import BACKENDS

    _, ckpt, hf, plain = capped
    c = load_checkpoint(ckpt).config
    assert c.attn_logit_softcap == CAP and "attn_logit_softcap" in c.features()
    assert all(b.unsupported(c) == [] for b in BACKENDS), {b.name: b.unsupported(c) for b in BACKENDS}
    ids = np.random.default_rng(5).integers(3, c.vocab_size, 3 * WINDOW)
    assert rel_err(hf_logits(hf, ids), hf_logits(plain, ids)) > 0.1         # the cap matters here


# --- the op ------------------------------------------------------------------------------------
def _brute(q, kc, vc, slots, ctx, paths, scale, window, cap):
    """Each node's own sequence written out, every score capped, then the window; float64."""
    b, t, hq, _ = q.shape
    g = hq // kc.shape[1]
    out = np.zeros(q.shape)
    for r in range(b):
        c0 = int(ctx[r])
        for j in range(t):
            path = paths[r, j][paths[r, j] >= 0]
            cols = np.concatenate([np.arange(c0), c0 + path])
            keep = np.arange(cols.size) > c0 + path.size - 1 - window if window else np.ones(cols.size, bool)
            for h in range(hq):
                k = kc[slots[r], h // g][cols].astype(np.float64)
                s = k @ q[r, j, h].astype(np.float64) * scale
                s = np.where(keep, cap * np.tanh(s / cap), -np.inf)
                w = np.exp(s - s.max())
                out[r, j, h] = (w / w.sum()) @ vc[slots[r], h // g][cols].astype(np.float64)
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_reference_and_kernels_with_the_cap_equal_the_brute_force_computation(window):
    """The reference (float64) equals the brute force; the runtime's Triton kernel (interpreted)
    and the plugin's (this forward's nodes from k / v, the cap compiled in) are within 1e-5 of
    it, the kernel's rows bitwise independent of the batch and the plugin bitwise the kernel."""
    pytest.importorskip("triton")
    from plugins import kernels as K
    from plugins.reference import paths_of, tree_attention_ref, write_nodes

    tt = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    rng = np.random.default_rng(window)
    b, n, hq, hkv, d, s, cols = 3, 5, 4, 2, 16, 4, 80
    q = 2 * rng.standard_normal((b, n, hq, d)).astype(np.float32)       # scores well past the cap
    k, v = (rng.standard_normal((b, n, hkv, d)).astype(np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal((s, hkv, cols, d)).astype(np.float32) for _ in range(2))
    slots, ctx, nprior = np.array([2, 0, 1], np.int32), np.array([40, 3, 33], np.int32), np.zeros(3, np.int32)
    paths = paths_of(np.array([[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 3], [-1, 0, 1, 1, 2]], np.int32))
    kw, vw = write_nodes(kc, vc, k, v, slots, ctx, nprior)
    ref = tree_attention_ref(q, kw, vw, slots, ctx, paths, 0.3, window, CAP)
    assert np.abs(ref - _brute(q, kw, vw, slots, ctx, paths, 0.3, window, CAP)).max() < 1e-6
    assert np.abs(ref - tree_attention_ref(q, kw, vw, slots, ctx, paths, 0.3, window)).max() > 1e-2
    args = (tt(slots), tt(ctx), tt(paths), 0.3, window, CAP)
    got = K.tree_attention(tt(q), tt(kw), tt(vw), *args).numpy()
    assert np.abs(got - ref).max() < 1e-5
    for r in range(b):
        alone = K.tree_attention(tt(q[r:r + 1]), tt(kw), tt(vw), tt(slots[r:r + 1]), tt(ctx[r:r + 1]),
                                 tt(paths[r:r + 1]), 0.3, window, CAP).numpy()
        assert np.array_equal(alone[0], got[r]), r
    plug = K.tree_attention_plugin(tt(q), tt(k), tt(v), tt(kc), tt(vc), tt(slots), tt(ctx), tt(nprior), tt(paths),
                                   0.3, window, CAP).numpy()
    assert np.array_equal(plug, got)


def test_the_capped_kernels_compile_to_ptx_for_sm90():
    """The plugin's kernel with the cap compiled in (a static branch: one more exp per score
    than without) and the runtime's (the cap a scalar), in a process without the interpreter;
    the plugin still takes exactly TensorRT's 13 parameters."""
    pytest.importorskip("triton")
    code = ("import sys; from plugins.kernels import compile_plugin; from plugins.ptx import compile_ptx\n"
            "kw = dict(kv_dtype='bf16', head_dim=32, group=2, num_kv_heads=2, scale=0.2, window=6)\n"
            "ptx, sym, shared = compile_plugin('tree_attention', 90, softcap=2.0, **kw)\n"
            "plain = compile_plugin('tree_attention', 90, **kw)[0]\n"
            "entry = ptx[ptx.index('.entry ' + sym):]\n"
            "ok = entry[:entry.index(')')].count('.param') == 13 and shared <= 48 * 1024\n"
            "ok = ok and ptx.count('ex2.approx') > plain.count('ex2.approx')\n"
            "ptx2, _ = compile_ptx('tree_attention', 90, kv_dtype='bf16', head_dim=32, group=2)\n"
            "sys.exit(0 if ok and '.target sm_90' in ptx2 else 3)")
    assert_compiles(code)


# --- the CPU engines ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp32", "gguf"])
def test_cpu_engines_match_transformers(cpu_build, fmt):
    """Prefill past the window, decode steps, every branch of a tree (bitwise the branch alone):
    ONNX fp32 within 1e-4 of transformers, the native engine within its 4-bit quantization."""
    from backend.devices import load_runtime

    m, hf = cpu_build
    rt = load_runtime(m, fmt)
    ids = np.random.default_rng(1).integers(3, m.model.vocab_size, 4 * WINDOW + 3)
    err = rel_err(prefill_logits(rt, 1, ids), hf_logits(hf, ids))
    rt.free(1)
    errs = decode_and_branch_errors(rt, hf, m.model.vocab_size, WINDOW)
    rt.close()
    if fmt == "fp32":
        assert err < 1e-4 and errs["decode"] < 1e-4 and errs["tree"] < 1e-4, (err, errs)
    else:
        # 0.03 measured; without the cap these logits are 0.4 away
        assert err < 0.1 and all(same or e < 0.1 for e, same in errs["decode_steps"]), (err, errs)


@pytest.mark.parametrize("fmt", ["fp32", "gguf"])
def test_greedy_speculation_is_plain(cpu_build, fmt):
    plain = None
    for kind in ("prompt-lookup", "draft-model"):
        plain = assert_greedy_identity(spec_decoder(cpu_build[0], fmt, num_draft_tokens=4), kind, plain)


# --- the GPU path on a CPU ---------------------------------------------------------------------
def test_torch_model_matches_transformers(capped):
    """A `--device cuda` build's torch runtime: attention by the reference (prefill, decode, tree
    branches), then by the Triton kernel in Triton's interpreter (a prefill past the window)."""
    pytest.importorskip("triton")
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices import load_runtime

    d, ckpt, hf, _ = capped
    m = build(BuildConfig(target=str(ckpt), output=d / "cuda", device=Device.CUDA, quiet=True, measure_costs=False,
                          weights=(WeightFormat.FP32,), drafts=("self:1",)))
    rt = load_runtime(m, "fp32")
    errs = decode_and_branch_errors(rt, hf, m.model.vocab_size, WINDOW, [[0], [1], [0, 0], [0, 0, 0]])
    assert errs["decode"] < 1e-4 and errs["tree"] < 1e-4, errs
    rt.kernels = True
    ids = np.random.default_rng(3).integers(3, m.model.vocab_size, 3 * WINDOW + 2)
    assert rel_err(prefill_logits(rt, 1, ids), hf_logits(hf, ids)) < 1e-4
    rt.close()


def test_engine_graph_matches_transformers_and_the_standard_graph(capped, tmp_path):
    """The TensorRT engine graph (the cap as each tree_attention node's `softcap`) on ONNX
    Runtime with the reference ops: transformers' logits within 1e-4, and the standard graph's
    on prefill chains, steps, trees and a padded batch (bench/engine_check)."""
    pytest.importorskip("onnxruntime_extensions")
    import onnx

    from backend.buildlib.checkpoint import load_checkpoint
    from backend.buildlib.graph import GraphSpec, build_decoder, save_model
    from backend.config import RuntimeOptions
    from backend.runtime.engine_rt import EngineRuntime, OrtExecutor
    from backend.bench import engine_check

    _, ckpt, hf, _ = capped
    ck = load_checkpoint(ckpt)
    c = ck.config
    model = build_decoder(ck, GraphSpec(WeightFormat.FP32, c.num_layers, 64, plugins=True))
    caps = [onnx.helper.get_attribute_value(a) for n in model.graph.node if n.op_type == "tree_attention"
            for a in n.attribute if a.name == "softcap"]
    assert caps == [CAP] * c.num_layers
    save_model(model, tmp_path / "e.onnx")
    rt = EngineRuntime(OrtExecutor(tmp_path / "e.onnx", c, c.num_layers), c, c.num_layers, 64,
                       RuntimeOptions(max_sequences=1))
    ids = np.random.default_rng(5).integers(3, c.vocab_size, 4 * WINDOW + 3)
    assert rel_err(prefill_logits(rt, 0, ids), hf_logits(hf, ids)) < 1e-4
    rt.close()
    r = engine_check.compare(ck)
    assert r["max_abs_err"] < 1e-4 and r["verify_equal"], r
