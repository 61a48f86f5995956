"""The decoder of the model description in torch, for the GPU runtime (torch_rt.py): each layer's
program (manifest.ModelConfig.program, backend/program.py) run op by op (`_layer`), or, in the
invariant mode, by the fused kernels of plugins/fused.py after a peephole pass over the same ops
(`_fused_steps`); around the layers, the embedding (scaled where the model scales it), the final
norm and the logits' soft-cap. An EAGLE head first maps [embedding of x, target feature] through
`fc`; an EAGLE-3 head (`layers.0.hidden_norm`) takes the feature as its residual stream and its
program's input norm reads [norm(embedding), norm(feature)]. A target with `feature_layers`
appends those layers' inputs to its features (their programs' Features op; EAGLE-3's, graph.py).

Weights come from an engine file the build wrote (devices/cuda/export.py), canonical names as in
buildlib/checkpoint.py, in one of three formats:
    fp32  float32 (the reference; CPU tests)
    bf16  bfloat16
    fp8   float8 E4M3 by the engine's FP8 recipe (runtime/fp8.py, named in the file's metadata;
          files without one are per-channel weights and static per-tensor inputs): each fused
          linear's weight scale "layers.<i>.<qkv|o|gate_up|down>.w_scale" (older files: a scale
          per output channel "<name>.scale"), for the static recipe its calibrated input scale
          ".act_scale"; y = (q8(x / s_x) s_x) (W8 s_w)^T block by block. Where this GPU runs
          the recipe's scaled GEMM (probed at load against the emulation: hardware_fp8),
          torch._scaled_mm runs it; elsewhere (CPU, older GPUs, MX scales on Hopper) the same
          numbers are emulated in the compute dtype. In the invariant mode (the GPU's) every FP8
          linear runs W8A16 at decode and verify widths (issue 41, point 5): plugins/kernels.linear_w8
          reads the FP8 codes and block scales (the bits of the bf16 weights they stand for), the
          input unquantized, no input-quantization launch, a row's bits independent of M; the
          recipe's W8A8 runs only in a forward of `w8a8_from` nodes per row or more (prefill
          chunks; the width from which the build measured it faster on this GPU,
          devices/cuda/w8a8.py, else never) and only where the hardware GEMM runs it
          (torch._scaled_mm), since only there can it be faster. Elsewhere (the CPU's emulation, `specdec quality`) the recipe as
          built, input quantization included: on a GPU the decode's error is then that of the
          weights alone, at most the measured one. The embedding, norms and LM head stay
          bf16/fp32.
Batch invariance (a verify of T tokens gives the bits of T single steps; a CUDA graph's padded
bucket the bits of the eager step): on a GPU (`invariant`, the default there) every linear, the
LM head and every RMSNorm run the fixed-tile kernels of plugins/kernels.py (linear, rmsnorm),
since cuBLAS picks its GEMM by M; a linear's tiles and K splits come from its weight's shape and
the GPU's SM count (kernels.linear_plan), and the fused step reduces the split qkv, o and down
linears' partials in the kernels that read them (fused.rope_kv, fused.add_rmsnorm); the FP8 hardware GEMM (torch._scaled_mm) is the exception the
build's check reports. On a CPU every linear pads its rows to a multiple of 8: this CPU's GEMM
gives a row the same bits at any M that is (measured).
Knows: tensors, layer math. Does not know: slots, trees, requests.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from backend import program
from backend.manifest import ModelConfig
from backend.runtime import fp8

CPU_ROW_MULTIPLE = 8


class KVAccess(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' keys and values [N, Hkv, D] (rotary applied)."""

    def attend(self, layer: int, q: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Queries [N, Hq, D] (rotary applied, not scaled) -> attention output [N, Hq, D], with
        the model's scale and soft-cap and layer `layer`'s window (TorchModel.scale, .softcap,
        .windows); float32, or `dtype`."""

    # A callback whose `fused` is true also gives cache(layer) -> (k cache, v cache [S, Hkv, L,
    # D], the new tokens' slots, columns [N]): the fused forward writes k and v there itself.


def _hw_kind(rec: fp8.Recipe) -> str | None:
    """Which torch._scaled_mm form runs `rec`: "rowwise" (per-channel weights, per-tensor or
    per-token inputs), "block128" (128 x 128 weights, 1 x 128 inputs), None (emulated only)."""
    if rec.weight_block == (1, 0) and rec.inputs in ("tensor", "token"):
        return "rowwise"
    if rec.weight_block == (128, 128) and rec.inputs == "group" and rec.group == 128 and not rec.pow2:
        return "block128"
    return None


_PROBED: dict[tuple[str, str], bool] = {}
# The GPU check's dry run (benchmarks/gpu_check.py) sets this so that a CPU runs the hardware FP8
# GEMM's code where this CPU's torch has torch._scaled_mm for the recipe's form: the GPU's path,
# run for its coverage; nothing else sets it (on a CPU the emulation is the faster path).
SCALED_MM_ON_CPU = False


def hardware_fp8(device: torch.device, rec: fp8.Recipe = fp8.LEGACY) -> bool:
    """Whether torch._scaled_mm runs `rec` on this GPU and gives the emulation's numbers
    (probe_scaled_mm, once per device and form); never on a CPU (where the emulation is faster),
    unless SCALED_MM_ON_CPU."""
    kind = _hw_kind(rec)
    if (device.type != "cuda" and not SCALED_MM_ON_CPU) or kind is None:
        return False
    if (str(device), kind) not in _PROBED:
        _PROBED[(str(device), kind)] = probe_scaled_mm(device, rec)
    return _PROBED[(str(device), kind)]


def probe_scaled_mm(device: torch.device, rec: fp8.Recipe) -> bool:
    """Linear's torch._scaled_mm path for `rec` on `device` against the emulation: a 256 x 384
    product at 1 and 20 rows within 1e-2 relative (the same bf16 input); False where it raises
    (no such kernel here)."""
    if _hw_kind(rec) is None:
        return False
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(256, 384, generator=g, device=device)
    try:
        lin = Linear(*fp8.quantize_weight(w, rec), None, torch.bfloat16, rec, act_scale=0.01, hw=True)
        emu = Linear(*fp8.quantize_weight(w, rec), None, torch.float32, rec, act_scale=0.01, hw=False)
        for m in (1, 20):
            x = torch.randn(m, 384, generator=g, device=device).to(torch.bfloat16)
            y, ref = lin(x).float(), emu(x.float())
            if not bool(((y - ref).norm() / ref.norm()) < 1e-2):
                return False
        return True
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


class Linear:
    """y = x W^T (+ b) in one weight format: plain (w_scale None) or FP8 by `recipe` (w: float8
    [N, K], w_scale its block scales, act_scale the static recipe's input scale; `quantize_input`
    False: weight-only). `hw`: torch._scaled_mm (the model decides per recipe, hardware_fp8).
    `observe`: a callable given each input (the build's calibration)."""

    def __init__(self, w: torch.Tensor, w_scale: torch.Tensor | None, bias: torch.Tensor | None,
                 dtype: torch.dtype, recipe: fp8.Recipe | None = None, act_scale: float | None = None,
                 quantize_input: bool = True, hw: bool = False):
        self.fp8 = w_scale is not None
        self.recipe = recipe or fp8.LEGACY
        self.qin = self.fp8 and quantize_input
        self.act_scale = act_scale
        self.n = w.shape[0]
        self.bias = None if bias is None else bias.to(dtype)
        self.observe = None
        self.dtype = dtype
        self._w = None
        # FP8: (codes, block scales) for kernels.linear_w8 (W8A16); the compute dtype's weights
        # are dequantized from them on first use by a path that needs them (self.w)
        self.wq = (w, w_scale.float()) if self.fp8 else None
        self.hw = _hw_kind(self.recipe) if self.qin and hw else None
        if self.hw == "rowwise":
            self.w8, self.w_scale = w, w_scale.float().view(1, -1)
        elif self.hw == "block128":    # K and N padded to whole blocks (zeros add nothing; the
            pn, pk = -w.shape[0] % 128, -w.shape[1] % 128       # scales already cover them)
            self.w8 = w if not (pn or pk) else \
                torch.nn.functional.pad(w.view(torch.uint8), (0, pk, 0, pn)).view(torch.float8_e4m3fn)
            self.w_scale = w_scale.float().t()     # [K/128, N/128], as cuBLAS's 128 x 128 scaling reads it
        elif not self.fp8:
            self.w = w.to(dtype)
        self.pad = w.device.type == "cpu"
        self.kernel = False                  # plugins/kernels.linear (TorchModel.invariant sets it)

    @property
    def w(self) -> torch.Tensor | None:
        """The weights in the compute dtype (a weight-only FP8 linear's: dequantized once, when a
        path other than kernels.linear_w8 first needs them; None for the hardware FP8 GEMM's)."""
        if self._w is None and self.wq is not None:
            self._w = fp8.dequantize_weight(*self.wq, self.recipe).to(self.dtype)
        return self._w

    @w.setter
    def w(self, value: torch.Tensor) -> None:
        self._w = value

    def __call__(self, x: torch.Tensor, reduce: bool = True, wide: bool = False):
        """y = x W^T (+ b); `reduce` False: where the invariant kernels split K (kernels.linear_plan),
        their partials (kernels.Partials, which fused.add_rmsnorm and fused.rope_kv reduce);
        `wide`: a prefill-sized forward (TorchModel.w8a8_from), where the hardware W8A8 GEMM runs."""
        if self.observe is not None:
            self.observe(x)
        if self.hw and (wide or not self.kernel):
            y = self._scaled_mm(x)
            return y if self.bias is None else y + self.bias
        if self.kernel:
            from plugins import kernels

            if self.wq is not None:          # W8A16: the weights cross memory as float8, x unquantized
                return kernels.linear_w8(x.to(self.dtype), *self.wq, self.recipe.weight_block, self.bias, reduce)
            return kernels.linear(x.to(self.w.dtype), self.w, self.bias, reduce)
        if self.qin:
            x = fp8.fake_quant_input(x, self.recipe, self.act_scale).to(self.w.dtype)
        return linear_rows(x, self.w, self.bias, self.pad)

    def w8a16(self, wide: bool) -> bool:
        """Whether a call runs kernels.linear_w8 (so gate_up's fused epilogue may read the codes)."""
        return self.kernel and self.wq is not None and not (self.hw and wide)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.hw == "block128":
            x = torch.nn.functional.pad(x, (0, self.w8.shape[1] - x.shape[1]))
        xq, s = fp8.quantize_input(x, self.recipe, self.act_scale)
        if self.hw == "rowwise":
            s = s.expand(x.shape[0], 1).contiguous()
        else:                                    # 1 x 128 input scales outer-dim-major (cuBLAS)
            s = s.t().contiguous().t()
        y = torch._scaled_mm(xq, self.w8.t(), scale_a=s, scale_b=self.w_scale, out_dtype=torch.bfloat16)
        return y[:, : self.n]


def linear_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, pad: bool) -> torch.Tensor:
    """F.linear, with the rows padded to a multiple of CPU_ROW_MULTIPLE where `pad` (CPU)."""
    n = x.shape[0]
    if pad and n % CPU_ROW_MULTIPLE:
        x = F.pad(x, (0, 0, 0, CPU_ROW_MULTIPLE - n % CPU_ROW_MULTIPLE))
        return F.linear(x, w, bias)[:n]
    return F.linear(x, w, bias)


class _Layer:
    """Layer i's program (manifest.ModelConfig.program) and the tensors its ops read: the linears
    by name, the norms by weight name (None: absent from the file, an EAGLE-1/2 head's input norm)."""

    def __init__(self, t, i: int, ops: tuple, dtype, recipe: fp8.Recipe, hw_fp8: bool):
        self.ops = ops
        self.attention = program.attention(ops)           # its window, soft-cap, q's scale
        def lin(op: program.Linear) -> Linear:
            w = torch.cat([t[f"layers.{i}.{n}"] for n in op.parts])
            b = None
            if op.bias and f"layers.{i}.{op.bias_parts[0]}" in t:
                b = torch.cat([t[f"layers.{i}.{n}"] for n in op.bias_parts])
            if w.dtype != torch.float8_e4m3fn:
                return Linear(w, None, b, dtype)
            name = f"layers.{i}.{op.name}"
            scale = t.get(f"{name}.w_scale")
            if scale is None:                    # an engine file of before recipes: per channel
                scale = torch.cat([t[f"layers.{i}.{n}.scale"] for n in op.parts]).view(-1, 1)
            assert tuple(scale.shape) == fp8.scale_shape(tuple(w.shape), recipe.weight_block), \
                f"{name}: weight scale {tuple(scale.shape)} is not recipe {recipe.name}'s"
            act = float(t[f"{name}.act_scale"]) if recipe.static else None
            return Linear(w, scale, b, dtype, recipe, act, recipe.quantizes_input(name), hw_fp8)

        self.linear = {op.name: lin(op) for op in ops if isinstance(op, program.Linear)}
        self.norms = {n: t[f"layers.{i}.{n}"].to(dtype) if f"layers.{i}.{n}" in t else None
                      for n in sorted(program.norms(ops))}
        head = next((op for op in ops if isinstance(op, program.HeadNorm)), None)
        # q's and k's norms [2, D] as plugins/fused.py's rope_kv reads them
        self.qk_norm = torch.stack([self.norms[head.q], self.norms[head.k]]) if head else None
        self.fused = _fused_steps(self)

    def linears(self) -> dict[str, Linear]:
        return dict(self.linear)


def _fused_steps(layer: _Layer) -> list[tuple] | None:
    """The peephole pass over a layer's program for the fused GPU step (plugins/fused.py), or None
    where the program has a sequence the fused kernels do not take (the model then runs unfused):
    a Residual's add waits for the next Norm's kernel (fused.add_rmsnorm; a Features op taps x
    there), q/k norms and rotary go into the k/v write (fused.rope_kv), a Linear before a Gate is
    fused.gate_up_act. `h` tracks what the value is: "x" (the stream, its last add pending), a
    linear's output (maybe split partials), or rows of the compute dtype."""
    steps, ops, h, tap, head, table = [], layer.ops, "x", False, None, None
    j = 0
    while j < len(ops):
        op = ops[j]
        if isinstance(op, program.Features) and not tap:
            tap = True
        elif isinstance(op, program.Norm) and h == "x" and op.feature is None:
            steps.append(("norm", layer.norms[op.weight], tap))
            tap, h = False, "rows"
        elif isinstance(op, program.Linear) and h == "rows":
            if j + 1 < len(ops) and isinstance(ops[j + 1], program.Gate):
                steps.append(("gated", layer.linear[op.name], ops[j + 1].act))
                j, h = j + 1, "rows"
            else:
                steps.append(("linear", layer.linear[op.name]))
                h = "linear"
        elif isinstance(op, program.HeadNorm) and h == "linear" and head is None and table is None:
            head = layer.qk_norm
        elif isinstance(op, program.Rope) and h == "linear" and table is None:
            table = op.table
        elif isinstance(op, program.Attention) and h == "linear" and table is not None:
            steps.append(("attend", head, table == "local"))
            h = "rows"
        elif isinstance(op, program.Residual) and h in ("rows", "linear") and not op.parallel:
            steps.append(("residual", layer.norms[op.norm] if op.norm else None))
            h = "x"
        else:
            return None
        j += 1
    return steps if h == "x" and not tap else None


class TorchModel:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], num_layers: int,
                 device: torch.device, max_positions: int, dtype: torch.dtype | None = None,
                 feature_layers: tuple[int, ...] = (), fp8_recipe: fp8.Recipe | None = None):
        """fp8_recipe: how an FP8 engine's linears are scaled (the file's; None: the legacy
        per-channel, static per-tensor recipe)."""
        from backend.engine_format import rope_tables

        self.cfg = cfg
        self.feature_layers = tuple(feature_layers)
        self.device = device
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        t = {k: v.to(device) for k, v in tensors.items()}
        self.fp8_recipe = fp8_recipe or fp8.LEGACY
        self.hw_fp8 = any(v.dtype == torch.float8_e4m3fn for v in t.values()) and hardware_fp8(device, self.fp8_recipe)
        # an EAGLE-3 head (its feature norm): the residual stream is the feature, attention reads
        # [norm(embedding), norm(feature)]
        self.eagle3 = "layers.0.hidden_norm" in t
        programs = cfg.programs(num_layers, self.feature_layers, self.eagle3)
        self.layers = [_Layer(t, i, ops, self.dtype, self.fp8_recipe, self.hw_fp8) for i, ops in enumerate(programs)]
        self.embed = t["embed"].to(self.dtype)
        self.norm = t["norm"].to(self.dtype) if "norm" in t else None     # absent: an EAGLE-1/2 head
        self.lm_head = t.get("lm_head", t["embed"]).to(self.dtype)
        self.fc = Linear(t["fc"], None, t["fc_bias"], self.dtype) if "fc" in t else None
        tab = lambda a: torch.from_numpy(a).to(device=device, dtype=torch.float32)
        self.rope = {False: tuple(map(tab, rope_tables(cfg, max_positions)))}        # (cos, sin)
        if any(program.Rope("local") in layer.ops for layer in self.layers):   # the sliding layers' own base (Gemma-3)
            self.rope[True] = tuple(map(tab, rope_tables(cfg, max_positions, local=True)))
        # Gemma: sqrt(hidden), rounded to the compute dtype as transformers does (a device
        # tensor made here, not in a forward: a CUDA graph capture may not copy from the host)
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=self.dtype, device=device)
                            if cfg.embed_scale != 1.0 else None)
        # nodes per row from which a forward is prefill-sized: input-quantizing FP8 linears run the
        # hardware W8A8 GEMM there (None: W8A16 at every width); the engine file's, as its build
        # measured it (devices/cuda/w8a8.py; load_w8a8_from), above the largest graph bucket
        self.w8a8_from: int | None = None
        self.invariant = device.type == "cuda"
        self.fused = True                        # the invariant mode's fused kernels (plugins/fused.py)

    @property
    def invariant(self) -> bool:
        """Linears, LM head and norms by the fixed-tile kernels (a row's bits independent of M)."""
        return self._invariant

    @invariant.setter
    def invariant(self, on: bool) -> None:
        self._invariant = bool(on)
        for lin in [*self.linears().values(), *([self.fc] if self.fc is not None else [])]:
            lin.kernel = self._invariant

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if w is None:
            return x
        if self._invariant:
            from plugins import kernels

            return kernels.rmsnorm(x.to(self.dtype), w, self.cfg.rms_norm_eps)
        xf = x.float()
        xf = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return xf.to(self.dtype) * w

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, local: bool = False) -> torch.Tensor:
        """HF rotate_half on [N, H, D] at positions [N], in float32 (local: the sliding layers'
        tables)."""
        cos, sin = self.rope[local]
        cos, sin = cos[positions][:, None], sin[positions][:, None]
        x = x.float()
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: KVAccess,
                features: torch.Tensor | None = None, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [N], positions [N] -> (the features the forward outputs [N, W], final-norm rows
        [N, H] for the LM head), compute dtype. W = H (1 + len(feature_layers)); an EAGLE-3
        head outputs its pre-norm residual stream. `wide`: a prefill-sized forward (w8a8_from)."""
        if self._fusable(kv):
            return self._forward_fused(ids, positions, kv, wide)
        x = self.embed[ids]
        eagle3 = self.eagle3
        if eagle3 or self.fc is not None:
            assert features is not None, "an EAGLE head needs the target's features"
        elif self.embed_scale is not None:
            x = x * self.embed_scale
        embeds = x
        if eagle3:
            x = features.to(self.dtype)
        elif self.fc is not None:
            x = self.fc(torch.cat([x, features.to(self.dtype)], -1))
        aux = {}
        for i in range(len(self.layers)):
            x = self._layer(i, x, embeds if eagle3 else None, positions, kv, wide, aux)
        normed = self._rmsnorm(x, self.norm)
        if eagle3:
            return x, normed
        return torch.cat([normed] + [aux[j] for j in self.feature_layers], -1), normed

    def _fusable(self, kv) -> bool:
        """The fused kernels run a forward in the invariant mode where the KV callback gives its
        cache (torch_rt's, with the kernels on) and the model is a target (no EAGLE input)."""
        return (self._invariant and self.fused and getattr(kv, "fused", False) and self.fc is None
                and not self.eagle3 and self.norm is not None and all(layer.fused for layer in self.layers))

    def _forward_fused(self, ids, positions, kv, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """forward by plugins/fused.py: each sublayer's residual add waits for the next norm's
        kernel (`pending`: the sublayer's output and its post norm)."""
        from plugins import fused

        x = fused.embed(self.embed, ids, self.embed_scale)
        pending, aux = None, {}
        for i in range(len(self.layers)):
            x, pending = self._fused_layer(i, x, pending, positions, kv, aux, wide)
        _, normed = fused.add_rmsnorm(x, self.norm, self.cfg.rms_norm_eps, *pending)
        if not self.feature_layers:
            return normed, normed
        return torch.cat([normed] + [aux[j] for j in self.feature_layers], -1), normed

    def _fused_layer(self, i: int, x: torch.Tensor, pending, positions: torch.Tensor, kv, aux: dict,
                     wide: bool = False):
        """Layer i by its fused steps (_fused_steps: 8 launches for a Llama or Gemma layer) -> (its
        input x, its last residual (the value, its norm) still to add)."""
        from plugins import fused

        cfg, layer, eps = self.cfg, self.layers[i], self.cfg.rms_norm_eps
        h = None
        for kind, *arg in layer.fused:
            if kind == "norm":
                x, h = fused.add_rmsnorm(x, arg[0], eps, *(pending or ()))
                pending = None
                if arg[1]:
                    aux[i] = x
            elif kind == "linear":
                h = arg[0](h, False, wide)
            elif kind == "gated":
                h = self._gated(arg[0], arg[1], h, wide)
            elif kind == "attend":
                k_cache, v_cache, wslot, wcol = kv.cache(i)
                q = fused.rope_kv(h, positions, *self.rope[arg[1]], arg[0], eps, cfg.num_heads, cfg.num_kv_heads,
                                  k_cache, v_cache, wslot, wcol)
                h = kv.attend(i, q, self.dtype).reshape(-1, cfg.num_heads * cfg.head_dim)
            else:                                             # "residual"
                pending = (h, arg[0])
        return x, pending

    def _gated(self, lin: Linear, act: str, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        """act(gate) * up of the gate_up linear: its epilogue (plugins/fused.py) where the linear
        runs the invariant kernels, else the torch ops."""
        gelu = act == "gelu_tanh"
        if lin.w8a16(wide) or (lin.kernel and not lin.fp8):
            from plugins import fused

            if lin.wq is not None:
                return fused.gate_up_act(x, lin.wq[0], gelu, lin.wq[1], lin.recipe.weight_block)
            return fused.gate_up_act(x, lin.w, gelu)
        g, u = lin(x, wide=wide).split(lin.n // 2, -1)
        return (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u

    def head(self, normed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """A step's final-norm rows [B, T, H] and the nodes to read [B, R] -> logits [B, R, V]
        float32 (the LM head kernel gathers them where the forward is fused)."""
        b, t = normed.shape[:2]
        if self._invariant and self.fused:
            from plugins import fused

            return fused.lm_head(normed.reshape(b * t, -1), index, t, self.lm_head, self.cfg.final_logit_softcap)
        rows = normed[torch.arange(b, device=normed.device)[:, None], index]
        return self.logits(rows.reshape(-1, rows.shape[-1])).view(b, index.shape[1], -1)

    def _layer(self, i: int, x: torch.Tensor, embeds: torch.Tensor | None, positions: torch.Tensor,
               kv: KVAccess, wide: bool = False, aux: dict | None = None) -> torch.Tensor:
        """Layer i's program on the residual stream x -> the next x (embeds: an EAGLE-3 head's;
        aux: the feature outputs, at a Features op)."""
        layer, h, pending = self.layers[i], x, None
        for op in layer.ops:
            if isinstance(op, program.Features):
                aux[i] = x
            elif isinstance(op, program.Norm):
                if op.feature:              # EAGLE-3: [norm(embedding), norm(feature)]
                    h = torch.cat([self._rmsnorm(embeds, layer.norms[op.weight]),
                                   self._rmsnorm(h, layer.norms[op.feature])], -1)
                else:
                    h = self._rmsnorm(h, layer.norms[op.weight])
            elif isinstance(op, program.Linear):
                h = layer.linear[op.name](h, wide=wide)
            elif isinstance(op, program.HeadNorm):        # per head, before rotary
                q, k, v = self._heads(h)
                h = (self._rmsnorm(q, layer.norms[op.q]), self._rmsnorm(k, layer.norms[op.k]), v)
            elif isinstance(op, program.Rope):
                q, k, v = self._heads(h)
                local = op.table == "local"
                h = (self._rope(q, positions, local), self._rope(k, positions, local), v)
            elif isinstance(op, program.Attention):
                q, k, v = self._heads(h)
                kv.write(i, k, v)
                h = kv.attend(i, q).reshape(-1, self.cfg.num_heads * self.cfg.head_dim).to(self.dtype)
            elif isinstance(op, program.Gate):
                g, u = h.split(h.shape[-1] // 2, -1)
                h = (F.gelu(g, approximate="tanh") if op.act == "gelu_tanh" else F.silu(g)) * u
            else:                                         # Residual
                t = self._rmsnorm(h, layer.norms[op.norm]) if op.norm else h
                if op.parallel:
                    pending = t
                else:
                    x = (x if pending is None else x + pending) + t
                    pending = None
                h = x
        return x

    def _heads(self, h) -> tuple:
        """q [N, Hq, D], k and v [N, Hkv, D] of q/k/v rows h [N, (Hq + 2 Hkv) D] (as they are
        where h is already split)."""
        if isinstance(h, tuple):
            return h
        nh, nkv = self.cfg.num_heads, self.cfg.num_kv_heads
        qkv = h.view(-1, nh + 2 * nkv, self.cfg.head_dim)
        return qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, H] final-norm rows -> [R, V] float32 logits (soft-capped where the model is)."""
        if self._invariant:
            from plugins import kernels

            logits = kernels.linear(rows.to(self.dtype), self.lm_head).float()
        else:
            logits = linear_rows(rows, self.lm_head, None, self.device.type == "cpu").float()
        cap = self.cfg.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def linears(self) -> dict[str, Linear]:
        return {f"layers.{i}.{k}": lin for i, layer in enumerate(self.layers) for k, lin in layer.linears().items()}


def load_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def load_recipe(path) -> fp8.Recipe | None:
    """The FP8 recipe an engine file names in its metadata (devices/cuda/export.py), or None."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    return fp8.Recipe.from_json(json.loads(meta["fp8_recipe"])) if "fp8_recipe" in meta else None


def load_w8a8_from(path) -> int | None:
    """From which forward width an FP8 engine file runs W8A8, as its build measured it on its GPU
    (devices/cuda/w8a8.py; metadata "w8a8_from"); None (W8A16 at every width) where the file says
    so or predates the measurement. A width a decode or verify step can have is refused: there a
    verify would run other linears than the single steps it stands for."""
    import json

    from safetensors import safe_open

    from backend.runtime.step_graph import WIDTH_BUCKETS

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    width = json.loads(meta["w8a8_from"]) if "w8a8_from" in meta else None
    if width is not None and (not isinstance(width, int) or width <= WIDTH_BUCKETS[-1]):
        raise ValueError(f"{path}: w8a8_from {width!r} is a decode or verify width (<= {WIDTH_BUCKETS[-1]}): "
                         "rebuild the engine")
    return width


def numpy_of(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()
