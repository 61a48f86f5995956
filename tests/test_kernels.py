"""The Triton-language kernels against their numpy references (in Triton's interpreter on a CPU,
compiled where a GPU is), over T = 1, chains, branching trees, padded rows, GQA ratios 1-4,
contexts crossing block boundaries; attention's bitwise independence of T and of where columns
sit; and every kernel compiled to PTX for sm_90 (an explicit target needs no GPU), so an error
on the real compiler path fails CI.

Ordered evidence first (issue 49): the GPU check runs this file on a GPU in two timed parts
(benchmarks/gpu_run.py TEST_GROUPS), and a part cut at its limit loses only its tail. First the
invariant runtime end to end, then the linear, W8A16 and fused kernels bit for bit against the
unfused ops (the evidence the GPU's step rests on), then attention, verify and the plugin
kernels against their references, and the PTX compiles (CI's, not the GPU check's)."""
from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
F = torch.nn.functional

from conftest import assert_compiles, assert_verify_equals_steps_along_paths, plugin_attention_case  # noqa: E402
from plugins import kernels as K  # noqa: E402
from plugins.reference import paths_of, tree_attention_ref, verify_ref  # noqa: E402


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


def attention(q, kc, vc, slots, ctx, paths, scale, dtype=torch.float32):
    o = K.tree_attention(t(q).to(dtype), t(kc).to(dtype), t(vc).to(dtype), t(slots), t(ctx), t(paths), scale)
    return o.cpu().numpy()


def _runtime_on_random_weights(dtype, invariant: bool, recipe=None):
    """A two-layer Llama-shaped TorchRuntime with attention by the kernel and (invariant) the
    linears, LM head and norms by the fixed-tile kernels; `recipe`: its layer linears in FP8."""
    from backend.config import RuntimeOptions
    from backend.manifest import ModelConfig
    from backend.runtime.torch_rt import TorchRuntime

    cfg = ModelConfig("llama", 128, 64, 96, 2, 4, 2, 16, 1e-5, 10000.0, 256, True)
    g = torch.Generator().manual_seed(11)
    rnd = lambda *s, std=0.1: (torch.randn(*s, generator=g) * std).to(dtype)
    t = {"embed": rnd(128, 64, std=1.0), "norm": 1 + rnd(64)}
    for i in range(2):
        t.update({f"layers.{i}.attn_norm": 1 + rnd(64), f"layers.{i}.mlp_norm": 1 + rnd(64),
                  f"layers.{i}.q": rnd(64, 64), f"layers.{i}.k": rnd(32, 64), f"layers.{i}.v": rnd(32, 64),
                  f"layers.{i}.o": rnd(64, 64), f"layers.{i}.gate": rnd(96, 64), f"layers.{i}.up": rnd(96, 64),
                  f"layers.{i}.down": rnd(64, 96)})
    if recipe is not None:
        from backend.buildlib.fp8 import FUSED
        from backend.runtime import fp8

        for i in range(2):
            for key, parts in FUSED.items():
                names = [f"layers.{i}.{n}" for n in parts]
                q, t[f"layers.{i}.{key}.w_scale"] = fp8.quantize_weight(torch.cat([t[n].float() for n in names]), recipe)
                t.update(zip(names, q.split([t[n].shape[0] for n in names])))
    rt = TorchRuntime(None, cfg, 2, 256, RuntimeOptions(max_sequences=4, cuda_graphs=False), DEV,
                      tensors={k: v.to(DEV) for k, v in t.items()}, dtype=dtype, fp8_recipe=recipe)
    rt.kernels = True
    rt.model.invariant = invariant
    return rt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_invariant_runtime_verifies_with_the_bits_of_single_steps(dtype):
    """The GPU runtime's batch-invariant mode end to end: a verify of a 4-token chain in a batch
    of two gives, bit for bit, the logits of four single steps (cuBLAS picks its GEMM by the row
    count: on an H200 a CUDA graph's replay and eager differed by 0.75 in bf16, perf-notes §20),
    and the same logits as the torch path within rounding. (A 9-token prompt and a 6-token chain
    took no other path: the interpreter's time grows with the tokens.)"""
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 128, (1, 6))
    chain_toks = rng.integers(3, 128, 4)
    chain = lambda n: np.arange(-1, n - 1, dtype=np.int32)[None]
    rt = _runtime_on_random_weights(dtype, invariant=True)
    for s in (0, 1, 2):
        rt.alloc(s)
        rt.forward([s], prompt, chain(6), np.array([[5]]))
        rt.commit([s], [np.arange(6)])
    single = []
    for tok in chain_toks:
        single.append(rt.forward([0], np.array([[tok]]), chain(1), np.zeros((1, 1), np.int64)).logits[0, 0].copy())
        rt.commit([0], [np.array([0])])
    both = rt.forward([1, 2], np.stack([chain_toks, chain_toks[::-1]]), np.concatenate([chain(4)] * 2),
                      np.broadcast_to(np.arange(4), (2, 4)).copy()).logits
    assert np.array_equal(np.asarray(both[0]), np.stack(single))
    plain = _runtime_on_random_weights(dtype, invariant=False)
    plain.alloc(0)
    ref = plain.forward([0], np.concatenate([prompt, chain_toks[None]], 1), chain(10),
                        np.arange(6, 10)[None]).logits[0]
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert np.abs(np.asarray(ref) - np.stack(single)).max() < tol * max(1.0, np.abs(np.asarray(ref)).max())


