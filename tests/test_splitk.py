"""The invariant small-M GEMM (issue 41, point 3), in Triton's interpreter on a CPU: the plan of a
linear (tiles, warps, K splits) is a function of the weight's shape and the GPU's SM count only;
a row's bits at M = 1 are those of the same row at M = 16 and M = 64, bf16 and W8A16, for plans
with and without split-K; split 1 is linear_kernel as it launched before the plan; the results
match a float64 numpy reference; the split kernels compile to sm_90 PTX."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from conftest import assert_compiles  # noqa: E402
from plugins import fused  # noqa: E402
from plugins import kernels as K  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K, SMs) -> the split the plan gives: split 1 (ragged N and K), split 2 at the default SMs,
# split 4 with a ragged last range (K 2600 = 3 x 768 + 296) at the default SMs
SHAPES = {"split1": (150, 200, None, 1), "split2": (96, 1024, None, 2), "split4": (150, 2600, None, 4),
          "split8-few-sms": (64, 4096, 8, 8)}


def test_the_plan_is_a_function_of_n_k_and_the_sms_only():
    assert list(inspect.signature(K.linear_plan).parameters) == ["n", "k", "sms"]
    llama8b = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
    plans = {name: K.linear_plan(n, k) for name, (n, k) in llama8b.items()}
    assert {name: p.split_k for name, p in plans.items()} == {"qkv": 1, "o": 4, "down": 4, "lm_head": 1}
    assert plans["qkv"] == K.LinearPlan(K.linear_block_n(6144), K.LINEAR_BLOCK_K, 4, 1)   # linear_kernel's tiles
    assert plans["o"] == K.LinearPlan(32, K.SPLIT_BLOCK_K, 4, 4)
    assert K.linear_plan(960, 576).split_k == 1           # SmolLM2-135M's qkv: too little K to split
    assert K.linear_plan(4096, 4096, sms=64).split_k == 1  # 128 column tiles fill 64 SMs
    assert K.linear_plan(4096, 4096, sms=200).split_k == 4
    for n, k, sms, split in SHAPES.values():
        plan = K.linear_plan(n, k, sms or K.DEFAULT_SMS)
        assert plan.split_k == split and plan == K.linear_plan(n, k, sms or K.DEFAULT_SMS)
        if split > 1:                                     # every split has K to sum
            assert (split - 1) * K.split_range(k, split) < k <= split * K.split_range(k, split)
    assert K.sm_count(torch.device("cpu")) == K.DEFAULT_SMS


def _launches(monkeypatch, fn) -> list:
    """The (kernel name, grid, constexpr keywords) of each launch `fn` makes, the kernels not run
    (what they compute at these shapes: test_a_rows_bits_at_m1_are_those_of_the_same_row_at_m16_and_m64)."""
    seen = []

    def record(kernel, grid, *args, **kwargs):
        seen.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, grid, kwargs))

    monkeypatch.setattr(K, "launch", record)
    fn()
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_launches_compile_time_choices_do_not_depend_on_m(shape, monkeypatch):
    """Every constexpr and the grid's column and split dimensions are the same at M = 1 and
    M = 64; only the row blocks (and the reduction's rows) grow."""
    n, k, sms, split = SHAPES[shape]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g).to(DEV, torch.bfloat16)
    x = torch.randn(64, k, generator=g).to(DEV, torch.bfloat16)
    one = _launches(monkeypatch, lambda: K.linear(x[:1], w, sms=sms))
    many = _launches(monkeypatch, lambda: K.linear(x, w, sms=sms))
    assert [(name, kw) for name, _, kw in one] == [(name, kw) for name, _, kw in many]
    assert [name for name, _, _ in one] == (["linear_kernel"] if split == 1 else
                                            ["linear_split_kernel", "split_reduce_kernel"])
    assert one[0][1][1:] == many[0][1][1:] and many[0][1][0] == 4 * one[0][1][0]
    if split > 1:
        assert one[0][1][2] == split and one[1][2]["SPLIT"] == split


def _w8(n, k, block, g):
    """FP8 codes, block scales and the bf16 weights they stand for (runtime/fp8.py's)."""
    from backend.runtime import fp8

    rec = fp8.Recipe("w8", block, "token")
    q, s = fp8.quantize_weight(torch.randn(n, k, generator=g) * torch.linspace(0.1, 4, k), rec)
    return q, s, fp8.dequantize_weight(q, s, rec).to(torch.bfloat16)


