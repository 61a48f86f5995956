"""FP8 weights rounded by GPTQ (Frantar et al., 2022) instead of to nearest: the same E4M3 codes
and scales of the recipe (runtime/fp8.py), chosen so the linear's *output* on calibration inputs
moves least, not each weight.

Rounding each weight to its nearest E4M3 value leaves an error of up to 1/16 of it (three
mantissa bits), spread evenly. GPTQ walks a [N, K] weight's columns in order (here: the inputs
with the largest energy first, "act order") and after rounding a column moves the columns not
yet rounded to cancel that column's error on the calibration inputs X, by the inverse of the
Hessian H = X^T X (a Cholesky factor, computed once; `DAMP` of H's mean diagonal added so it
inverts). The scales are the recipe's, computed from the unrounded weights before any update
(a block scale never depends on the order), and an updated weight past a scale's range saturates
at +-448 like any cast. What the runtime reads does not change: codes and scales in the recipe's
layout, so the torch runtime, a scaled-matmul GPU kernel and the engine graph's Q/DQ run GPTQ's
weights exactly as they run nearest rounding's (Recipe.gptq only records how they were rounded).

`hessians` come from the build's calibration prompts (buildlib/calibration.calibrate), one per fused
linear ("layers.<i>.<qkv|o|gate_up|down>": q, k and v share their input, so their H).
Knows: GPTQ, E4M3 rounding. Does not know: models, files, which recipe a build chose.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from backend.runtime import fp8

if TYPE_CHECKING:
    from torch import Tensor

DAMP = 0.01          # of H's mean diagonal, added to its diagonal (the paper's default)
BLOCK = 128          # columns updated together (lazy batch updates: the same result, faster)


def _round(w: Tensor, s: Tensor) -> Tensor:
    """w rounded to the E4M3 value nearest w / s (fp8's cast), times s (float32)."""
    return fp8._cast(w, s).float() * s


def quantize_weight(w: Tensor, rec: fp8.Recipe, hessian: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float weight, its input's [K, K] Hessian (sum of x^T x over calibration rows) ->
    (float8 E4M3 [N, K], float32 scale), the layout of fp8.quantize_weight."""
    import torch

    w = w.float()
    n, k = w.shape
    scale = fp8._scale(fp8._amax_blocks(w, rec.weight_block), rec.pow2)
    full = fp8._expand(scale, (n, k), rec.weight_block)
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0                  # an input never seen: its weights cannot matter
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diagonal(h), descending=True)
    back = torch.argsort(order)
    h = h[order][:, order]
    h += DAMP * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    work = w[:, order].clone()
    work[:, dead[order]] = 0.0
    s = full[:, order]
    out = torch.empty_like(work)
    for a in range(0, k, BLOCK):
        b = min(a + BLOCK, k)
        blk, errs, hb = work[:, a:b].clone(), torch.empty(n, b - a), hinv[a:b, a:b]
        for j in range(b - a):
            col = blk[:, j]
            q = _round(col, s[:, a + j])
            out[:, a + j] = q
            err = (col - q) / hb[j, j]
            blk[:, j:] -= err[:, None] * hb[j, j:][None]
            errs[:, j] = err
        work[:, b:] -= errs @ hinv[a:b, b:]
    q = out[:, back]
    return fp8._cast(q, full), scale
