"""Fused kernels of the GPU step (issue 41, point 2): the torch runtime's invariant mode
(runtime/torch_model.py) runs a layer in 8 launches (norm, qkv, rotary + KV write, attention,
o, norm, gate_up + activation, down) and the rest of a step in 3 (embedding, final norm, LM head)
besides verification. Each kernel is invariant by construction: one program per row (or per
(row, head)), or plugins/kernels.py's fixed tiles, so a row's bits never depend on M or the batch.

add_rmsnorm: the residual add of the sublayer before (x + h, h first RMS-normed where the model
    has post norms, Gemma) and the next norm, one program per row; the add rounded as torch
    rounds it, the norms rmsnorm_kernel's numbers: the unfused path's bits.
rope_kv: per (token, head) of the fused q/k/v rows: the q/k norm per head (Gemma-3, Qwen3),
    rotary at the token's position (HF rotate_half, float32), q out in float32, k and v written
    to their (slot, column) of the cache: the unfused path's bits (the norm's sum over the head
    in its order; the rotated partner entry normed by the same scale).
gate_up_act: the gate_up linear's tiles for gate columns and the same up columns in one program,
    then act(gate) * up (SiLU or tanh GELU), rounded as torch rounds each op; the linears' bits,
    the activation's within float32 rounding of torch's (exp and tanh are the backend's).
lm_head: the LM head on the rows a step's logits are read from (gathered in the kernel), the
    logits in float32 from the compute dtype's value, soft-capped where the model caps them.
embed: the embedding rows, times the embedding scale (Gemma) rounded as torch rounds it.
Knows: tensors, kernels. Does not know: requests, models.
"""
from __future__ import annotations

import triton
import triton.language as tl

from plugins import kernels
from plugins.kernels import (LINEAR_BLOCK_K, LINEAR_BLOCK_M, _dot, _load_rows, _rms, _rms_apply, _rounded, _tanh,
                             _split_sum, _tile, _w_tile, interpreted,
                             linear_block_n)


