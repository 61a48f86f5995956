"""Gemma-3's layer on the GPU path, proven on a CPU: the tree-attention op's sliding window (the
reference against a brute-force computation; the Triton kernels, interpreted, against the
reference and bitwise independent of the batch and of where a node's path sits; the plugin's
kernel compiled to PTX with a window), the torch runtime of a `--device cuda` build (attention by
the reference, and by the Triton kernel in Triton's interpreter) and the TensorRT engine graph of
a `--device tensorrt` build (on ONNX Runtime with the plugins' references), each held to
transformers on the tiny random Gemma-3 of conftest.make_tiny_checkpoint (window 6, layers
sliding / full / sliding with their own rope bases, q/k norms, post norms, GeGLU, a scaled
embedding, q's scale from query_pre_attn_scalar): prefill past the window, incremental decode,
every branch of a tree equal to the branch alone, greedy speculation equal to plain decoding;
and the final logit soft-cap on a variant of the checkpoint."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import (assert_compiles, assert_spec_is_plain, assert_verify_equals_steps_along_paths,
                      decode_and_branch_errors, device_env, hf_logits, make_tiny_checkpoint, plugin_attention_case,
                      prefill_logits, rel_err, tree_branch_error)

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from backend.manifest import Device, WeightFormat  # noqa: E402
from plugins import kernels as K  # noqa: E402
from plugins.reference import paths_of, tree_attention_ref, write_nodes  # noqa: E402

WINDOW = 6




def tt(a):
    return torch.from_numpy(np.ascontiguousarray(a))


# --- the op ------------------------------------------------------------------------------------
def _case(seed, parents, ctxs, hq=4, hkv=2, d=16, cols=96, slots=5, n_prior=None):
    """Random q / caches and the paths of `parents` (after n_prior earlier scratch nodes, chained)."""
    rng = np.random.default_rng(seed)
    parents = np.asarray(parents, np.int32)
    b, t = parents.shape
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    kc = rng.standard_normal((slots, hkv, cols, d)).astype(np.float32)
    vc = rng.standard_normal((slots, hkv, cols, d)).astype(np.float32)
    sl = rng.permutation(slots)[:b].astype(np.int32)
    paths = paths_of(parents)
    if n_prior is not None:                  # a drafter's later level: earlier scratch nodes first
        full = np.full((b, t, t + max(n_prior)), -1, np.int32)
        for r in range(b):
            for j in range(t):
                own = paths[r, j][paths[r, j] >= 0]
                if own.size:
                    full[r, j, : n_prior[r] + own.size] = list(range(n_prior[r])) + list(n_prior[r] + own)
        paths = full
    return q, kc, vc, sl, np.asarray(ctxs, np.int32), paths


def _brute(q, kc, vc, slots, ctx, paths, scale, window):
    """Each node's own sequence written out (committed column c at position c, its path entry i
    at ctx + i), keys at positions > p - window, p the node's position; float64."""
    b, t, hq, _ = q.shape
    g = hq // kc.shape[1]
    out = np.full(q.shape, np.nan)
    for r in range(b):
        c0 = int(ctx[r])
        for j in range(t):
            path = paths[r, j][paths[r, j] >= 0]
            if not path.size:
                continue                       # padding
            cols = np.concatenate([np.arange(c0), c0 + path])
            pos = np.arange(cols.size)
            p = c0 + path.size - 1
            keep = pos > p - window if window else np.ones(cols.size, bool)
            for h in range(hq):
                k = kc[slots[r], h // g][cols[keep]].astype(np.float64)
                v = vc[slots[r], h // g][cols[keep]].astype(np.float64)
                s = k @ q[r, j, h].astype(np.float64) * scale
                w = np.exp(s - s.max())
                out[r, j, h] = (w / w.sum()) @ v
    return out


PARENTS = [[-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 3, 5], [-1, 0, 1, -2, -2, -2, -2]]


@pytest.mark.parametrize("window", [1, 3, 7, 40])
def test_reference_window_equals_the_brute_force_computation(window):
    for n_prior in (None, [0, 2, 5]):
        q, kc, vc, sl, ctx, paths = _case(window, PARENTS, (45, 3, 30), n_prior=n_prior)
        got = tree_attention_ref(q, kc, vc, sl, ctx, paths, 0.3, window)
        want = _brute(q, kc, vc, sl, ctx, paths, 0.3, window)
        real = ~np.isnan(want)
        assert np.abs(got[real] - want[real]).max() < 1e-6
        full = tree_attention_ref(q, kc, vc, sl, ctx, paths, 0.3)
        assert np.array_equal(full, tree_attention_ref(q, kc, vc, sl, ctx, paths, 0.3, 0))
        assert window >= 40 or np.abs(full - got)[real].max() > 1e-3      # the window matters


@pytest.mark.parametrize("window", [1, 5, 33])
def test_kernel_window_matches_the_reference_and_is_batch_independent(window):
    """Contexts before, at and past block boundaries (32), chains, branches, padding, nodes over
    earlier scratch: the kernel within 1e-5 of the reference; each row's bits equal to the row
    launched alone."""
    q, kc, vc, sl, ctx, paths = _case(10 + window, PARENTS, (64, 29, 0), n_prior=[3, 0, 1])
    ref = tree_attention_ref(q, kc, vc, sl, ctx, paths, 0.25, window)
    got = K.tree_attention(tt(q), tt(kc), tt(vc), tt(sl), tt(ctx), tt(paths), 0.25, window).numpy()
    assert not np.isnan(got).any() and np.abs(got - ref).max() < 1e-5
    for r in range(q.shape[0]):
        alone = K.tree_attention(tt(q[r:r + 1]), tt(kc), tt(vc), tt(sl[r:r + 1]), tt(ctx[r:r + 1]),
                                 tt(paths[r:r + 1]), 0.25, window).numpy()
        assert np.array_equal(alone[0], got[r]), r


@pytest.mark.parametrize("window,ctx", [(6, 45), (40, 61)])
def test_kernel_window_bits_equal_single_steps_along_each_path(window, ctx):
    """One verify over a tree equals, bit for bit, single steps along each node's path with the
    path committed in order: the window counts along the node's own path, wherever it sits."""
    def attend(q, k, v, slots, ctx, paths):
        return K.tree_attention(tt(q), tt(k), tt(v), tt(slots), tt(ctx), tt(paths), 0.2, window).numpy()

    assert_verify_equals_steps_along_paths(attend, np.random.default_rng(window), 4, 2, 16, ctx)


@pytest.mark.parametrize("window", [4, 12])
def test_plugin_kernel_window_matches_the_reference_and_the_runtime_kernel(window):
    """The TensorRT plugin's kernel (this forward's nodes read from k / v, window compiled in)
    equals the reference op of ONNX Runtime (plugins/ort_ops.py: write the nodes, then the
    reference), and bitwise the runtime's kernel on the written cache."""
    q, k, v, kc, vc, slots, ctx, nprior, paths = plugin_attention_case(np.random.default_rng(window))
    kw, vw = write_nodes(kc, vc, k, v, slots, ctx, nprior)
    ref = tree_attention_ref(q, kw, vw, slots, ctx, paths, 0.25, window)
    o = K.tree_attention_plugin(tt(q), tt(k), tt(v), tt(kc), tt(vc), tt(slots), tt(ctx), tt(nprior), tt(paths),
                                0.25, window).numpy()
    assert np.abs(o - ref).max() < 1e-5
    assert np.array_equal(o, K.tree_attention(tt(q), tt(kw), tt(vw), tt(slots), tt(ctx), tt(paths), 0.25,
                                              window).numpy())


def test_the_windowed_kernels_compile_to_ptx_for_sm90():
    """The plugin's kernel with a window compiled in (a static branch) and the runtime's kernel
    (the window a scalar), in a process without the interpreter; the plugin still takes
    exactly TensorRT's 13 parameters."""
    code = ("import sys; from plugins.kernels import compile_plugin; from plugins.ptx import compile_ptx\n"
            "ptx, sym, shared = compile_plugin('tree_attention', 90, kv_dtype='bf16', head_dim=32, group=2,"
            " num_kv_heads=2, scale=0.2, window=6)\n"
            "entry = ptx[ptx.index('.entry ' + sym):]\n"
            "ok = entry[:entry.index(')')].count('.param') == 13 and shared <= 48 * 1024\n"
            "ptx2, sym2 = compile_ptx('tree_attention', 90, kv_dtype='bf16', head_dim=32, group=2)\n"
            "sys.exit(0 if ok and '.target sm_90' in ptx and '.target sm_90' in ptx2 else 3)")
    assert_compiles(code)


# --- the runtimes ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3_gpu")
    ckpt = make_tiny_checkpoint(d / "ckpt", "gemma3", layers=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return d, ckpt, hf


# the FP8 engines' recipe, named: the build's own choice tries every recipe on this random model
# (~50 s of CPU per build here; the choice is test_fp8_recipes'); static input scales, the path
# with act_scale tensors, and GPTQ rounding
FP8 = "channel-tensor+gptq"


@pytest.fixture(scope="module")
def cuda_build(gemma_ckpt):
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices.cuda import Fp8Options

    d, ckpt, hf = gemma_ckpt
    m = build(BuildConfig(target=str(ckpt), output=d / "cuda", device=Device.CUDA, quiet=True, measure_costs=False,
                          weights=(WeightFormat.FP32, WeightFormat.BF16, WeightFormat.FP8), drafts=("self:1",),
                          options=(Fp8Options(FP8),)))
    return m, hf


@pytest.fixture(scope="module")
def trt_build(gemma_ckpt):
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices.cuda import Fp8Options

    d, ckpt, hf = gemma_ckpt
    mp = device_env("tensorrt")                        # the engine graph on ONNX Runtime (references)
    m = build(BuildConfig(target=str(ckpt), output=d / "trt", device=Device.TENSORRT, quiet=True,
                          measure_costs=False, weights=(WeightFormat.FP32, WeightFormat.FP8), drafts=("self:1",),
                          options=(Fp8Options(FP8),)))
    yield m, hf
    mp.undo()


def load(m, fmt):
    from backend.devices import load_runtime

    return load_runtime(m, fmt)


def check_decode_and_branches(rt, hf, vocab: int, tol: float = 1e-4, tree_choices=None) -> dict:
    """Decode steps past the window equal transformers' full forward; a tree's branches, verified in
    one forward, equal each branch decoded alone (bitwise) and transformers -> the largest errors."""
    errs = decode_and_branch_errors(rt, hf, vocab, WINDOW, tree_choices)
    errs = {"decode": errs["decode"], "tree": errs["tree"]}
    assert max(errs.values()) < tol, errs
    return errs


@pytest.mark.slow
def test_cuda_build_prefill_past_the_window_matches_transformers(cuda_build):
    from backend.devices.cuda import Fp8Record

    m, hf = cuda_build
    assert m.device is Device.CUDA and m.gpu is None and m.model.architecture == "gemma3"
    assert all(ef.batch_invariant for ef in m.engines.values()), {k: e.batch_invariant for k, e in m.engines.items()}
    ids = np.random.default_rng(1).integers(3, m.model.vocab_size, 4 * WINDOW + 3)
    ref = hf_logits(hf, ids)
    errs = {}
    for fmt, tol in (("fp32", 1e-4), ("bf16", 3e-2), ("fp8", 0.3)):
        rt = load(m, fmt)
        got = prefill_logits(rt, 1, ids)
        errs[fmt] = rel_err(got, ref)
        if fmt == "fp32":
            assert (got.argmax(-1) == ref.argmax(-1)).all()
        rt.close()
    assert errs["fp32"] < 1e-4 and errs["bf16"] < 3e-2 and errs["fp8"] < 0.3, errs
    tensors = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(m.resolve(m.engine("fp8").path)))
    recipe = Fp8Record.of(m.engines["fp8"]).recipe
    assert recipe["inputs"] == "tensor" and recipe["gptq"]
    assert tensors["layers.0.q"].dtype == torch.float8_e4m3fn and tensors["layers.0.qkv.w_scale"].dtype == torch.float32
    assert tensors["layers.0.qkv.act_scale"].dtype == torch.float32 and "layers.2.down.act_scale" in tensors
    assert tensors["layers.0.q_norm"].dtype == torch.bfloat16 and tensors["layers.2.post_mlp_norm"].shape == (64,)


@pytest.mark.slow
def test_cuda_build_with_the_triton_kernel_matches_transformers(cuda_build):
    """The torch runtime with its attention by the Triton kernel (interpreted here), as on a GPU:
    a prefill past the window and a small tree against transformers and the branches alone."""
    m, hf = cuda_build
    rt = load(m, "fp32")
    rt.kernels = True
    ids = np.random.default_rng(3).integers(3, m.model.vocab_size, 3 * WINDOW + 2)
    got = prefill_logits(rt, 1, ids)
    assert rel_err(got, hf_logits(hf, ids)) < 1e-4
    rt.free(1)
    from backend.tree import TokenTree

    rng = np.random.default_rng(4)
    prefix = list(rng.integers(3, m.model.vocab_size, WINDOW + 1))
    tree = TokenTree.from_choices([[0], [1], [0, 0], [0, 0, 0]])
    assert tree_branch_error(rt, hf, prefix, tree, rng.integers(3, m.model.vocab_size, tree.num_nodes), sid=2) < 1e-4
    rt.close()


@pytest.mark.slow
def test_cuda_build_incremental_decode_and_tree_branches(cuda_build):
    m, hf = cuda_build
    rt = load(m, "fp32")
    check_decode_and_branches(rt, hf, m.model.vocab_size)
    rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["prompt-lookup", "draft-model"])
def test_cuda_build_greedy_speculation_is_plain(cuda_build, kind, plain_tokens):
    assert_spec_is_plain(plain_tokens, cuda_build[0], "fp32", kind, num_draft_tokens=4)


@pytest.mark.slow
def test_engine_graph_equals_the_standard_graph_with_windows(gemma_ckpt):
    """The engine graph (plugin attention with each layer's window, local rope, q/k norms in the
    graph) against the standard-ops graph: prefill chains past the window, steps, chain verify,
    trees, a padded batch, and its rejection_sample."""
    import onnx

    from backend.buildlib.checkpoint import load_checkpoint
    from backend.buildlib.graph import GraphSpec, build_decoder
    from backend.bench import engine_check

    ck = load_checkpoint(gemma_ckpt[1])
    model = build_decoder(ck, GraphSpec(WeightFormat.FP32, ck.config.num_layers, 64, plugins=True))
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
             for n in model.graph.node if n.op_type == "tree_attention"]
    assert [a["window"] for a in attrs] == [WINDOW, 0, WINDOW] and all(a["scale"] == 1.0 for a in attrs)
    r = engine_check.compare(ck)
    assert r["cases"] == 7 and r["max_abs_err"] < 1e-4 and r["verify_equal"], r


