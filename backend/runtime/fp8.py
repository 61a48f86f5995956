"""FP8 E4M3 recipes: how a linear's weights and its input are scaled into float8 and back.

A recipe is one of RECIPES (fastest first on a Hopper GPU), plus the linears it leaves
weight-only. Every scale is amax / 448 over its block (448: E4M3's largest finite value):

    channel-tensor  weights: a scale per output channel; input: one static scale per tensor,
                    calibrated at build (amax over the calibration prompts)
    channel-token   weights per output channel; input: a dynamic scale per token (row), as vLLM's
                    FP8_DYNAMIC (llm-compressor) scheme
    block128        weights per 128 x 128 block; input: a dynamic scale per 1 x 128 group of a
                    row, DeepSeek-V3's recipe (TensorRT-LLM's block scaling, DeepGEMM)
    g32-token       weights per 1 x 32 group of a row (float scales); input per token; no FP8
                    GEMM on Hopper takes 1 x 32 weight scales: emulated there
    mx32            weights and input per 1 x 32 group, scales rounded up to powers of two (the
                    OCP MX format's E8M0 scales); Hopper has no MX tensor cores: emulated there

`weight_only`: linears ("layers.<i>.<qkv|o|gate_up|down>") whose weights are FP8 by the recipe
but whose input stays in the compute dtype (the build's per-linear check sends the linears that
lose most there). `gptq`: the weights' codes were rounded by GPTQ on calibration inputs
(buildlib/fp8_gptq.py) instead of to nearest: the same layout, so nothing here reads it. Embedding, norms and LM head are never FP8 (devices/cuda/export.py).

A weight's scale is stored [ceil(N / rows), ceil(K / cols)] (per channel: [N, 1]), computed on
the fused matrix the runtime multiplies (q|k|v, gate|up), so the torch runtime, the engine graph
and a block-scaled GEMM see the same blocks. The same numbers run three ways: quantize then
dequantize in the compute dtype (CPU, the quality measurement: torch's float8_e4m3fn casts round
to nearest even and are exact), torch's scaled matmuls on a GPU with FP8 tensor cores
(torch_model.Linear), Q/DQ in the engine graph (buildlib/graph.py).
torch is imported where a function needs it: the recipes' names are read without it (the CLI).
Knows: scales, E4M3, recipes. Does not know: models, files, which recipe a build chose.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

FP8_MAX = 448.0
TINY = 1e-12                      # the smallest scale: an all-zero block quantizes to zeros


@dataclass(frozen=True)
class Recipe:
    name: str
    weight_block: tuple[int, int]     # (rows, columns) sharing a weight scale; columns 0: a whole row
    inputs: str                       # "tensor" (static, calibrated) | "token" | "group" (dynamic)
    group: int = 0                    # columns of an input group ("group")
    pow2: bool = False                # scales rounded up to powers of two (MX's E8M0)
    weight_only: tuple[str, ...] = ()   # linears whose input is not quantized
    gptq: bool = False                # weights rounded by GPTQ (buildlib/fp8_gptq.py), not to nearest

    INPUTS = ("tensor", "token", "group")

    def __post_init__(self):
        assert self.inputs in self.INPUTS, self.inputs
        assert self.inputs != "group" or self.group > 0, (self.inputs, self.group)

    @property
    def static(self) -> bool:
        """Whether inputs need calibrated scales (buildlib/calibration.calibrate)."""
        return self.inputs == "tensor"

    def quantizes_input(self, linear: str) -> bool:
        return linear not in self.weight_only

    def with_weight_only(self, linears) -> "Recipe":
        return dataclasses.replace(self, weight_only=tuple(sorted(linears, key=_linear_order)))

    def with_gptq(self, on: bool = True) -> "Recipe":
        return dataclasses.replace(self, gptq=on)

    @property
    def label(self) -> str:
        """The name, with GPTQ rounding and the weight-only linears counted ("block128+gptq+wo3")."""
        return self.name + ("+gptq" if self.gptq else "") + (f"+wo{len(self.weight_only)}" if self.weight_only else "")

    def to_json(self) -> dict:
        return {"name": self.name, "weight_block": list(self.weight_block), "inputs": self.inputs,
                "group": self.group, "pow2": self.pow2, "weight_only": list(self.weight_only), "gptq": self.gptq}

    @classmethod
    def from_json(cls, d: dict) -> "Recipe":
        return cls(d["name"], tuple(d["weight_block"]), d["inputs"], d.get("group", 0), d.get("pow2", False),
                   tuple(d.get("weight_only", ())), d.get("gptq", False))


RECIPES = (Recipe("channel-tensor", (1, 0), "tensor"),
           Recipe("channel-token", (1, 0), "token"),
           Recipe("block128", (128, 128), "group", 128),
           Recipe("g32-token", (1, 32), "token"),
           Recipe("mx32", (1, 32), "group", 32, pow2=True))
BY_NAME = {r.name: r for r in RECIPES}
# engine files written before recipes existed: per-channel weights, static per-tensor inputs
LEGACY = BY_NAME["channel-tensor"]


def recipe(name: str) -> Recipe:
    """A recipe by name; "<name>+gptq": its weights rounded by GPTQ."""
    base, plus, extra = name.partition("+")
    if base not in BY_NAME or (plus and extra != "gptq"):
        raise ValueError(f"unknown FP8 recipe {name!r}; known: {', '.join(BY_NAME)} (each also as <name>+gptq)")
    return BY_NAME[base].with_gptq(bool(plus))


def _linear_order(name: str):
    parts = name.split(".")
    return (int(parts[1]), parts[2]) if len(parts) == 3 and parts[1].isdigit() else (1 << 30, name)


def _scale(amax, pow2: bool):
    import torch

    s = (amax.float() / FP8_MAX).clamp(min=TINY)
    return torch.exp2(torch.ceil(torch.log2(s))) if pow2 else s


def _cast(x, scale):
    import torch

    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _blocks(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """(rows, columns) of one block of a [N, K] matrix; columns 0 (a whole row) -> K."""
    return block[0], block[1] or shape[1]


def _expand(scale: Tensor, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    """A [ceil(N/r), ceil(K/c)] block scale -> [N, K] (each element's scale)."""
    r, c = _blocks(shape, block)
    return scale.repeat_interleave(r, 0)[: shape[0]].repeat_interleave(c, 1)[:, : shape[1]]


def _amax_blocks(x, block: tuple[int, int]):
    """max |x| over each (r, c) block of [N, K] x -> [ceil(N/r), ceil(K/c)] (a ragged last
    block counts its own elements)."""
    n, k = x.shape
    r, c = _blocks((n, k), block)
    pn, pk = -n % r, -k % c
    import torch

    a = torch.nn.functional.pad(x.float().abs(), (0, pk, 0, pn))
    return a.view((n + pn) // r, r, (k + pk) // c, c).amax((1, 3))


def quantize_weight(w: Tensor, rec: Recipe) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (float8 E4M3 [N, K], float32 scale [ceil(N/r), ceil(K/c)])."""
    scale = _scale(_amax_blocks(w, rec.weight_block), rec.pow2)
    return _cast(w, _expand(scale, tuple(w.shape), rec.weight_block)), scale


def dequantize_weight(q: Tensor, scale: Tensor, rec: Recipe) -> Tensor:
    """The float32 values the FP8 weights stand for: q * scale, block by block."""
    return q.float() * _expand(scale.float(), tuple(q.shape), rec.weight_block)


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The weight scale's shape for an [N, K] weight in `block`s: [ceil(N/r), ceil(K/c)]."""
    r, c = _blocks(shape, block)
    return (-(-shape[0] // r), -(-shape[1] // c))


def input_scale(x, rec: Recipe, static: float | None = None):
    """The scale of [M, K] input x: per tensor (the calibrated `static`) [1, 1], per token
    [M, 1], per group [M, ceil(K/G)]."""
    if rec.inputs == "tensor":
        import torch

        assert static is not None, "a static per-tensor recipe needs the calibrated input scale"
        return torch.full((1, 1), static, dtype=torch.float32, device=x.device)
    if rec.inputs == "token":
        return _scale(x.float().abs().amax(1, keepdim=True), rec.pow2)
    return _scale(_amax_blocks(x, (1, rec.group)), rec.pow2)


def quantize_input(x: Tensor, rec: Recipe, static: float | None = None) -> tuple[Tensor, Tensor]:
    """[M, K] -> (float8 [M, K], float32 scale: [1, 1] | [M, 1] | [M, ceil(K/G)])."""
    s = input_scale(x, rec, static)
    full = s if rec.inputs != "group" else _expand(s, tuple(x.shape), (1, rec.group))
    return _cast(x, full), s


def dequantize_input(q: Tensor, scale: Tensor, rec: Recipe) -> Tensor:
    if rec.inputs == "group":
        return q.float() * _expand(scale, tuple(q.shape), (1, rec.group))
    return q.float() * scale


def fake_quant_input(x: Tensor, rec: Recipe, static: float | None = None) -> Tensor:
    """x as the FP8 GEMM sees it (float32): quantized by the recipe, then dequantized."""
    return dequantize_input(*quantize_input(x, rec, static), rec)
