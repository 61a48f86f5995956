"""FP8 linears of the engine graph (graph.py, `--device tensorrt --weights fp8`) by the build's
recipe (runtime/fp8.py): the same weights, blocks and scales as the torch runtime, as ONNX.

Weights: float8 E4M3 [K, N] and a DequantizeLinear; per output channel its scale [N] on axis 1,
a block recipe's scale [ceil(K / c), N] on axis 0 with block_size c (opset 21's blocked
quantization: a 128 x 128 block's scale repeated over its rows, which is the same number).
Inputs: the static recipe's per-tensor QuantizeLinear / DequantizeLinear pair (what TensorRT
fuses into FP8 GEMMs); a dynamic recipe's per-token or per-group scale computed in the graph
(ReduceMax of |x|, / 448), then x / s cast to float8 E4M3 (saturating) and back, times s.
q's multiplier (graph.py folds it into Wq) multiplies the dequantization scale of q's columns,
so the float8 bits are the torch runtime's.

Where TensorRT does not follow (its documentation, "Working with Quantized Types"; unconfirmed
on a GPU, benchmarks/trt_check.sh runs it): TensorRT's FP8 Q/DQ scales are per tensor or per
channel, and its dynamic quantization makes MXFP8 / NVFP4 blocks on Blackwell; so on Hopper only
the static per-tensor recipe becomes FP8 GEMMs, the per-token and 1 x 128 recipes there run
their GEMMs in float on FP8-rounded values (their weights stay FP8 in memory), and a blocked FP8
DequantizeLinear may be refused by its parser.
Knows: ONNX ops for the recipes. Does not know: which recipe a build chose, models.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from backend.runtime import fp8


def fp8_linear(g, x: str, name: str, w: np.ndarray, rec: fp8.Recipe, act_scale: float | None,
               quantize_input: bool, row_scale: np.ndarray | None = None, calibration: dict | None = None,
               linear: str = "") -> str:
    """x [B, T, K] @ w.T, w [N, K] float32 quantized by `rec` (GPTQ's rounding where the recipe
    says so, on `calibration`'s Hessian of `linear`: buildlib/fp8.quantize_fp8, the torch
    runtime's bits); `row_scale` [N]: each output's multiplier, folded into the dequantization
    (graph.py's q scale)."""
    import torch

    from backend.buildlib.fp8 import quantize_fp8

    q, scale = quantize_fp8(torch.from_numpy(np.array(w, np.float32)), rec, calibration, linear)
    bits = q.T.contiguous().view(torch.uint8).numpy()                             # [K, N]
    g.inits.append(helper.make_tensor(f"{name}.wT_fp8", TensorProto.FLOAT8E4M3FN, list(bits.shape),
                                      bits.tobytes(), raw=True))
    n = w.shape[0]
    rows = 1.0 if row_scale is None else np.asarray(row_scale, np.float32)
    if rec.weight_block == (1, 0):
        s = (scale[:, 0].numpy() * rows).astype(np.float32)                       # [N]
        wT = g.op("DequantizeLinear", [f"{name}.wT_fp8", g.init(f"{name}.w_scale", s)], axis=1)
    else:
        r, c = rec.weight_block
        s = (scale.repeat_interleave(r, 0)[:n].T.numpy() * rows).astype(np.float32)   # [ceil(K/c), N]
        wT = g.op("DequantizeLinear", [f"{name}.wT_fp8", g.init(f"{name}.w_scale", np.ascontiguousarray(s))],
                  axis=0, block_size=c)
    if quantize_input:
        x = _input(g, x, name, w.shape[1], rec, act_scale)
    return g.op("MatMul", [x, wT], hint=name)


def _input(g, x: str, name: str, k: int, rec: fp8.Recipe, act_scale: float | None) -> str:
    if rec.static:
        if "fp8_zero" not in g._consts:
            g.inits.append(helper.make_tensor("fp8_zero", TensorProto.FLOAT8E4M3FN, [], b"\x00", raw=True))
            g._consts["fp8_zero"] = "fp8_zero"
        s = g.init(f"{name}.act_scale", np.array(act_scale, np.float32).reshape(()))   # per tensor
        return g.op("DequantizeLinear", [g.op("QuantizeLinear", [x, s, "fp8_zero"]), s, "fp8_zero"])
    if rec.inputs == "token":
        return _fake_quant(g, x, rec)
    grp = rec.group
    kp = math.ceil(k / grp) * grp
    xp = x if kp == k else g.op("Pad", [x, g.i64(0, 0, 0, 0, 0, kp - k)])       # zeros: no amax, no product
    y = g.op("Reshape", [_fake_quant(g, g.op("Reshape", [xp, g.i64(0, 0, kp // grp, grp)]), rec),
                         g.i64(0, 0, kp)])
    return y if kp == k else g.op("Slice", [y, g.i64(0), g.i64(k), g.i64(-1)])


def _fake_quant(g, x: str, rec: fp8.Recipe) -> str:
    """x quantized with a scale per last-axis row (runtime/fp8.input_scale), then dequantized."""
    amax = g.op("ReduceMax", [g.op("Abs", [x]), g.i64(-1)], keepdims=1)
    s = g.op("Max", [g.op("Div", [amax, g.f32(fp8.FP8_MAX)]), g.f32(fp8.TINY)])
    if rec.pow2:                       # 2^ceil(log2 s): E8M0
        s = g.op("Pow", [g.f32(2.0), g.op("Ceil", [g.op("Div", [g.op("Log", [s]), g.f32(math.log(2.0))])])])
    q = g.op("Cast", [g.op("Div", [x, s])], to=TensorProto.FLOAT8E4M3FN, saturate=1)
    return g.op("Mul", [g.op("Cast", [q], to=TensorProto.FLOAT), s])