@pytest.mark.slow
def test_tensorrt_build_matches_transformers(trt_build):
    m, hf = trt_build
    assert m.device is Device.TENSORRT and m.engines["fp32"].batch_invariant
    ids = np.random.default_rng(1).integers(3, m.model.vocab_size, 4 * WINDOW + 3)
    ref = hf_logits(hf, ids)
    errs = {}
    for fmt in ("fp32", "fp8"):
        rt = load(m, fmt)
        errs[fmt] = rel_err(prefill_logits(rt, 1, ids), ref)
        rt.close()
    assert errs["fp32"] < 1e-4 and errs["fp8"] < 0.3, errs
    rt = load(m, "fp32")
    check_decode_and_branches(rt, hf, m.model.vocab_size)
    rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["prompt-lookup", "draft-model"])
def test_tensorrt_build_greedy_speculation_is_plain_with_verification_in_the_graph(trt_build, kind, monkeypatch,
                                                                                  plain_tokens):
    from backend.runtime import engine_rt

    monkeypatch.setattr(engine_rt, "verify_on_host", lambda *a: pytest.fail("verified on the host"))
    assert_spec_is_plain(plain_tokens, trt_build[0], "fp32", kind, num_draft_tokens=4)


@pytest.mark.slow
def test_final_logit_softcap_on_the_torch_model_and_the_engine_graph(gemma_ckpt, tmp_path):
    """A Gemma-3 checkpoint with final_logit_softcapping (transformers applies it; the cap is
    small enough to bend this random model's logits): the torch runtime and the engine graph
    (on ONNX Runtime with the reference ops) give transformers' logits."""
    from backend.devices.cuda import export as torch_engine
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.buildlib.graph import GraphSpec, build_decoder, save_model
    from backend.config import RuntimeOptions
    from backend.runtime.engine_rt import EngineRuntime, OrtExecutor
    from backend.runtime.torch_rt import TorchRuntime

    pytest.importorskip("onnxruntime_extensions")
    _, ckpt, hf = gemma_ckpt
    capped = tmp_path / "capped"
    capped.mkdir()
    for f in ckpt.iterdir():
        (capped / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((capped / "config.json").read_text())
    cfg["final_logit_softcapping"] = 0.5
    (capped / "config.json").write_text(json.dumps(cfg))
    ck = load_checkpoint(capped)
    c = ck.config
    assert c.final_logit_softcap == 0.5 and "final_logit_softcap" in c.features()
    hf_capped = transformers.AutoModelForCausalLM.from_pretrained(str(capped), dtype=torch.float32).eval()
    ids = np.random.default_rng(5).integers(3, c.vocab_size, 3 * WINDOW)
    ref = hf_logits(hf_capped, ids)
    assert rel_err(ref, hf_logits(hf, ids)) > 0.1                    # the cap bends these logits
    ef = torch_engine.export(ck, WeightFormat.FP32, c.num_layers, tmp_path, "capped")
    rt = TorchRuntime(tmp_path / ef.path, c, c.num_layers, 64, RuntimeOptions(max_sequences=1), "cpu")
    errs = {"torch": rel_err(prefill_logits(rt, 0, ids), ref)}
    rt.close()
    save_model(build_decoder(ck, GraphSpec(WeightFormat.FP32, c.num_layers, 64, plugins=True)), tmp_path / "e.onnx")
    rt = EngineRuntime(OrtExecutor(tmp_path / "e.onnx", c, c.num_layers), c, c.num_layers, 64,
                       RuntimeOptions(max_sequences=1))
    errs["engine_graph"] = rel_err(prefill_logits(rt, 0, ids), ref)
    rt.close()
    assert max(errs.values()) < 1e-4, errs