@triton.jit(do_not_specialize=["M"])
def add_rmsnorm_kernel(x_ptr, h_ptr, hb_ptr, pw_ptr, w_ptr, xo_ptr, y_ptr, M, H, sx, sh, sxo, sy, eps,
                       HAS_RES: tl.constexpr, SPLIT: tl.constexpr, H_BIAS: tl.constexpr, POST: tl.constexpr,
                       BLOCK: tl.constexpr):
    """One row: (HAS_RES) x += h (POST: h RMS-normed by pw first), stored to xo; y = RMSNorm(x) w.
    SPLIT > 1: h is a split linear's partials [SPLIT, M, H] (+ its bias hb where H_BIAS), made
    here the value kernels.split_reduce would store (the same sum in the same order, rounded)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    DT = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + r * sx + c, mask=c < H, other=0.0).to(tl.float32)
    if HAS_RES:
        if SPLIT > 1:
            h = _split_sum(h_ptr, hb_ptr, r, c, M, H, SPLIT, H_BIAS).to(DT).to(tl.float32)
        else:
            h = tl.load(h_ptr + r * sh + c, mask=c < H, other=0.0).to(tl.float32)
        if POST:
            h = _rms_apply(h, _rms(h, H, eps), pw_ptr, c, H, DT).to(DT).to(tl.float32)
        x = _rounded(x + h, DT)
        tl.store(xo_ptr + r * sxo + c, x.to(DT), mask=c < H)
    y = _rms_apply(x, _rms(x, H, eps), w_ptr, c, H, DT)
    tl.store(y_ptr + r * sy + c, y.to(DT), mask=c < H)


@triton.jit
def _qkv_in(qkv_ptr, hb_ptr, n, cols, M, sqkv, W: tl.constexpr, SPLIT: tl.constexpr, H_BIAS: tl.constexpr):
    """Columns `cols` of qkv row n, float32: the stored row, or (SPLIT > 1) a split linear's
    partials [SPLIT, M, W] summed (+ its bias hb) and rounded as kernels.split_reduce stores them."""
    if SPLIT > 1:
        return _split_sum(qkv_ptr, hb_ptr, n, cols, M, W, SPLIT, H_BIAS).to(hb_ptr.dtype.element_ty).to(tl.float32)
    return tl.load(qkv_ptr + n * sqkv + cols).to(tl.float32)


@triton.jit
def _head_in(qkv_ptr, hb_ptr, n, base, M, sqkv, wn_ptr, c, D: tl.constexpr, eps, QK_NORM: tl.constexpr,
             W: tl.constexpr, SPLIT: tl.constexpr, H_BIAS: tl.constexpr):
    """A head's entries (qkv row n from column base) and their rotate_half partners (c + D/2 mod
    D), float32; QK_NORM: both RMS-normed by the head's scale (wn: its weights [D]) and rounded
    to the compute dtype (hb's) as the norm stores."""
    DT = hb_ptr.dtype.element_ty
    cr = (c + D // 2) % D
    x = _qkv_in(qkv_ptr, hb_ptr, n, base + c, M, sqkv, W, SPLIT, H_BIAS)
    xr = _qkv_in(qkv_ptr, hb_ptr, n, base + cr, M, sqkv, W, SPLIT, H_BIAS)
    if QK_NORM:
        rms = _rms(x, D, eps)
        x = _rms_apply(x, rms, wn_ptr, c, D, DT).to(DT).to(tl.float32)
        xr = _rms_apply(xr, rms, wn_ptr, cr, D, DT).to(DT).to(tl.float32)
    return x, xr


@triton.jit(do_not_specialize=["M"])
def rope_kv_kernel(qkv_ptr, hb_ptr, pos_ptr, cos_ptr, sin_ptr, wn_ptr, q_ptr, kc_ptr, vc_ptr, wslot_ptr, wcol_ptr,
                   M, sqkv, scs, sq_n, sq_h, sc_s, sc_h, sc_l, eps,
                   NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                   SPLIT: tl.constexpr, H_BIAS: tl.constexpr):
    """Program (token n, head h of the NH + 2 NKV in a qkv row): q heads normed (QK_NORM),
    rotated and stored to q [N, NH, D] (float32); k heads the same, stored to the cache at the
    token's (slot, column) in the cache's dtype; v heads copied there. The qkv rows: stored
    (SPLIT 1; hb the rows again) or a split linear's partials [SPLIT, M, W] and hb its bias
    (H_BIAS) or another tensor of its dtype."""
    W = (NH + 2 * NKV) * D
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, D)
    if h < NH + NKV:
        x, xr = _head_in(qkv_ptr, hb_ptr, n, h * D, M, sqkv, wn_ptr + (h >= NH).to(tl.int32) * D, c, D, eps,
                         QK_NORM, W, SPLIT, H_BIAS)
        p = tl.load(pos_ptr + n).to(tl.int64)
        cos = tl.load(cos_ptr + p * scs + c % (D // 2))
        sin = tl.load(sin_ptr + p * scs + c % (D // 2))
        out = x * cos + tl.where(c < D // 2, -xr, xr) * sin   # x1 cos - x2 sin | x2 cos + x1 sin
        if h < NH:
            tl.store(q_ptr + n * sq_n + h * sq_h + c, out)
        else:
            at = tl.load(wslot_ptr + n).to(tl.int64) * sc_s + (h - NH) * sc_h + tl.load(wcol_ptr + n).to(tl.int64) * sc_l
            tl.store(kc_ptr + at + c, _rounded(out, kc_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty))
    else:
        at = tl.load(wslot_ptr + n).to(tl.int64) * sc_s + (h - NH - NKV) * sc_h + tl.load(wcol_ptr + n).to(tl.int64) * sc_l
        v = _qkv_in(qkv_ptr, hb_ptr, n, h * D + c, M, sqkv, W, SPLIT, H_BIAS)
        tl.store(vc_ptr + at + c, _rounded(v, vc_ptr.dtype.element_ty).to(vc_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["M"])
def gate_up_act_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, I, K, sxm, swn, ssn, sym, SR, SC,
                       GELU: tl.constexpr, W8: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[M, I] = act(x w[:I]^T) * (x w[I:]^T), w the fused [2I, K] gate_up weight: each program's
    gate and up tiles over the same rows and columns, K in BLOCK_K steps from 0 (linear_kernel's
    tiles and dots); each op rounded to y's dtype as the unfused torch ops round it."""
    rm, rn, rk, acc_g = _tile(BLOCK_M, BLOCK_N, BLOCK_K)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = _load_rows(x_ptr, rm, kk, sxm, M, K)
        acc_g = _dot(a, _w_tile(w_ptr, s_ptr, rn, rn < I, kk, K, swn, ssn, SR, SC, W8), acc_g, IEEE)
        acc_u = _dot(a, _w_tile(w_ptr, s_ptr, rn + I, rn < I, kk, K, swn, ssn, SR, SC, W8), acc_u, IEEE)
    DT = y_ptr.dtype.element_ty
    g = acc_g.to(DT).to(tl.float32)                  # the unfused linear's stored values
    u = acc_u.to(DT).to(tl.float32)
    if GELU:
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = g / (1.0 + tl.exp(-g))
    y = _rounded(_rounded(a, DT) * u, DT)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y.to(DT), mask=(rm[:, None] < M) & (rn[None, :] < I))


@triton.jit(do_not_specialize=["M"])
def lm_head_kernel(x_ptr, idx_ptr, w_ptr, y_ptr, M, N, K, R, T, sxm, swn, sym, cap,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[M, N] (float32) = x[src] w^T, src = (m // R) T + idx[m] (row m of a step's logits reads
    node idx[m] of its batch row); the value rounded to x's dtype as the unfused linear stores it,
    then cap tanh(y / cap) where cap > 0."""
    rm, rn, rk, acc = _tile(BLOCK_M, BLOCK_N, BLOCK_K)
    src = (rm // R) * T + tl.load(idx_ptr + rm, mask=rm < M, other=0)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + src[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = _dot(a, b, acc, IEEE)
    y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    if cap > 0:
        y = _tanh(y / cap) * cap
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def embed_kernel(ids_ptr, e_ptr, s_ptr, y_ptr, H, se, sy, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One row: the embedding of ids[r] (times the scalar s, rounded as torch rounds it)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    e = tl.load(e_ptr + tl.load(ids_ptr + r).to(tl.int64) * se + c, mask=c < H, other=0.0).to(tl.float32)
    if HAS_SCALE:
        e = _rounded(e * tl.load(s_ptr).to(tl.float32), y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * sy + c, e.to(y_ptr.dtype.element_ty), mask=c < H)


def add_rmsnorm(x, w, eps: float, h=None, post=None):
    """-> (x + h (h normed by `post` first, where given), RMSNorm of it times w): x, h [M, H]
    rows of the compute dtype, or h a split linear's kernels.Partials (reduced here, the split
    reduction's launch saved); without h, (x, RMSNorm(x) w)."""
    import torch

    m, hd = x.shape
    y = torch.empty_like(x)
    xo = x if h is None else torch.empty_like(x)
    split = isinstance(h, kernels.Partials)
    hh = x if h is None else (h.p if split else h)
    hb = h.bias if split and h.bias is not None else hh
    if split:
        assert h.p.shape[1:] == (m, hd) and h.dtype == x.dtype, (h.p.shape, x.shape, h.dtype)
    if m:
        kernels.launch(add_rmsnorm_kernel, (m,), x, hh, hb, w if post is None else post, w, xo, y, m, hd,
                       x.stride(0), 0 if split else hh.stride(0), xo.stride(0), y.stride(0), float(eps),
                       HAS_RES=h is not None, SPLIT=h.p.shape[0] if split else 1,
                       H_BIAS=split and h.bias is not None, POST=post is not None, BLOCK=kernels._next_pow2(hd))
    return xo, y


def rope_kv(qkv, positions, cos, sin, qk_norm, eps: float, nh: int, nkv: int, k_cache, v_cache, wslot, wcol):
    """qkv [N, (nh + 2 nkv) D] (or a split qkv linear's kernels.Partials, reduced here) -> q [N,
    nh, D] float32 (q/k normed per head by qk_norm [2, D] where given, rotated at `positions` by
    the tables cos / sin [P, D/2]); k and v written to k_cache / v_cache [S, nkv, L, D] at
    (wslot, wcol) [N]."""
    import torch

    split = isinstance(qkv, kernels.Partials)
    rows = qkv.p[0] if split else qkv
    n, w = rows.shape
    d = cos.shape[1] * 2
    assert w == (nh + 2 * nkv) * d and rows.stride(1) == 1 and k_cache.stride() == v_cache.stride()
    assert cos.stride() == sin.stride() and cos.stride(1) == 1 and k_cache.stride(3) == 1
    q = torch.empty((n, nh, d), dtype=torch.float32, device=rows.device)
    hb = qkv
    if split:                       # the bias, or any tensor of the linear's dtype (the rounding's)
        hb = qkv.bias if qkv.bias is not None else torch.empty(0, dtype=qkv.dtype, device=rows.device)
    if n:
        kernels.launch(rope_kv_kernel, (n, nh + 2 * nkv), qkv.p if split else qkv, hb, positions, cos, sin,
                       cos if qk_norm is None else qk_norm, q, k_cache, v_cache, wslot, wcol, n, rows.stride(0),
                       cos.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                       k_cache.stride(2), float(eps), NH=nh, NKV=nkv, D=d, QK_NORM=qk_norm is not None,
                       SPLIT=qkv.p.shape[0] if split else 1, H_BIAS=split and qkv.bias is not None)
    return q


def gate_up_act(x, w, gelu: bool, w_scale=None, block: tuple[int, int] = (1, 0)):
    """x [M, K], w the fused gate_up weight [2I, K] (bf16 / float32; or FP8 E4M3 codes with
    their block scales w_scale for weight blocks `block`, kernels.linear_w8's) -> act(gate) * up
    [M, I] in x's dtype."""
    import torch

    m, k = x.shape
    i = w.shape[0] // 2
    assert w.shape == (2 * i, k) and w.stride(1) == 1, (x.shape, w.shape)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty((m, i), dtype=x.dtype, device=x.device)
    s = w if w_scale is None else w_scale.float().contiguous()
    bn = linear_block_n(2 * i)
    kernels.launch(gate_up_act_kernel, (triton.cdiv(m, LINEAR_BLOCK_M), triton.cdiv(i, bn)), x, w, s, y, m, i, k,
                   x.stride(0), w.stride(0), s.stride(0), y.stride(0), block[0], block[1] or k, GELU=gelu,
                   W8=w_scale is not None, IEEE=x.dtype == torch.float32 or interpreted(), BLOCK_M=LINEAR_BLOCK_M,
                   BLOCK_N=bn, BLOCK_K=LINEAR_BLOCK_K)
    return y


def lm_head(x, index, t: int, w, cap: float = 0.0):
    """x [B T, H] (a step's final-norm rows), index [B, R] (each batch row's nodes whose logits
    are read), w [V, H] -> logits [B, R, V] float32, soft-capped by cap (0: none)."""
    import torch

    b, r = index.shape
    m, (n, k) = b * r, w.shape
    assert x.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    y = torch.empty((b, r, n), dtype=torch.float32, device=x.device)
    idx = index if index.is_contiguous() else index.contiguous()
    bn = linear_block_n(n)
    kernels.launch(lm_head_kernel, (triton.cdiv(m, LINEAR_BLOCK_M), triton.cdiv(n, bn)), x, idx, w, y, m, n, k, r, t,
                   x.stride(0), w.stride(0), n, float(cap), IEEE=x.dtype == torch.float32 or interpreted(),
                   BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=bn, BLOCK_K=LINEAR_BLOCK_K)
    return y


def embed(table, ids, scale=None):
    """table [V, H], ids [N] -> rows [N, H] (times the 0-d tensor scale where given)."""
    import torch

    n, h = ids.shape[0], table.shape[1]
    y = torch.empty((n, h), dtype=table.dtype, device=table.device)
    if n:
        kernels.launch(embed_kernel, (n,), ids, table, table if scale is None else scale, y, h, table.stride(0),
                       y.stride(0), HAS_SCALE=scale is not None, BLOCK=kernels._next_pow2(h))
    return y


def signatures(kv_dtype: str = "bf16", head_dim: int = 128, **_) -> dict:
    """Kernel name -> (jit function, signature, constexprs) of the fused kernels as the GPU
    runtime launches them (a Llama-3-8B shape; ptx.compile_ptx compiles them)."""
    dt = kv_dtype
    i32 = lambda *names: {n: "i32" for n in names}
    norm = {"x_ptr": f"*{dt}", "h_ptr": f"*{dt}", "hb_ptr": f"*{dt}", "pw_ptr": f"*{dt}", "w_ptr": f"*{dt}",
            "xo_ptr": f"*{dt}", "y_ptr": f"*{dt}", **i32("M", "H", "sx", "sh", "sxo", "sy"), "eps": "fp32",
            **{n: "constexpr" for n in ("HAS_RES", "SPLIT", "H_BIAS", "POST", "BLOCK")}}
    norm_split = {**norm, "h_ptr": "*fp32"}
    rope = {"qkv_ptr": f"*{dt}", "hb_ptr": f"*{dt}", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "wn_ptr": f"*{dt}",
            "q_ptr": "*fp32", "kc_ptr": f"*{dt}", "vc_ptr": f"*{dt}", "wslot_ptr": "*i64", "wcol_ptr": "*i64",
            **i32("M", "sqkv", "scs", "sq_n", "sq_h", "sc_s", "sc_h", "sc_l"), "eps": "fp32",
            **{n: "constexpr" for n in ("NH", "NKV", "D", "QK_NORM", "SPLIT", "H_BIAS")}}
    rope_split = {**rope, "qkv_ptr": "*fp32"}
    tiles = {"IEEE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    gu = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "s_ptr": "*fp32", "y_ptr": f"*{dt}",
          **i32("M", "I", "K", "sxm", "swn", "ssn", "sym", "SR", "SC"), "GELU": "constexpr", "W8": "constexpr", **tiles}
    gu8 = {**gu, "w_ptr": "*fp8e4nv"}
    head = {"x_ptr": f"*{dt}", "idx_ptr": "*i64", "w_ptr": f"*{dt}", "y_ptr": "*fp32",
            **i32("M", "N", "K", "R", "T", "sxm", "swn", "sym"), "cap": "fp32", **tiles}
    emb = {"ids_ptr": "*i64", "e_ptr": f"*{dt}", "s_ptr": f"*{dt}", "y_ptr": f"*{dt}", **i32("H", "se", "sy"),
           "HAS_SCALE": "constexpr", "BLOCK": "constexpr"}
    t = {"IEEE": dt == "fp32", "BLOCK_M": LINEAR_BLOCK_M, "BLOCK_N": 64, "BLOCK_K": LINEAR_BLOCK_K}
    return {
        "add_rmsnorm": (add_rmsnorm_kernel, norm, {"HAS_RES": True, "SPLIT": 1, "H_BIAS": False, "POST": True,
                                                   "BLOCK": 4096}),
        "add_rmsnorm_split": (add_rmsnorm_kernel, norm_split, {"HAS_RES": True, "SPLIT": 4, "H_BIAS": True,
                                                               "POST": False, "BLOCK": 4096}),
        "rope_kv": (rope_kv_kernel, rope, {"NH": 32, "NKV": 8, "D": head_dim, "QK_NORM": True, "SPLIT": 1,
                                           "H_BIAS": False}),
        "rope_kv_split": (rope_kv_kernel, rope_split, {"NH": 32, "NKV": 8, "D": head_dim, "QK_NORM": True,
                                                       "SPLIT": 4, "H_BIAS": True}),
        "gate_up_act": (gate_up_act_kernel, gu, {"GELU": True, "W8": False, **t}),
        "gate_up_act_w8": (gate_up_act_kernel, gu8, {"GELU": False, "W8": True, **{**t, "IEEE": False}}),
        "lm_head": (lm_head_kernel, head, t),
        "embed": (embed_kernel, emb, {"HAS_SCALE": True, "BLOCK": 4096}),
    }