def _rows_are_the_same_bits_at_every_m(run, x):
    """run(x rows) -> (y64, y16): rows of M = 1 (where a row sits first in its tile) against the
    same rows of M = 16 at tile positions 5 and 15 and of M = 64 at 8 (the third row block) and 15
    (the last), and M = 16 against M = 64's first rows."""
    y64, y16 = run(x), run(x[:16])
    for j in (5, 15):
        assert torch.equal(run(x[j:j + 1]), y16[j:j + 1]), j
    for j in (40, 63):
        assert torch.equal(run(x[j:j + 1]), y64[j:j + 1]), j
    assert torch.equal(y16, y64[:16])
    return y64, y16


# bf16 at every plan; W8A16 (the same plan, kernels.linear_w8's loads of codes and 128 x 128
# scales in the split and unsplit kernels) at split 1 and at split 4, whose ragged last range is
# the one W8 case split 2 and 8 do not have (split 8 differs only in the SMs given: bf16's case)
ROWS_CASES = [(shape, "bf16") for shape in SHAPES] + [("split1", "w8a16"), ("split4", "w8a16")]


@pytest.mark.parametrize("shape,weights", ROWS_CASES, ids=[f"{w}-{s}" for s, w in ROWS_CASES])
def test_a_rows_bits_at_m1_are_those_of_the_same_row_at_m16_and_m64(shape, weights):
    n, k, sms, split = SHAPES[shape]
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    x = torch.randn(64, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    if weights == "bf16":
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        q = s = None
    else:
        q, s, w = _w8(n, k, (128, 128), g)
        q, s = q.to(DEV), s.to(DEV)
    x, b, w = x.to(DEV), b.to(DEV), w.to(DEV)
    if weights == "bf16":
        run = lambda rows: K.linear(rows, w, b, sms=sms)
    else:
        run = lambda rows: K.linear_w8(rows, q, s, (128, 128), b, sms=sms)
    y, y16 = _rows_are_the_same_bits_at_every_m(run, x)
    ref = x.double().cpu().numpy() @ w.double().cpu().numpy().T + b.double().cpu().numpy()
    assert y.dtype == torch.bfloat16 and np.abs(y.double().cpu().numpy() - ref).max() / np.abs(ref).max() < 3e-2
    # the rows are independent of M (above), so the next two hold at M = 16 for every M
    x16 = x[:16]
    if weights == "w8a16":                                 # the W8 kernels are the bf16 ones on those weights
        assert torch.equal(y16, K.linear(x16, w, b, sms=sms))
    parts = (K.linear(x16, w, b, reduce=False, sms=sms) if weights == "bf16"
             else K.linear_w8(x16, q, s, (128, 128), b, reduce=False, sms=sms))
    if split == 1:
        assert torch.equal(parts, y16)
    else:
        assert isinstance(parts, K.Partials) and parts.p.shape == (split, 16, n) and torch.equal(K.split_reduce(parts), y16)


def test_float32_split_k_matches_the_reference_within_float32_rounding():
    """float32's split kernel (IEEE dots) at split 2; the ragged last range: bf16's split 4."""
    n, k, sms, split = SHAPES["split2"]
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(n, k, generator=g).to(DEV), torch.randn(64, k, generator=g).to(DEV)
    y, _ = _rows_are_the_same_bits_at_every_m(lambda rows: K.linear(rows, w), x)
    ref = x.double().cpu().numpy() @ w.double().cpu().numpy().T
    assert np.abs(y.cpu().numpy() - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_1_is_linear_kernel_as_it_launched_before_the_plan(dtype):
    """The plan's split-1 launch (explicit num_warps=4) against linear_kernel launched with the
    tiles it had before (linear_block_n, LINEAR_BLOCK_K, the default warps), bias and none."""
    import triton

    g = torch.Generator().manual_seed(2)
    n, k = 150, 200
    w, x, b = (torch.randn(*s, generator=g).to(DEV, dtype) for s in ((n, k), (37, k), (n,)))
    for bias in (b, None):
        y = torch.empty((37, n), dtype=dtype, device=DEV)
        bn = K.linear_block_n(n)
        K.linear_kernel[(triton.cdiv(37, K.LINEAR_BLOCK_M), triton.cdiv(n, bn))](
            x, w, bias if bias is not None else w, y, 37, n, k, x.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, IEEE=dtype == torch.float32 or K.interpreted(), BLOCK_M=K.LINEAR_BLOCK_M,
            BLOCK_N=bn, BLOCK_K=64)
        assert torch.equal(K.linear(x, w, bias), y)


@pytest.mark.parametrize("post", [False, True], ids=["plain", "post-norm"])
def test_add_rmsnorm_reduces_a_split_linears_partials_with_the_reductions_bits(post):
    """fused.add_rmsnorm given a split linear's Partials (the o / down linears of the fused step):
    the bits of the split reduction's output added, at every M."""
    n, k, _, split = SHAPES["split2"]
    g = torch.Generator().manual_seed(4)
    w, o, x, b = (torch.randn(*s, generator=g).to(DEV, torch.bfloat16) for s in ((n, k), (64, k), (64, n), (n,)))
    nw, pw = ((1 + 0.1 * torch.randn(n, generator=g)).to(DEV, torch.bfloat16) for _ in range(2))
    pw = pw if post else None
    full = None
    for m in (64, 16, 1):
        parts = K.linear(o[:m], w, b, reduce=False)
        assert isinstance(parts, K.Partials) and parts.p.shape[0] == split
        got = fused.add_rmsnorm(x[:m], nw, 1e-6, parts, pw)
        want = fused.add_rmsnorm(x[:m], nw, 1e-6, K.split_reduce(parts), pw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        full = got[1] if full is None else full                  # M = 64's, computed first
        assert torch.equal(got[1], full[:m])


@pytest.mark.parametrize("bias,qk_norm", [(True, False), (False, True)], ids=["bias", "qk-norm"])
def test_rope_kv_reduces_a_split_qkv_linears_partials_with_the_reductions_bits(bias, qk_norm):
    """fused.rope_kv given the qkv linear's Partials: q, k and v (rotary, q/k norm, the cache
    writes) the bits of rope_kv on the split reduction's output."""
    g = torch.Generator().manual_seed(8)
    nh, nkv, d, n, k = 4, 2, 32, 5, 1024                  # W = 256: 8 column tiles, split 2
    w, x = (torch.randn(*s, generator=g).to(DEV, torch.bfloat16) for s in (((nh + 2 * nkv) * d, k), (n, k)))
    b = torch.randn((nh + 2 * nkv) * d, generator=g).to(DEV, torch.bfloat16) if bias else None
    cos, sin = (torch.randn(40, d // 2, generator=g).to(DEV) for _ in range(2))
    pos = torch.tensor([3, 17, 39, 0, 17], device=DEV)
    wslot, wcol = torch.tensor([1, 0, 2, 1, 0], device=DEV), torch.tensor([4, 9, 0, 5, 10], device=DEV)
    qn = (1 + 0.3 * torch.randn(2, d, generator=g)).to(DEV, torch.bfloat16) if qk_norm else None
    parts = K.linear(x, w, b, reduce=False)
    assert isinstance(parts, K.Partials) and parts.p.shape == (2, n, (nh + 2 * nkv) * d)
    outs = []
    for qkv in (parts, K.split_reduce(parts)):
        kc, vc = (torch.zeros(3, nkv, 12, d, dtype=torch.bfloat16, device=DEV) for _ in range(2))
        outs.append((fused.rope_kv(qkv, pos, cos, sin, qn, 1e-6, nh, nkv, kc, vc, wslot, wcol), kc, vc))
    assert all(torch.equal(a, b) for a, b in zip(*outs)) and outs[0][1].abs().sum() > 0


@pytest.mark.parametrize("name,variant", [("linear_split", dict(kv_dtype="bf16")),
                                          ("linear_split", dict(kv_dtype="bf16", w_fp8=True)),
                                          ("split_reduce", dict(kv_dtype="bf16")),
                                          ("add_rmsnorm_split", dict(kv_dtype="bf16")),
                                          ("rope_kv_split", dict(kv_dtype="bf16"))],
                         ids=["bf16", "w8a16", "reduce", "add_rmsnorm", "rope_kv"])
def test_the_split_kernels_compile_to_ptx_for_sm90(name, variant):
    assert_compiles("import sys; from plugins.ptx import compile_ptx\n"
                    f"ptx, sym = compile_ptx({name!r}, 90, **{variant!r})\n"
                    "sys.exit(0 if '.target sm_90' in ptx and ('.entry ' + sym) in ptx else 3)")