# block128: its 128 x 128 scales span the fused qkv / gate_up weights' parts. g32-token's 1 x 32
# groups in the runtime, weight-only: test_fp8_w8a16's input-quantizing recipes (the same routing
# through linear_w8, asserted there); its kernel's bits: the weight-only FP8 linear's [1x32] below
@pytest.mark.parametrize("name", ["block128"])
def test_weight_only_fp8_linears_run_the_w8_kernel_with_the_bits_of_their_dequantized_weights(name):
    """A recipe with every linear weight-only (the build's W8A16 fallback) in the invariant mode:
    the linears read their FP8 codes through kernels.linear_w8 (their bf16 weights are never
    made), and the logits are, bit for bit, those of the same linears through kernels.linear
    on the dequantized weights."""
    from backend.buildlib.fp8 import FUSED
    from backend.runtime import fp8

    rec = fp8.recipe(name).with_weight_only([f"layers.{i}.{k}" for i in range(2) for k in FUSED])
    rt = _runtime_on_random_weights(torch.bfloat16, invariant=True, recipe=rec)
    ids = np.random.default_rng(4).integers(3, 128, (1, 11))
    chain = np.arange(-1, 10, dtype=np.int32)[None]
    rt.alloc(0)
    w8 = np.asarray(rt.forward([0], ids, chain, np.arange(11)[None]).logits[0]).copy()
    linears = rt.model.linears()
    assert len(linears) == 8 and all(lin.wq is not None and lin._w is None and lin.kernel for lin in linears.values())
    for lin in linears.values():
        assert lin.w.dtype == torch.bfloat16         # dequantized now, and the kernel path dropped
        lin.wq = None
    rt.alloc(1)
    assert np.array_equal(np.asarray(rt.forward([1], ids, chain, np.arange(11)[None]).logits[0]), w8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_and_rmsnorm_match_torch_and_a_rows_bits_do_not_depend_on_m(dtype):
    """The batch-invariant mode's kernels (runtime/torch_model.py on a GPU): y = x W^T + b and
    RMSNorm against torch, and each row the same bits at M = 1, 5, 37 (a verify's rows and a
    CUDA graph's padded bucket against single steps)."""
    g = torch.Generator().manual_seed(3)
    k, n = 200, 96                       # K and N not multiples of the tiles
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    x = torch.randn(37, k, generator=g).to(DEV, dtype)
    got = K.linear(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype and float((got.float() - ref).abs().max() / ref.abs().max()) < tol
    for m in (1, 5):
        assert torch.equal(K.linear(x[:m], w, b), got[:m])
    assert torch.equal(K.linear(x[3:4], w), K.linear(x, w)[3:4])
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, dtype)
    normed = K.rmsnorm(x, nw, 1e-6)
    xf = x.float()
    want = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * nw
    if dtype == torch.float32:
        assert float((normed - want).abs().max()) <= 1e-5
    else:                                                # within 2 bf16 ulps (the rounding of 1/rms)
        assert torch.allclose(normed.float(), want.float(), rtol=2 ** -6, atol=1e-3)
    for m in (1, 5):
        assert torch.equal(K.rmsnorm(x[:m], nw, 1e-6), normed[:m])
    heads = x.view(37, 8, 25)[:, :4]                     # q/k norms per head: a strided view
    assert torch.equal(K.rmsnorm(heads, nw[:25], 1e-6), K.rmsnorm(heads.contiguous(), nw[:25], 1e-6))


@pytest.mark.parametrize("block", [(1, 0), (128, 128), (1, 32)], ids=["channel", "128x128", "1x32"])
def test_the_weight_only_fp8_linear_is_the_linear_of_the_dequantized_weights(block):
    """linear_w8 (W8A16: FP8 weights and their block scales read by the kernel): the bits of
    `linear` on the bf16 weights the emulated path dequantizes to (runtime/fp8.py), at every M."""
    from backend.runtime import fp8

    g = torch.Generator().manual_seed(6)
    k, n = 200, 150                      # ragged against the tiles and the 128 x 128 blocks
    rec = fp8.Recipe("w8", block, "token")
    q, s = fp8.quantize_weight(torch.randn(n, k, generator=g) * torch.linspace(0.1, 4, k), rec)
    w = fp8.dequantize_weight(q, s, rec).to(torch.bfloat16)
    x = torch.randn(37, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    q, s, w, x, b = (t.to(DEV) for t in (q, s, w, x, b))
    got = K.linear_w8(x, q, s, block, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, K.linear(x, w, b))
    for m in (1, 5):
        assert torch.equal(K.linear_w8(x[:m], q, s, block), K.linear(x[:m], w))


# --- the fused kernels of the GPU step (plugins/fused.py, issue 41) -----------------------------
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
def test_add_rmsnorm_is_the_unfused_add_and_norms_bit_for_bit(dtype):
    """x + h (h normed first, Gemma's post norm), then RMSNorm: the bits of kernels.rmsnorm and
    torch's add, with and without the post norm and the residual, each row at any M."""
    from plugins import fused

    g = torch.Generator().manual_seed(8)
    x, h = (torch.randn(37, 200, generator=g).to(DEV, dtype) for _ in range(2))
    w, pw = ((1 + 0.2 * torch.randn(200, generator=g)).to(DEV, dtype) for _ in range(2))
    s, y = fused.add_rmsnorm(x, w, 1e-6, h, pw)
    want = x + K.rmsnorm(h, pw, 1e-6)
    assert torch.equal(s, want) and torch.equal(y, K.rmsnorm(want, w, 1e-6))
    s, y = fused.add_rmsnorm(x, w, 1e-6, h)
    assert torch.equal(s, x + h) and torch.equal(y, K.rmsnorm(x + h, w, 1e-6))
    assert torch.equal(fused.add_rmsnorm(x, w, 1e-6)[1], K.rmsnorm(x, w, 1e-6))
    assert torch.equal(fused.add_rmsnorm(x[:1], w, 1e-6, h[:1], pw)[1], fused.add_rmsnorm(x, w, 1e-6, h, pw)[1][:1])


@DTYPES
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_kv_is_the_models_rotary_and_kv_write_bit_for_bit(dtype, qk_norm):
    """q/k norm per head, rotary at each token's position and the k / v writes to (slot, column):
    the bits of TorchModel's unfused path (kernels.rmsnorm, TorchModel._rope, an indexed write)."""
    from types import SimpleNamespace

    from backend.runtime.torch_model import TorchModel
    from plugins import fused

    g = torch.Generator().manual_seed(9)
    nh, nkv, d, n = 4, 2, 32, 5
    qkv = torch.randn(n, (nh + 2 * nkv) * d, generator=g).to(DEV, dtype)
    cos, sin = (torch.randn(40, d // 2, generator=g).to(DEV) for _ in range(2))
    pos = torch.tensor([3, 17, 39, 0, 17], device=DEV)
    wslot, wcol = torch.tensor([1, 0, 2, 1, 0], device=DEV), torch.tensor([4, 9, 0, 5, 10], device=DEV)
    qn = (1 + 0.3 * torch.randn(2, d, generator=g)).to(DEV, dtype) if qk_norm else None
    kc, vc = (torch.zeros(3, nkv, 12, d, dtype=dtype, device=DEV) for _ in range(2))
    q = fused.rope_kv(qkv, pos, cos, sin, qn, 1e-6, nh, nkv, kc, vc, wslot, wcol)
    heads = qkv.view(n, nh + 2 * nkv, d)
    wq, wk = heads[:, :nh], heads[:, nh:nh + nkv]
    if qk_norm:
        wq, wk = K.rmsnorm(wq, qn[0], 1e-6), K.rmsnorm(wk, qn[1], 1e-6)
    model = SimpleNamespace(rope={False: (cos, sin)})
    kw, vw = (torch.zeros_like(kc) for _ in range(2))
    kw[wslot, :, wcol] = TorchModel._rope(model, wk, pos).to(dtype)
    vw[wslot, :, wcol] = heads[:, nh + nkv:]
    assert torch.equal(q, TorchModel._rope(model, wq, pos)) and torch.equal(kc, kw) and torch.equal(vc, vw)


@DTYPES
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gate_up_act_is_the_unfused_linear_and_activation(dtype, act):
    """act(gate) * up in the gate_up linear's epilogue: the linear's bits for gate and up, the
    activation the same float32 formula as numpy's (bit for bit in the interpreter, where the
    kernel's exp is numpy's) and within float32 rounding of torch's; each row's bits at any M."""
    from plugins import fused

    g = torch.Generator().manual_seed(10)
    k, i = 200, 96
    x = torch.randn(37, k, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * i, k, generator=g) * 0.2).to(DEV, dtype)
    y = fused.gate_up_act(x, w, act == "gelu_tanh")
    gate, up = K.linear(x, w).float().split(i, -1)
    a = (F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)).to(dtype)
    assert torch.allclose(y.float(), (a * up.to(dtype)).float(), rtol=1e-5 if dtype == torch.float32 else 2 ** -7,
                          atol=1e-6)
    if K.interpreted():
        gn = gate.cpu().numpy()
        if act == "gelu_tanh":
            z = np.float32(0.7978845608028654) * (gn + np.float32(0.044715) * gn * gn * gn)
            e = np.exp(np.float32(-2.0) * np.abs(z))
            r = (np.float32(1.0) - e) / (np.float32(1.0) + e)
            an = np.float32(0.5) * gn * (np.float32(1.0) + np.where(z < 0, -r, r))
        else:
            an = gn / (np.float32(1.0) + np.exp(-gn))
        want = torch.from_numpy(an.astype(np.float32)).to(dtype) * up.to(dtype)
        assert torch.equal(y.cpu(), want)
    for m in (1, 5):
        assert torch.equal(fused.gate_up_act(x[:m], w, act == "gelu_tanh"), y[:m])


def test_gate_up_act_of_fp8_weights_is_that_of_their_dequantized_weights():
    """W8A16: FP8 codes and 1 x 32 block scales read in the fused kernel give the bits of the
    dequantized bf16 weights (kernels.linear_w8's contract)."""
    from backend.runtime import fp8
    from plugins import fused

    g = torch.Generator().manual_seed(12)
    rec = fp8.Recipe("w8", (1, 32), "token")
    q, s = fp8.quantize_weight(torch.randn(192, 200, generator=g), rec)
    w = fp8.dequantize_weight(q, s, rec).to(torch.bfloat16)
    x = torch.randn(19, 200, generator=g).to(torch.bfloat16)
    q, s, w, x = (a.to(DEV) for a in (q, s, w, x))
    assert torch.equal(fused.gate_up_act(x, q, False, s, (1, 32)), fused.gate_up_act(x, w, False))


@DTYPES
def test_lm_head_embed_and_the_attentions_rounding_are_the_unfused_ops(dtype):
    """The LM head on gathered rows: the bits of kernels.linear on those rows in float32, its
    soft-cap within float32 rounding of torch's tanh; the scaled embedding the bits of torch's;
    the attention's output in bf16 the bits of its float32 output rounded by .to."""
    from plugins import fused

    g = torch.Generator().manual_seed(13)
    normed, wv = torch.randn(2 * 5, 64, generator=g).to(DEV, dtype), torch.randn(300, 64, generator=g).to(DEV, dtype)
    index = torch.tensor([[0, 3, 4], [2, 2, 1]], device=DEV)
    rows = normed.view(2, 5, 64)[torch.arange(2, device=DEV)[:, None], index].reshape(6, 64)
    ref = K.linear(rows, wv).float().view(2, 3, 300)
    assert torch.equal(fused.lm_head(normed, index, 5, wv), ref)
    capped = fused.lm_head(normed, index, 5, wv, 3.0)
    assert float((capped - torch.tanh(ref / 3.0) * 3.0).abs().max()) < 1e-6
    ids, scale = torch.tensor([5, 0, 299, 5], device=DEV), torch.tensor(8.0, dtype=dtype, device=DEV)
    assert torch.equal(fused.embed(wv, ids, scale), wv[ids] * scale) and torch.equal(fused.embed(wv, ids), wv[ids])
    rng = np.random.default_rng(5)
    q, kc, vc = (rng.standard_normal(s).astype(np.float32) for s in ((1, 3, 4, 16), (3, 2, 40, 16), (3, 2, 40, 16)))
    case = (t(q), t(kc), t(vc), t(np.array([2], np.int32)), t(np.array([30], np.int32)),
            t(paths_of(np.array([[-1, 0, 0]], np.int32))), 0.3)
    assert torch.equal(K.tree_attention(*case, out_dtype=torch.bfloat16), K.tree_attention(*case).to(torch.bfloat16))


# --- attention, verification and the TensorRT plugins' kernels against their references ---------------
TREES = {
    "single": [[-1]],
    "chain4": [[-1, 0, 1, 2]],
    "tree7": [[-1, 0, 0, 1, 1, 2, 3]],
    "padded": [[-1, 0, 1, 2, 3, 4], [-1, 0, 0, -2, -2, -2], [-1, -2, -2, -2, -2, -2]],
}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("hq,hkv,d,ctxs", [(4, 4, 16, (0, 31)), (4, 2, 32, (32, 5)), (6, 2, 16, (33, 70)),
                                          (8, 2, 64, (1, 64))], ids=["mha", "gqa2", "gqa3", "gqa4"])
def test_tree_attention_matches_the_reference(tree, hq, hkv, d, ctxs):
    rng = np.random.default_rng(hash((tree, hq, d)) % 2 ** 32)
    parents = np.array(TREES[tree], np.int32)
    b, tt = parents.shape
    slots = rng.permutation(5)[:b].astype(np.int32)
    ctx = np.array([ctxs[i % 2] for i in range(b)], np.int32)
    q = rng.standard_normal((b, tt, hq, d)).astype(np.float32)
    kc = rng.standard_normal((5, hkv, 96, d)).astype(np.float32)
    vc = rng.standard_normal((5, hkv, 96, d)).astype(np.float32)
    paths = paths_of(parents)
    ref = tree_attention_ref(q, kc, vc, slots, ctx, paths, d ** -0.5)
    got = attention(q, kc, vc, slots, ctx, paths, d ** -0.5)
    assert np.abs(got - ref).max() < 1e-5
    half = attention(q, kc, vc, slots, ctx, paths, d ** -0.5, torch.float16)
    ref16 = tree_attention_ref(*(x.astype(np.float16).astype(np.float32) for x in (q, kc, vc)), slots, ctx, paths, d ** -0.5)
    assert np.abs(half - ref16).max() < 1e-3


@pytest.mark.skipif(not K.interpreted(), reason="Triton's interpreter only (a GPU's MMA is row-invariant)")
@pytest.mark.parametrize("m,k,n", [(16, 64, 64), (64, 32, 64), (16, 256, 128)])
def test_the_interpreters_dot_gives_a_row_the_same_bits_at_any_position(m, k, n):
    """tl.dot in the interpreter (numpy's matmul, made row-invariant by kernels.row_invariant_interpreter:
    OpenBLAS's sgemm on an AMD EPYC gave rows 3-5, 9-11, 13-15 of 16 other bits elsewhere), in a
    kernel: each row moved to every other position among random rows keeps its bits."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K_: tl.constexpr, N: tl.constexpr):
        rm, rk, rn = tl.arange(0, M), tl.arange(0, K_), tl.arange(0, N)
        a = tl.load(a_ptr + rm[:, None] * K_ + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b, input_precision="ieee"))

    def dot(a, b):
        c = torch.empty(a.shape[0], b.shape[1])
        dot_kernel[(1,)](a, b, c, a.shape[0], a.shape[1], b.shape[1])
        return c

    assert K.interpreted()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    y = dot(a, b)
    for r in range(m):
        other = torch.randn(m, k, generator=g)
        other[(r + 5) % m] = a[r]
        assert torch.equal(dot(other, b)[(r + 5) % m], y[r]), r


def test_tree_attention_bits_do_not_depend_on_t_or_where_the_path_sits():
    """One verify over a tree equals, bit for bit, single steps along each node's path with the
    path committed in order (the columns the path occupies and the other nodes do not matter)."""
    assert_verify_equals_steps_along_paths(lambda q, k, v, slots, ctx, paths: attention(q, k, v, slots, ctx, paths, 0.2),
                                           np.random.default_rng(7), 6, 2, 32, 45)


def _verify_case(rng, v, parents, params, tie=False):
    b, tt = parents.shape
    logits = (rng.standard_normal((b, tt, v)) * 2.5).astype(np.float32)
    if tie:                                     # exact ties around the cut-offs
        logits = np.round(logits, 1)
    tokens = rng.integers(0, v, (b, tt))
    for r in range(b):                          # children that are often the target's token
        for j in range(1, tt):
            if parents[r, j] >= 0 and (r == 0 or rng.random() < 0.6):   # row 0: greedy, all
                tokens[r, j] = int(np.argmax(logits[r, parents[r, j]]))
    temp, topk, topp, minp = (np.array([p[i] for p in params]) for i in range(4))
    seeds = rng.integers(0, 2 ** 63, b, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    pos = rng.integers(0, 4000, b)
    return logits, tokens, parents, temp, topk.astype(np.int32), topp, minp, seeds, pos


PARAMS = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (0.9, 0, 0.8, 0.0),
          (1.3, 0, 1.0, 0.1), (0.8, 25, 0.9, 0.02)]


@pytest.mark.parametrize("v,tie", [(300, False), (2500, False), (333, True)], ids=["v300", "v2500", "ties"])
def test_verify_matches_backend_verify_for_the_same_noise(v, tie):
    rng = np.random.default_rng(v)
    parents = np.array([[-1, 0, 1, 2, 3, -2], [-1, 0, 0, 1, 2, 4], [-1, -2, -2, -2, -2, -2],
                        [-1, 0, 1, 1, 2, 2], [-1, 0, 0, 0, 0, 0], [-1, 0, 1, 2, 3, 4]], np.int32)
    case = _verify_case(rng, v, parents, PARAMS, tie)
    ref = verify_ref(*case)
    logits, tokens, parents, temp, topk, topp, minp, seeds, pos = case
    got = K.verify(t(logits), t(tokens), t(parents), t(temp), t(topk), t(topp), t(minp),
                   t(seeds.view(np.int64)), t(pos))
    for g, r in zip(got, ref):
        assert g.cpu().numpy().tolist() == r.tolist()
    assert ref[2].max() >= 2                     # some rows accepted a path


def test_the_plugin_kernels_match_the_references_and_the_runtime_kernels():
    """The TensorRT plugins' kernels (TensorRT's argument order, this forward's nodes read from
    k / v rather than the cache, float32 parameters, logits of R <= T rows): attention equals
    the reference after the nodes are written, bitwise equal to the runtime's kernel on the
    written cache; verification equals the reference, and stops at the last row with logits."""
    from plugins.reference import write_nodes

    rng = np.random.default_rng(4)
    q, k, v, kc, vc, slots, ctx, nprior, paths = plugin_attention_case(rng)
    b, n = paths.shape[:2]
    paths[2, 4] = -1                         # a padding node
    kw, vw = write_nodes(kc, vc, k, v, slots, ctx, nprior)
    ref = tree_attention_ref(q, kw, vw, slots, ctx, paths, 0.25)
    o = K.tree_attention_plugin(t(q), t(k), t(v), t(kc), t(vc), t(slots), t(ctx), t(nprior), t(paths), 0.25)
    assert np.abs(o.cpu().numpy() - ref).max() < 1e-5
    assert np.array_equal(o.cpu().numpy(), attention(q, kw, vw, slots, ctx, paths, 0.25))

    vocab = 3000
    logits = (3 * rng.standard_normal((b, n, vocab))).astype(np.float32)
    toks = rng.integers(0, vocab, (b, n))
    toks[:, 1] = logits[:, 0].argmax(-1)
    parents = np.array([[-1, 0, 1, 2, 3], [-1, 0, 0, 1, -2], [-1, 0, 1, -2, -2]], np.int32)
    temp, top_k = np.array([0, 0.7, 1.3], np.float32), np.array([0, 50, 0], np.int32)
    top_p, min_p = np.array([1, 0.9, 0.8], np.float32), np.array([0, 0, 0.05], np.float32)
    seeds, pos = np.array([1, 2, 3], np.int64), np.array([5, 9, 100], np.int64)
    want = verify_ref(logits, toks, parents, temp.astype(np.float64), top_k, top_p.astype(np.float64),
                      min_p.astype(np.float64), seeds.view(np.uint64), pos)
    got = K.verify_plugin(*(t(a) for a in (logits, toks, parents, temp, top_k, top_p, min_p, seeds, pos)))
    assert all(np.array_equal(w, g.cpu().numpy()) for w, g in zip(want, got))
    got = K.verify_plugin(*(t(a) for a in (logits[:, :1], toks, parents, temp, top_k, top_p, min_p, seeds, pos)))
    assert got[2].cpu().numpy().tolist() == [0, 0, 0]


def _compiles(name, plugin=False, **variant):
    """In a process of its own: this one may run the kernels in the interpreter. A plugin's
    kernel must also fit the 48 KB of shared memory a kernel gets without opting in, and take
    exactly the parameters TensorRT passes (inputs, scalars, outputs: 9 + 3 + 1 and 9 + 3 + 3;
    no hidden Triton scratch pointers)."""
    code = ("import sys; from plugins.kernels import compile_plugin; from plugins.ptx import compile_ptx\n"
            + (f"ptx, sym, shared = compile_plugin({name!r}, 90, **{variant!r})\n" if plugin else
               f"ptx, sym = compile_ptx({name!r}, 90, **{variant!r}); shared = 0\n")
            + "entry = ptx[ptx.index('.entry ' + sym):]\n"
            + "nparams = entry[:entry.index(')')].count('.param')\n"
            + f"want = {dict(tree_attention=13, rejection_sample=15).get(name, 0) if plugin else 0}\n"
            + "sys.exit(0 if '.target sm_90' in ptx and shared <= 48 * 1024 and (not want or nparams == want) else 3)")
    assert_compiles(code)
    return True


@pytest.mark.parametrize("variant", [dict(kv_dtype="fp32", head_dim=64, group=3),
                                     dict(kv_dtype="bf16", head_dim=128, group=4)], ids=["fp32-d64", "bf16-d128"])
def test_tree_attention_compiles_to_ptx_for_sm90(variant):
    assert _compiles("tree_attention", **variant)


def test_verify_compiles_to_ptx_for_sm90():
    assert _compiles("verify")


@pytest.mark.parametrize("name,kv_dtype", [("linear", "bf16"), ("linear", "fp32"), ("rmsnorm", "bf16"),
                                           ("linear_w8", "bf16")])
def test_the_invariant_linear_and_norm_compile_to_ptx_for_sm90(name, kv_dtype):
    assert _compiles(name, kv_dtype=kv_dtype)


@pytest.mark.parametrize("name", ["tree_attention", "rejection_sample"])
def test_the_plugin_kernels_compile_to_ptx_for_sm90_under_48k_shared(name):
    assert _compiles(name, plugin=True)


@pytest.mark.parametrize("name", ["add_rmsnorm", "rope_kv", "gate_up_act", "gate_up_act_w8", "lm_head", "embed"])
def test_the_fused_kernels_compile_to_ptx_for_sm90(name):
    assert _compiles(name, kv_dtype="bf16")
