"""FP8 weight math both GPU devices write (devices/cuda: torch engine files; devices/tensorrt:
the engine graph's float8 initializers, buildlib/fp8_graph.py): the linears as the runtime
multiplies them, each fused linear quantized by a recipe (runtime/fp8.py), rounded by GPTQ
(buildlib/fp8_gptq.py) where the recipe says so.
Knows: checkpoints, recipes, the torch engine layout's tensor names. Does not know: files, devices.
"""
from __future__ import annotations

import numpy as np

from backend.buildlib.checkpoint import Checkpoint
from backend.manifest import WeightFormat
from backend.runtime import fp8

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
# the linears as the runtime multiplies them (q|k|v and gate|up fused): FP8 scales are per fused linear
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def engine_tensors(ck: Checkpoint, fmt: WeightFormat, num_layers: int, act_scales: dict | None,
             recipe: fp8.Recipe | None = None) -> dict:
    """The engine file's tensors; FP8: each fused linear (FUSED) quantized by `recipe` (its parts
    stored under their own names, the scale once per fused linear, "<linear>.w_scale"), with the
    static recipe's input scales `act_scales`."""
    import torch

    keep = torch.float32 if fmt is WeightFormat.FP32 else torch.bfloat16
    f32 = lambda name: torch.from_numpy(np.array(ck.tensors[name].float32()))
    out = {}
    for name in ck.tensors:
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) >= num_layers:
            continue
        if not (fmt is WeightFormat.FP8 and parts[0] == "layers" and parts[2] in LINEARS):
            out[name] = f32(name).to(keep).contiguous()
    if fmt is not WeightFormat.FP8:
        return out
    recipe = recipe or fp8.LEGACY
    for i in range(num_layers):
        for key, names in FUSED.items():
            parts = [f"layers.{i}.{n}" for n in names]
            w = torch.cat([f32(n) for n in parts])
            q, out[f"layers.{i}.{key}.w_scale"] = quantize_fp8(w, recipe, act_scales, f"layers.{i}.{key}")
            out.update(zip(parts, q.split([ck.tensors[n].shape[0] for n in parts])))
    if recipe.static:
        assert act_scales is not None, "a static FP8 recipe needs calibrated activation scales"
        out.update({k: torch.tensor(v, dtype=torch.float32) for k, v in act_scales.items()
                    if k.endswith(".act_scale") and int(k.split(".")[1]) < num_layers})
    return out


def quantize_fp8(w, recipe: fp8.Recipe, calibration: dict | None, linear: str):
    """A fused linear's [N, K] weight -> (float8 codes, scale) by `recipe`: rounded by GPTQ on its
    input's Hessian (buildlib/fp8_gptq.py) where the recipe says so and the calibration holds one
    ("<linear>.hessian": a target calibrated with `hessians`; another model's draft has none and
    rounds to nearest, which changes its acceptance, never the target's output), else to nearest."""
    h = (calibration or {}).get(f"{linear}.hessian") if recipe.gptq else None
    if h is None:
        return fp8.quantize_weight(w, recipe)
    from backend.buildlib import fp8_gptq

    return fp8_gptq.quantize_weight(w, recipe, h)
