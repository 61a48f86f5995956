"""Triton-language kernels of the ops in plugins/reference.py (contracts there), and launchers
that take torch tensors. Compiled on a GPU; on a CPU they run in Triton's interpreter
(TRITON_INTERPRET=1, set before this module is imported; `interpreted()` says which).

tree_attention: one program per (row, node, KV head). The node's GQA query heads (padded to 16
rows, the smallest tl.dot) read its own key sequence, the committed columns and then its path
by depth, gathered from the slot cache in blocks of BLOCK_N aligned at column 0; online softmax
in float32 with IEEE dots. The sums for a node depend only on that sequence, never on T, the
batch, or where other nodes' columns sit. A sliding window (a layer's, 0: none) masks the
sequence entries below n - window (n the sequence's length: the node is at position n - 1) and
starts the loop at the aligned block that holds the first visible one (a block of masked keys
only would make the online softmax's running max -inf and its rescale NaN); the blocks are
still aligned at column 0, so the window keeps the sums a function of the node's sequence.
An attention-logit soft-cap (Gemma-2; 0: none) bends each score, cap tanh(score / cap), before
the mask: tanh from exp(-2|x|) (no overflow), per element, so it keeps that too.

verify: one program per row walks its tree: at each node the target's token (argmax; or, sampled,
argmax of p / E over the kept set, E the Philox noise of the node's output position, made here
from the row's seed), then the child that carries it. The kept set of top-k / top-p is found by a
bitwise search over the logit values (32 passes each, no sort), min-p by its ratio; scores are
float64 like the reference.

linear and rmsnorm (the GPU runtime's batch-invariant mode, runtime/torch_model.py): y = x W^T
(+ b) in tiles of a fixed shape (BLOCK_M x BLOCK_N, the K loop in BLOCK_K steps from 0, float32
accumulation), chosen with the K splits by linear_plan from N, K and the GPU's SM count, never
from M (split-K: float32 partials per K range, added in the order 0, 1, ... by split_reduce or
by the fused kernel that reads them), and RMSNorm by one program per row. A row's result is then the same bits at any number of rows, which
cuBLAS does not promise (it picks a GEMM by M: measured on an H200, the CUDA graphs' padded
buckets differed from eager by 0.75 in bf16; the 28 once quoted for a verify was the GPU check's
own defect, two different prompts).

Each op has two kernels over one program body: the GPU runtime's (`*_kernel`: strided views,
float64 sampling parameters, the forward's nodes already in the cache) and the TensorRT
plugin's (`*_plugin_kernel`, plugins/trt_plugins.py: arguments in TensorRT's order of inputs,
scalars, outputs; contiguous tensors; float32 parameters; this forward's nodes read from the
new k / v, since a plugin must not write its inputs). The same values are summed in the same
order either way.
Knows: tensors, kernels. Does not know: requests, models.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # Triton 3.9's default, stated
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_N = 32            # keys per step of tree attention
BLOCK_V = 1024          # vocabulary entries per step of verify
PHILOX_ROUNDS = 10
PLUGIN_BLOCK_P = 32     # path entries per step of the plugin's path-length count
PLUGIN_MAX_NODES = 64   # the plugin verifies trees of up to this many nodes (engine_graph.py)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _row_invariant_matmul(a, b, dtype=None, **kw):
    """numpy's matmul by einsum's own loops (no BLAS): every row of the result computed by the
    same sequence of operations whatever its position among the rows."""
    import numpy as np

    return np.einsum("...mk,...kn->...mn", a, b, dtype=dtype, **kw)


def row_invariant_interpreter() -> bool:
    """In Triton's interpreter (the CPU's stand-in for the GPU) tl.dot is numpy's matmul, and some
    CPUs' BLAS gives a row other bits at another position among the rows (OpenBLAS's
    Haswell/Zen sgemm, measured on an AMD EPYC: rows 3-5, 9-11, 13-15 of 16), which a GPU's
    MMA never does and every tile's result here relies on (a padded row sits elsewhere in its
    tile). So the interpreter's numpy gets a matmul of fixed per-row order (einsum, ~2x numpy's
    BLAS on a 16 x 64 x 64 tile). Applied once, where the interpreter runs; True if applied."""
    if not interpreted():
        return False
    import types

    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter.np, "matmul", None) is _row_invariant_matmul:
        return True
    proxy = types.ModuleType("numpy")
    proxy.__dict__.update(np.__dict__)
    proxy.matmul = _row_invariant_matmul
    interpreter.np = proxy
    return True


row_invariant_interpreter()


def launch(kernel, grid, *args, **kwargs) -> None:
    """Every launcher's one launch (tests/test_gpu_launches.py counts the launches of a step
    by wrapping it)."""
    kernel[grid](*args, **kwargs)


@triton.jit
def _tanh(x):
    """tanh(x) = sign(x) (1 - t) / (1 + t), t = exp(-2|x|) (the native kernel's tanh8)."""
    t = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def _round_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), as float32: torch's rounding, done
    in integer bits (the interpreter's float32 -> bf16 cast truncates; finite inputs only)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """float32 x as torch rounds it to DT (bf16: to nearest even, on a GPU and in the
    interpreter alike), held in float32; a float32 DT leaves it."""
    if DT == tl.bfloat16:
        return _round_bf16(x)
    return x


@triton.jit
def _tree_attention_program(q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, o_ptr, slots_ptr, ctx_ptr, nprior_ptr,
                            paths_ptr, scale, window, softcap, T, P, sq_b, sq_t, sq_h, sk_s, sk_h, sk_l, sn_b, sn_t,
                            sn_h, so_b, so_t, so_h, sp_b, sp_t, G: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, NEW: tl.constexpr):
    """One (row, node, KV head). NEW: this forward's nodes (scratch index >= n_prior) are read
    from kn/vn [B, T, Hkv, D] rather than the cache (the plugin: TensorRT's inputs are read-only,
    the runtime writes them to the cache after the step); the same values in the same order.
    window: the layer's sliding window (0: none), softcap: the scores' soft-cap (0: none); each
    a scalar or a constexpr."""
    pid = tl.program_id(0)
    hkv = tl.program_id(1)
    b = pid // T
    j = pid % T
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ctx = tl.load(ctx_ptr + b)
    npath = tl.zeros([], tl.int32)
    for p0 in range(0, P, BLOCK_P):
        pi = p0 + tl.arange(0, BLOCK_P)
        prow = tl.load(paths_ptr + b * sp_b + j * sp_t + pi, mask=pi < P, other=-1)
        npath += tl.sum((prow >= 0).to(tl.int32), 0)
    n = ctx + npath                                         # the node's own key sequence
    lo = tl.zeros([], tl.int32)                             # its first visible entry
    if window > 0:
        lo = tl.maximum(n - window, 0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    head = hkv * G + g
    q = tl.load(q_ptr + b * sq_b + j * sq_t + head[:, None] * sq_h + d[None, :],
                mask=g[:, None] < G, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    kv_base = slot * sk_s + hkv * sk_h
    for start in range((lo // BLOCK_N) * BLOCK_N, n, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        valid = (c < n) & (c >= lo)
        in_ctx = c < ctx
        scratch = tl.load(paths_ptr + b * sp_b + j * sp_t + (c - ctx),
                          mask=valid & (c >= ctx), other=0)
        col = tl.where(in_ctx, c, ctx + scratch).to(tl.int64)
        if NEW:
            nprior = tl.load(nprior_ptr + b)
            fresh = valid & (c >= ctx) & (scratch >= nprior)
            old = valid & (~fresh)
            at = b.to(tl.int64) * sn_b + (scratch - nprior).to(tl.int64)[:, None] * sn_t + hkv * sn_h + d[None, :]
            k = tl.where(fresh[:, None], tl.load(kn_ptr + at, mask=fresh[:, None], other=0.0).to(tl.float32),
                         tl.load(k_ptr + kv_base + col[:, None] * sk_l + d[None, :], mask=old[:, None],
                                 other=0.0).to(tl.float32))
            v = tl.where(fresh[:, None], tl.load(vn_ptr + at, mask=fresh[:, None], other=0.0).to(tl.float32),
                         tl.load(v_ptr + kv_base + col[:, None] * sk_l + d[None, :], mask=old[:, None],
                                 other=0.0).to(tl.float32))
        else:
            k = tl.load(k_ptr + kv_base + col[:, None] * sk_l + d[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_base + col[:, None] * sk_l + d[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if softcap > 0:
            s = softcap * _tanh(s / softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    o = _rounded(acc / tl.where(l > 0, l, 1.0)[:, None], o_ptr.dtype.element_ty)   # padding sees nothing: 0
    tl.store(o_ptr + b * so_b + j * so_t + head[:, None] * so_h + d[None, :], o, mask=g[:, None] < G)


@triton.jit
def tree_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, ctx_ptr, paths_ptr, scale,
                          window, softcap, T, P,
                          sq_b, sq_t, sq_h, sk_s, sk_h, sk_l, so_b, so_t, so_h, sp_b, sp_t,
                          G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_N: tl.constexpr, D: tl.constexpr):
    """The GPU runtime's: the forward's nodes are in the cache already; window, softcap scalars."""
    _tree_attention_program(q_ptr, k_ptr, v_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, ctx_ptr, ctx_ptr, paths_ptr,
                            scale, window, softcap, T, P, sq_b, sq_t, sq_h, sk_s, sk_h, sk_l, 0, 0, 0, so_b, so_t, so_h,
                            sp_b, sp_t, G, BLOCK_G, BLOCK_P, BLOCK_N, D, False)


@triton.jit
def tree_attention_plugin_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, ctx_ptr, nprior_ptr, paths_ptr,
                                 T, P, L, o_ptr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                                 BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                                 SCALE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """The TensorRT plugin's (plugins/trt_plugins.py): inputs, scalars, output, as TensorRT
    passes them; contiguous tensors, strides from the shapes; scale, window and soft-cap
    compiled in."""
    hq = HKV * G
    _tree_attention_program(q_ptr, kc_ptr, vc_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, ctx_ptr, nprior_ptr, paths_ptr,
                            SCALE, WINDOW, SOFTCAP, T, P, T * hq * D, hq * D, D, HKV * L * D, L * D, D, T * HKV * D,
                            HKV * D, D, T * hq * D, hq * D, D, T * P, P, G, BLOCK_G, BLOCK_P, BLOCK_N, D, True)


@triton.jit
def _philox_word(seed_lo, seed_hi, c0, c1, lane):
    """Word `lane` (0-3) of Philox4x32-10 of counters (c0, c1, 0, 0), key (seed_lo, seed_hi)."""
    x0 = c0
    x1 = c1
    x2 = tl.zeros_like(c0)
    x3 = tl.zeros_like(c0)
    k0 = seed_lo
    k1 = seed_hi
    for _ in tl.static_range(10):
        a0 = x0
        a2 = x2
        x0 = tl.umulhi(a2, tl.full(a2.shape, 0xCD9E8D57, tl.uint32)) ^ x1 ^ k0
        x2 = tl.umulhi(a0, tl.full(a0.shape, 0xD2511F53, tl.uint32)) ^ x3 ^ k1
        x1 = a2 * tl.full(a2.shape, 0xCD9E8D57, tl.uint32)
        x3 = a0 * tl.full(a0.shape, 0xD2511F53, tl.uint32)
        k0 = k0 + tl.full(k0.shape, 0x9E3779B9, tl.uint32)
        k1 = k1 + tl.full(k1.shape, 0xBB67AE85, tl.uint32)
    return tl.where(lane == 0, x0, tl.where(lane == 1, x1, tl.where(lane == 2, x2, x3)))


@triton.jit
def _key(x):
    """float32 -> uint32 whose unsigned order is the float order."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def _search(row_ptr, V, kept_key, zmax, inv_t, target, BY_MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The largest key k with (count | exp-mass) of {key >= k, key >= kept_key} >= target."""
    prefix = tl.zeros([], tl.uint32)
    for bit in tl.static_range(32):
        cand = prefix | (tl.full([], 1, tl.uint32) << (31 - bit))
        total = tl.zeros([], tl.float64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
            k = _key(x)
            hit = (offs < V) & (k >= cand) & (k >= kept_key)
            if BY_MASS:
                w = tl.exp((x.to(tl.float64) - zmax) * inv_t)
                total += tl.sum(tl.where(hit, w, 0.0), 0)
            else:
                total += tl.sum(hit.to(tl.float64), 0)
        prefix = tl.where(total >= target, cand, prefix)
    return prefix


@triton.jit
def _target_token(row_ptr, V, temperature, top_k, top_p, min_p, seed_lo, seed_hi, position,
                  BLOCK_V: tl.constexpr):
    """sampling.target_token of one row of logits with the noise of `position`."""
    best = tl.full([], float("-inf"), tl.float32)
    arg = tl.zeros([], tl.int32)
    for v0 in range(0, V, BLOCK_V):                          # argmax, first index on ties
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        bm = tl.max(x, 0)
        bi = tl.min(tl.where(x == bm, offs, 2147483647), 0)
        take = bm > best
        arg = tl.where(take, bi, arg)
        best = tl.where(take, bm, best)
    if temperature > 0.0:
        zmax = best.to(tl.float64)
        inv_t = 1.0 / temperature
        kept = tl.zeros([], tl.uint32)
        if (top_k > 0) & (top_k < V):
            kept = _search(row_ptr, V, kept, zmax, inv_t, top_k.to(tl.float64), False, BLOCK_V)
        if top_p < 1.0:
            mass = tl.zeros([], tl.float64)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
                hit = (offs < V) & (_key(x) >= kept)
                mass += tl.sum(tl.where(hit, tl.exp((x.to(tl.float64) - zmax) * inv_t), 0.0), 0)
            kept = _search(row_ptr, V, kept, zmax, inv_t, top_p * mass, True, BLOCK_V)
        best_score = tl.full([], float("-inf"), tl.float64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
            w = tl.exp((x.to(tl.float64) - zmax) * inv_t)
            ok = (offs < V) & (_key(x) >= kept) & (w >= min_p)
            word = _philox_word(seed_lo, seed_hi, (offs // 4).to(tl.uint32),
                                tl.zeros_like(offs).to(tl.uint32) + position.to(tl.uint32), offs % 4)
            e = -tl.log((word.to(tl.float64) + 0.5) * 2.3283064365386963e-10)
            score = tl.where(ok, w / e, float("-inf"))
            bm = tl.max(score, 0)
            bi = tl.min(tl.where(score == bm, offs, 2147483647), 0)
            take = bm > best_score
            arg = tl.where(take, bi, arg)
            best_score = tl.where(take, bm, best_score)
    return arg


@triton.jit
def _verify_program(logits_ptr, tokens_ptr, parents_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seeds_ptr,
                    pos_ptr, nodes_ptr, out_ptr, num_ptr, T, R, V, sl_b, sl_t,
                    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row: the walk stops at a node without logits (R rows) or past BLOCK_T nodes; the
    outputs are kept in registers and stored once, -1 padded."""
    b = tl.program_id(0)
    temperature = tl.load(temp_ptr + b).to(tl.float64)
    top_k = tl.load(topk_ptr + b)
    top_p = tl.load(topp_ptr + b).to(tl.float64)
    min_p = tl.load(minp_ptr + b).to(tl.float64)
    seed = tl.load(seeds_ptr + b)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    position = tl.load(pos_ptr + b)
    tj = tl.arange(0, BLOCK_T)
    toks = tl.load(tokens_ptr + b * T + tj, mask=tj < T, other=-1)
    pars = tl.load(parents_ptr + b * T + tj, mask=tj < T, other=-3)
    acc_nodes = tl.full([BLOCK_T], -1, tl.int32)
    acc_out = tl.full([BLOCK_T], -1, tl.int64)
    node = tl.zeros([], tl.int32)
    depth = tl.zeros([], tl.int32)
    going = tl.full([], 1, tl.int32)
    while going == 1:
        y = _target_token(logits_ptr + b.to(tl.int64) * sl_b + node.to(tl.int64) * sl_t, V,
                          temperature, top_k, top_p, min_p, seed_lo, seed_hi, position + depth, BLOCK_V)
        acc_nodes = tl.where(tj == depth, node, acc_nodes)
        acc_out = tl.where(tj == depth, y.to(tl.int64), acc_out)
        child = tl.min(tl.where((pars == node) & (toks == y.to(tl.int64)), tj, BLOCK_T), 0)
        if (child < T) & (child < R):
            node = child
            depth += 1
        else:
            going = 0
    tl.store(nodes_ptr + b * T + tj, acc_nodes, mask=tj < T)
    tl.store(out_ptr + b * T + tj, acc_out, mask=tj < T)
    tl.store(num_ptr + b, depth)


@triton.jit
def verify_kernel(logits_ptr, tokens_ptr, parents_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,
                  seeds_ptr, pos_ptr, nodes_ptr, out_ptr, num_ptr, T, V,
                  sl_b, sl_t, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """The GPU runtime's: float64 parameters, logits of every node (a strided view)."""
    _verify_program(logits_ptr, tokens_ptr, parents_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seeds_ptr,
                    pos_ptr, nodes_ptr, out_ptr, num_ptr, T, T, V, sl_b, sl_t, BLOCK_T, BLOCK_V)


@triton.jit
def verify_plugin_kernel(logits_ptr, tokens_ptr, parents_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seeds_ptr,
                         pos_ptr, T, R, V, nodes_ptr, out_ptr, num_ptr,
                         BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """The TensorRT plugin's: inputs, scalars, outputs; float32 parameters, logits [B, R, V]."""
    _verify_program(logits_ptr, tokens_ptr, parents_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seeds_ptr,
                    pos_ptr, nodes_ptr, out_ptr, num_ptr, T, R, V, R * V, V, BLOCK_T, BLOCK_V)


@triton.jit
def _tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A linear program's rows, columns, K offsets and float32 accumulator."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, tl.arange(0, BLOCK_K), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _load_rows(x_ptr, rm, kk, sxm, M, K):
    """x's [rows, K offsets] tile, zeros out of bounds."""
    return tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a b: IEEE float32 dots (float32 inputs; bf16 ones in the interpreter, whose bf16 dot
    is wrong), else bf16 tensor-core dots."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


@triton.jit
def _store_rows(acc, b_ptr, y_ptr, rm, rn, M, N, sym, HAS_BIAS: tl.constexpr):
    """The linears' epilogue: + bias, rounded to y's dtype, stored where in bounds."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[M, N] = x[M, K] w[N, K]^T (+ b): one program per (BLOCK_M rows, BLOCK_N columns); the
    same tiles and K order for a row whatever M is (M not specialized on)."""
    rm, rn, rk, acc = _tile(BLOCK_M, BLOCK_N, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = _load_rows(x_ptr, rm, kk, sxm, M, K)
        b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = _dot(a, b, acc, IEEE)
    _store_rows(acc, b_ptr, y_ptr, rm, rn, M, N, sym, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def linear_w8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, ssn, sym, SR, SC,
                     HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """linear_kernel with FP8 E4M3 weights (weight-only, W8A16): w[N, K] float8 and its block
    scales s[ceil(N / SR), ceil(K / SC)] (float32); each weight tile is dequantized in float32,
    rounded to bf16 (the values the emulated path's bf16 weights hold) and multiplied as
    linear_kernel does, so a row's bits are linear_kernel's on those weights: the weights cross
    memory as one byte each."""
    rm, rn, rk, acc = _tile(BLOCK_M, BLOCK_N, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = _load_rows(x_ptr, rm, kk, sxm, M, K)
        wmask = (rn[None, :] < N) & (kk[:, None] < K)
        q = tl.load(w_ptr + rn[None, :] * swn + kk[:, None], mask=wmask, other=0.0)
        sc = tl.load(s_ptr + (rn[None, :] // SR) * ssn + kk[:, None] // SC, mask=wmask, other=0.0)
        acc = _dot(a, _round_bf16(q.to(tl.float32) * sc), acc, IEEE)     # bf16 values, held in float32
    _store_rows(acc, b_ptr, y_ptr, rm, rn, M, N, sym, HAS_BIAS)


@triton.jit
def _w_tile(w_ptr, s_ptr, rows, ok, kk, K, swn, ssn, SR, SC, W8: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of weight rows `rows` (valid where ok): bf16 / float32 values,
    or (W8) FP8 codes times their block scales rounded to bf16 (linear_w8_kernel's)."""
    mask = ok[None, :] & (kk[:, None] < K)
    w = tl.load(w_ptr + rows[None, :] * swn + kk[:, None], mask=mask, other=0.0)
    if W8:
        sc = tl.load(s_ptr + (rows[None, :] // SR) * ssn + kk[:, None] // SC, mask=mask, other=0.0)
        w = _round_bf16(w.to(tl.float32) * sc)
    return w


@triton.jit(do_not_specialize=["M"])
def linear_split_kernel(x_ptr, w_ptr, s_ptr, p_ptr, M, N, K, KS, sxm, swn, ssn, SR, SC, W8: tl.constexpr,
                        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Split-K: program (row block, column block, split s) sums K from s KS to min((s + 1) KS, K)
    in BLOCK_K steps (KS a multiple of BLOCK_K) into the float32 partials p[s, M, N]; bf16 or
    (W8) FP8 weights as linear_kernel / linear_w8_kernel read them. What a row's partial holds
    depends on K, KS and the tiles only, never on M."""
    rm, rn, rk, acc = _tile(BLOCK_M, BLOCK_N, BLOCK_K)
    s = tl.program_id(2)
    for k0 in range(s * KS, tl.minimum(s * KS + KS, K), BLOCK_K):
        kk = k0 + rk
        a = _load_rows(x_ptr, rm, kk, sxm, M, K)
        acc = _dot(a, _w_tile(w_ptr, s_ptr, rn, rn < N, kk, K, swn, ssn, SR, SC, W8), acc, IEEE)
    at = (s * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(p_ptr + at, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _split_sum(p_ptr, b_ptr, r, c, M, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Row r's columns c of a split linear: its partials added in the order 0, 1, ..., SPLIT - 1,
    then the bias (float32, before the output's rounding, as _store_rows adds it)."""
    ok = c < N
    acc = tl.load(p_ptr + r.to(tl.int64) * N + c, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + (s * M + r).to(tl.int64) * N + c, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["M"])
def split_reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, sym, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (row r, column block): y[r] = the partials' sum in a fixed order (+ b), rounded
    to y's dtype as linear_kernel's epilogue rounds it."""
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = _split_sum(p_ptr, b_ptr, r, c, M, N, SPLIT, HAS_BIAS)
    tl.store(y_ptr + r.to(tl.int64) * sym + c, acc.to(y_ptr.dtype.element_ty), mask=c < N)


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, y_ptr, H, sx, sy, eps, BLOCK: tl.constexpr):
    """One row: x / sqrt(mean(x^2) + eps) in float32, rounded to the output dtype, times w
    (runtime/torch_model.py TorchModel._rmsnorm's numbers)."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * sx + c, mask=c < H, other=0.0).to(tl.float32)
    out = _rms_row(x, w_ptr, c, H, eps, y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * sy + c, out.to(y_ptr.dtype.element_ty), mask=c < H)


@triton.jit
def _rms_row(x, w_ptr, c, H, eps, DT: tl.constexpr):
    """RMSNorm of the float32 row x (entries c < H; zeros past H) times w, as float32 before the
    store's rounding to DT (rmsnorm_kernel's numbers; plugins/fused.py's fused norms share them)."""
    return _rms_apply(x, _rms(x, H, eps), w_ptr, c, H, DT)


@triton.jit
def _rms(x, H, eps):
    """sqrt(mean(x^2) + eps) of the float32 row x (zeros past H)."""
    return tl.sqrt(tl.sum(x * x, 0) / H + eps)


@triton.jit
def _rms_apply(x, rms, w_ptr, c, H, DT: tl.constexpr):
    """x / rms rounded to DT, times w[c] (float32)."""
    w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
    return (x / rms).to(DT).to(tl.float32) * w


LINEAR_BLOCK_M, LINEAR_BLOCK_K = 16, 64
DEFAULT_SMS = 132       # an H100 / H200 SXM's SMs: the plan's count where no GPU is (CPU, interpreter, tests)
SPLIT_BLOCK_K = 128     # K per step of a split program (its K range is a whole number of them)
SPLIT_MIN_K = 512       # K per split at least this: a shorter stream is not worth the partials' round trip
SPLIT_MAX = 16
REDUCE_BLOCK = 1024     # columns per program of the split reduction


class LinearPlan(NamedTuple):
    """How a linear runs: columns and K per program step, warps, and K splits (1: linear_kernel)."""
    block_n: int
    block_k: int
    num_warps: int
    split_k: int


def linear_block_n(n: int) -> int:
    """Columns per program, from the weight's shape only (so never from M): 64, or 32 where
    64 would leave an H200's 132 SMs mostly idle at a decode's one row block."""
    return 64 if n >= 64 * 256 else 32


def linear_plan(n: int, k: int, sms: int = DEFAULT_SMS) -> LinearPlan:
    """The tiles of a [N, K] weight on a GPU of `sms` SMs, from those three numbers only (never
    M: a row's bits are the same at any M). Where the column tiles fill the SMs, linear_kernel's
    tiles (split 1). Where they do not, K splits in powers of two until the programs number at
    least twice the SMs (a decode's one row block then streams the weight from every SM), while
    a split keeps >= SPLIT_MIN_K of K; ranges of SPLIT_BLOCK_K steps, the empty ones dropped."""
    bn = linear_block_n(n)
    tiles = -(-n // bn)
    split = 1
    if tiles < sms:
        while split < SPLIT_MAX and tiles * split < 2 * sms and k // (2 * split) >= SPLIT_MIN_K:
            split *= 2
    if split > 1:
        split = -(-k // split_range(k, split))
    if split == 1:
        return LinearPlan(bn, LINEAR_BLOCK_K, 4, 1)
    return LinearPlan(bn, SPLIT_BLOCK_K, 4, split)


def split_range(k: int, split: int) -> int:
    """K per split: k / split rounded up to whole SPLIT_BLOCK_K steps."""
    return -(-k // (split * SPLIT_BLOCK_K)) * SPLIT_BLOCK_K


@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """The SMs of a CUDA device (the plan's input), DEFAULT_SMS elsewhere."""
    if device.type != "cuda" or interpreted():
        return DEFAULT_SMS
    return _device_sms(device.index if device.index is not None else 0)


class Partials(NamedTuple):
    """A split linear not yet reduced: p [SPLIT, M, N] float32, its bias or None, the output
    dtype. split_reduce (or fused.add_rmsnorm, which adds them in the same order) finishes it."""
    p: object
    bias: object
    dtype: object


def _run_linear(x, w, scale, block, bias, reduce: bool, sms):
    """linear / linear_w8 by the plan of w's shape: linear_kernel's tiles, or split-K partials
    (reduced unless not `reduce`: then Partials)."""
    import torch

    m, k = x.shape
    n = w.shape[0]
    plan = linear_plan(n, k, sms or sm_count(x.device))
    w8 = scale is not None
    ieee = x.dtype == torch.float32 or interpreted()
    if plan.split_k == 1:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(m, LINEAR_BLOCK_M), triton.cdiv(n, plan.block_n))
        b = bias if bias is not None else (scale if w8 else w)
        if w8:
            launch(linear_w8_kernel, grid, x, w, scale, b, y, m, n, k, x.stride(0), w.stride(0), scale.stride(0),
                   y.stride(0), block[0], block[1] or k, HAS_BIAS=bias is not None, IEEE=ieee,
                   BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps)
        else:
            launch(linear_kernel, grid, x, w, b, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                   HAS_BIAS=bias is not None, IEEE=ieee, BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=plan.block_n,
                   BLOCK_K=plan.block_k, num_warps=plan.num_warps)
        return y
    p = torch.empty((plan.split_k, m, n), dtype=torch.float32, device=x.device)
    s = scale if w8 else w
    launch(linear_split_kernel, (triton.cdiv(m, LINEAR_BLOCK_M), triton.cdiv(n, plan.block_n), plan.split_k),
           x, w, s, p, m, n, k, split_range(k, plan.split_k), x.stride(0), w.stride(0), s.stride(0),
           block[0], block[1] or k, W8=w8, IEEE=ieee, BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=plan.block_n,
           BLOCK_K=plan.block_k, num_warps=plan.num_warps)
    parts = Partials(p, bias, x.dtype)
    return split_reduce(parts) if reduce else parts


def split_reduce(parts: Partials):
    """Launch split_reduce_kernel: a split linear's output [M, N] in its dtype."""
    import torch

    split, m, n = parts.p.shape
    y = torch.empty((m, n), dtype=parts.dtype, device=parts.p.device)
    if m:
        launch(split_reduce_kernel, (m, triton.cdiv(n, REDUCE_BLOCK)), parts.p,
               parts.bias if parts.bias is not None else parts.p, y, m, n, y.stride(0), SPLIT=split,
               HAS_BIAS=parts.bias is not None, BLOCK=REDUCE_BLOCK)
    return y


def linear(x, w, bias=None, reduce: bool = True, sms: int | None = None):
    """x [M, K], w [N, K] (row-major K), bias [N] or None -> [M, N] in x's dtype, by
    linear_plan(N, K, sms: this GPU's SMs where not given): linear_kernel, or split-K (its
    partials, Partials, where not `reduce`); float32 inputs take IEEE dots, others bf16
    tensor-core dots (in the interpreter IEEE float32 dots of the bf16 values: Triton 3.9's
    interpreted bf16 dot is wrong), float32 accumulation."""
    m, k = x.shape
    assert w.shape[1] == k and w.stride(1) == 1, (x.shape, w.shape, w.stride())
    x = x if x.stride(1) == 1 else x.contiguous()
    return _run_linear(x, w, None, (1, 0), bias, reduce, sms)


def linear_w8(x, w8, scale, block: tuple[int, int], bias=None, reduce: bool = True, sms: int | None = None):
    """x [M, K] (bf16), w8 [N, K] float8 E4M3, scale [ceil(N / r), ceil(K / c)] float32 for
    weight blocks `block` = (r, c) (c 0: a whole row, runtime/fp8.py), bias [N] or None ->
    [M, N] in x's dtype; the plan, tiles and dots of `linear`."""
    import torch

    m, k = x.shape
    assert w8.shape[1] == k and w8.stride(1) == 1 and w8.dtype == torch.float8_e4m3fn, (x.shape, w8.shape, w8.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    return _run_linear(x, w8, scale.float().contiguous(), block, bias, reduce, sms)


def rmsnorm(x, w, eps: float):
    """Launch rmsnorm_kernel over the last dimension of x (any leading shape) -> x's shape and dtype."""
    import torch

    h = x.shape[-1]
    rows = x.reshape(-1, h)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        launch(rmsnorm_kernel, (rows.shape[0],), rows, w, y, h, rows.stride(0), y.stride(0), float(eps),
               BLOCK=_next_pow2(h))
    return y.view(x.shape)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def tree_attention(q, k_cache, v_cache, slots, ctx_len, paths, scale: float, window: int = 0,
                   softcap: float = 0.0, out_dtype=None):
    """Launch tree_attention (torch tensors; shapes in plugins/reference.py; window: the layer's
    sliding window, 0 none; softcap: the scores' soft-cap, 0 none) -> o [B, T, Hq, D] in
    out_dtype (float32 by default; bf16: the float32 result rounded as torch's .to rounds it)."""
    import torch

    b, t, hq, d = q.shape
    s_, hkv, _, dk = k_cache.shape
    assert dk == d and d == _next_pow2(d) and d >= 16, f"head_dim {d} must be a power of two >= 16"
    assert hq % hkv == 0 and paths.shape[:2] == (b, t), (q.shape, k_cache.shape, paths.shape)
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride() and q.stride(3) == 1
    g = hq // hkv
    o = torch.empty((b, t, hq, d), dtype=out_dtype or torch.float32, device=q.device)
    paths = paths.contiguous()
    launch(tree_attention_kernel, (b * t, hkv),
           q, k_cache, v_cache, o, slots, ctx_len, paths, float(scale), int(window), float(softcap), t, paths.shape[2],
           q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           o.stride(0), o.stride(1), o.stride(2), paths.stride(0), paths.stride(1),
           G=g, BLOCK_G=max(16, _next_pow2(g)), BLOCK_P=max(16, _next_pow2(paths.shape[2])),
           BLOCK_N=BLOCK_N, D=d)
    return o


def verify(logits, tokens, parents, temperature, top_k, top_p, min_p, seeds, positions):
    """Launch verify (torch tensors; contract in plugins/reference.py) ->
    (accepted_nodes [B, T] int32, output_ids [B, T] int64, num_accepted [B] int32), -1 padded."""
    import torch

    b, t, v = logits.shape
    assert logits.stride(2) == 1 and tokens.shape == (b, t) and parents.shape == (b, t)
    dev = logits.device
    nodes = torch.empty((b, t), dtype=torch.int32, device=dev)     # the kernel writes every entry
    out = torch.empty((b, t), dtype=torch.int64, device=dev)
    num = torch.empty(b, dtype=torch.int32, device=dev)
    launch(verify_kernel, (b,),
           logits, tokens.to(torch.int64).contiguous(), parents.to(torch.int32).contiguous(),
           temperature.to(torch.float64), top_k.to(torch.int32), top_p.to(torch.float64),
           min_p.to(torch.float64), seeds.to(torch.int64), positions.to(torch.int64),
           nodes, out, num, t, v, logits.stride(0), logits.stride(1),
           BLOCK_T=max(16, _next_pow2(t)), BLOCK_V=min(BLOCK_V, _next_pow2(v)))
    return nodes, out, num


def tree_attention_plugin(q, k, v, k_cache, v_cache, slots, ctx_len, n_prior, paths, scale: float,
                          window: int = 0, softcap: float = 0.0):
    """Launch the plugin's tree attention as TensorRT does (contiguous torch tensors; the
    contract of specdec::tree_attention, buildlib/engine_graph.py) -> o [B, T, Hq, D]."""
    import torch

    b, t, hq, d = q.shape
    _, hkv, l_, _ = k_cache.shape
    o = torch.empty((b, t, hq, d), dtype=torch.float32, device=q.device)
    c = lambda x: x.contiguous()
    launch(tree_attention_plugin_kernel, (b * t, hkv),
           c(q), c(k), c(v), c(k_cache), c(v_cache), c(slots), c(ctx_len), c(n_prior), c(paths), t, paths.shape[2], l_, o,
           HKV=hkv, G=hq // hkv, BLOCK_G=max(16, _next_pow2(hq // hkv)), BLOCK_P=PLUGIN_BLOCK_P, BLOCK_N=BLOCK_N, D=d,
           SCALE=float(scale), WINDOW=int(window), SOFTCAP=float(softcap))
    return o


def verify_plugin(logits, tokens, parents, temperature, top_k, top_p, min_p, seeds, positions):
    """Launch the plugin's verification as TensorRT does (specdec::rejection_sample: float32
    parameters, logits [B, R, V]) -> (accepted_nodes, output_ids, num_accepted)."""
    import torch

    b, r, v = logits.shape
    t = tokens.shape[1]
    dev = logits.device
    nodes = torch.empty((b, t), dtype=torch.int32, device=dev)
    out = torch.empty((b, t), dtype=torch.int64, device=dev)
    num = torch.empty(b, dtype=torch.int32, device=dev)
    c = lambda x: x.contiguous()
    launch(verify_plugin_kernel, (b,), c(logits), c(tokens), c(parents), c(temperature), c(top_k), c(top_p),
           c(min_p), c(seeds), c(positions), t, r, v, nodes, out, num,
           BLOCK_T=PLUGIN_MAX_NODES, BLOCK_V=min(BLOCK_V, _next_pow2(v)))
    return nodes, out, num


_STRIDES = ("sq_b", "sq_t", "sq_h", "sk_s", "sk_h", "sk_l", "so_b", "so_t", "so_h", "sp_b", "sp_t")


def signatures(kv_dtype: str = "fp32", head_dim: int = 128, group: int = 4, w_fp8: bool = False) -> dict:
    """Kernel name -> (jit function, signature, constexprs) of the variants the GPU runtime
    launches, for compiling ahead of time (CI's PTX check, TensorRT plugins)."""
    attn = {"q_ptr": f"*{kv_dtype}", "k_ptr": f"*{kv_dtype}", "v_ptr": f"*{kv_dtype}", "o_ptr": "*fp32",
            "slots_ptr": "*i32", "ctx_ptr": "*i32", "paths_ptr": "*i32", "scale": "fp32", "window": "i32",
            "softcap": "fp32", "T": "i32", "P": "i32", **{n: "i32" for n in _STRIDES}, "G": "constexpr",
            "BLOCK_G": "constexpr", "BLOCK_P": "constexpr", "BLOCK_N": "constexpr", "D": "constexpr"}
    ver = {"logits_ptr": "*fp32", "tokens_ptr": "*i64", "parents_ptr": "*i32", "temp_ptr": "*fp64",
           "topk_ptr": "*i32", "topp_ptr": "*fp64", "minp_ptr": "*fp64", "seeds_ptr": "*i64",
           "pos_ptr": "*i64", "nodes_ptr": "*i32", "out_ptr": "*i64", "num_ptr": "*i32", "T": "i32",
           "V": "i32", "sl_b": "i64", "sl_t": "i64", "BLOCK_T": "constexpr", "BLOCK_V": "constexpr"}
    lin = {"x_ptr": f"*{kv_dtype}", "w_ptr": f"*{kv_dtype}", "b_ptr": f"*{kv_dtype}", "y_ptr": f"*{kv_dtype}",
           "M": "i32", "N": "i32", "K": "i32", "sxm": "i32", "swn": "i32", "sym": "i32", "HAS_BIAS": "constexpr",
           "IEEE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    norm = {"x_ptr": f"*{kv_dtype}", "w_ptr": f"*{kv_dtype}", "y_ptr": f"*{kv_dtype}", "H": "i32", "sx": "i32",
            "sy": "i32", "eps": "fp32", "BLOCK": "constexpr"}
    w8 = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32",
          "N": "i32", "K": "i32", "sxm": "i32", "swn": "i32", "ssn": "i32", "sym": "i32", "SR": "i32", "SC": "i32",
          "HAS_BIAS": "constexpr", "IEEE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
          "BLOCK_K": "constexpr"}
    wdt = "fp8e4nv" if w_fp8 else kv_dtype
    split = {"x_ptr": f"*{kv_dtype}", "w_ptr": f"*{wdt}", "s_ptr": "*fp32", "p_ptr": "*fp32",
             **{n: "i32" for n in ("M", "N", "K", "KS", "sxm", "swn", "ssn", "SR", "SC")},
             **{n: "constexpr" for n in ("W8", "IEEE", "BLOCK_M", "BLOCK_N", "BLOCK_K")}}
    red = {"p_ptr": "*fp32", "b_ptr": f"*{kv_dtype}", "y_ptr": f"*{kv_dtype}", "M": "i32", "N": "i32", "sym": "i32",
           "SPLIT": "constexpr", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"}
    return {
        "linear_split": (linear_split_kernel, split, {"W8": w_fp8, "IEEE": kv_dtype == "fp32",
                                                      "BLOCK_M": LINEAR_BLOCK_M, "BLOCK_N": 32,
                                                      "BLOCK_K": SPLIT_BLOCK_K}),
        "split_reduce": (split_reduce_kernel, red, {"SPLIT": 4, "HAS_BIAS": True, "BLOCK": REDUCE_BLOCK}),
        "linear_w8": (linear_w8_kernel, w8, {"HAS_BIAS": False, "IEEE": False, "BLOCK_M": LINEAR_BLOCK_M,
                                             "BLOCK_N": 64, "BLOCK_K": LINEAR_BLOCK_K}),
        "linear": (linear_kernel, lin, {"HAS_BIAS": True, "IEEE": kv_dtype == "fp32", "BLOCK_M": LINEAR_BLOCK_M,
                                        "BLOCK_N": 64, "BLOCK_K": LINEAR_BLOCK_K}),
        "rmsnorm": (rmsnorm_kernel, norm, {"BLOCK": 4096}),      # a Llama-3-8B row
        "tree_attention": (tree_attention_kernel, attn,
                           {"G": group, "BLOCK_G": max(16, _next_pow2(group)), "BLOCK_P": 16,
                            "BLOCK_N": BLOCK_N, "D": head_dim}),
        "verify": (verify_kernel, ver, {"BLOCK_T": 32, "BLOCK_V": BLOCK_V}),
    }


def plugin_signatures(kv_dtype: str = "fp32", head_dim: int = 128, group: int = 4, num_kv_heads: int = 8,
                      scale: float = 1.0, window: int = 0, softcap: float = 0.0) -> dict:
    """Plugin name -> (jit function, signature, constexprs) of the TensorRT plugins' kernels
    (the attention's scale, sliding window and soft-cap are compiled in: one PTX per distinct
    triple)."""
    attn = {**{n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr")}, "kc_ptr": f"*{kv_dtype}", "vc_ptr": f"*{kv_dtype}",
            **{n: "*i32" for n in ("slots_ptr", "ctx_ptr", "nprior_ptr", "paths_ptr")},
            "T": "i32", "P": "i32", "L": "i32", "o_ptr": "*fp32",
            **{n: "constexpr" for n in ("HKV", "G", "BLOCK_G", "BLOCK_P", "BLOCK_N", "D", "SCALE", "WINDOW",
                                        "SOFTCAP")}}
    ver = {"logits_ptr": "*fp32", "tokens_ptr": "*i64", "parents_ptr": "*i32", "temp_ptr": "*fp32",
           "topk_ptr": "*i32", "topp_ptr": "*fp32", "minp_ptr": "*fp32", "seeds_ptr": "*i64", "pos_ptr": "*i64",
           "T": "i32", "R": "i32", "V": "i32", "nodes_ptr": "*i32", "out_ptr": "*i64", "num_ptr": "*i32",
           "BLOCK_T": "constexpr", "BLOCK_V": "constexpr"}
    return {
        "tree_attention": (tree_attention_plugin_kernel, attn,
                           {"HKV": num_kv_heads, "G": group, "BLOCK_G": max(16, _next_pow2(group)),
                            "BLOCK_P": PLUGIN_BLOCK_P, "BLOCK_N": BLOCK_N, "D": head_dim, "SCALE": float(scale),
                            "WINDOW": int(window), "SOFTCAP": float(softcap)}),
        "rejection_sample": (verify_plugin_kernel, ver, {"BLOCK_T": PLUGIN_MAX_NODES, "BLOCK_V": BLOCK_V}),
    }


def compile_plugin(name: str, arch: int = 90, num_warps: int = 4, **variant) -> tuple[str, str, int]:
    """A TensorRT plugin's kernel compiled for sm_<arch> -> (PTX, kernel symbol, shared memory
    bytes): what its `aot_impl` returns (plugins/trt_plugins.py). Not in an interpreted process."""
    assert not interpreted(), "compile_plugin needs a process without TRITON_INTERPRET=1"
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, consts = plugin_signatures(**variant)[name]
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 1})
    md = compiled.metadata
    assert not getattr(md, "global_scratch_size", 0) and not getattr(md, "profile_scratch_size", 0), \
        f"{name}: the kernel needs Triton scratch memory, which a TensorRT plugin launch does not provide"
    nargs = sum(1 for t in sig.values() if t != "constexpr")
    return entry_params(compiled.asm["ptx"], md.name, nargs), md.name, int(md.shared)


def entry_params(ptx: str, symbol: str, nargs: int) -> str:
    """The PTX with the kernel's parameter list cut to its first `nargs` (the declared ones):
    Triton >= 3.3 appends hidden scratch pointers (global, profile) that its own launcher fills,
    but TensorRT passes exactly inputs + scalars + outputs. Only unreferenced ones are cut."""
    head = f".entry {symbol}("
    start = ptx.index(head) + len(head)
    end = ptx.index(")", start)
    params = [p.strip().rstrip(",") for p in ptx[start:end].split(",\n") if p.strip()]
    for i in range(nargs, len(params)):
        uses = ptx.count(f"{symbol}_param_{i}")
        assert uses == 1, f"hidden parameter {i} of {symbol} is used by the kernel ({uses} references)"
    kept = ",\n".join("\t" + p for p in params[:nargs])
    return ptx[:start] + "\n" + kept + "\n" + ptx[end:]
