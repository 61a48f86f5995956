"""The decoder of the model description (manifest.ModelConfig) in torch, for the GPU runtime
(torch_rt.py): the math of the ONNX graph (build/graph.py), RMSNorm, fused q/k/v (+ bias for
Qwen2), q/k norms per head (Gemma-3), rotary by position (the sliding layers' own base where the
model has one), GQA attention through the runtime's KV callback (q's multiplier cfg.scale, the
layer's sliding window, the scores' soft-cap), norms on the attention and MLP outputs (Gemma),
SwiGLU or GeGLU (tanh GELU), the scaled embedding, the final norm and the logits' soft-cap; an
EAGLE head first maps [embedding of x, target feature] through `fc`; an EAGLE-3 head
(`layers.0.hidden_norm`) takes the feature as its residual stream and attends over
[norm(embedding), norm(feature)]. A target with `feature_layers` appends those layers' inputs to
its features (EAGLE-3's, graph.py).

Weights come from an engine file the build wrote (build/torch_engine.py), canonical names as in
build/checkpoint.py, in one of three formats:
    fp32  float32 (the reference; CPU tests)
    bf16  bfloat16
    fp8   float8 E4M3 with a float32 scale per output channel ("<name>.scale"), and one float32
          scale per linear input ("layers.<i>.<qkv|o|gate_up|down>.act_scale", calibrated at
          build): y = (q8(x / s_x) s_x) (W8 s_w)^T. On a GPU with FP8 tensor cores
          torch._scaled_mm runs it in hardware; elsewhere (CPU, older GPUs) the same numbers
          are emulated in the compute dtype. The embedding, norms and LM head stay bf16/fp32.
On a CPU every linear pads its rows to a multiple of 8: this CPU's GEMM gives a row the same
bits at any M that is (measured), so a verify of T tokens matches T single steps.
Knows: tensors, layer math. Does not know: slots, trees, requests.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from backend.manifest import ModelConfig

FP8_MAX = 448.0
CPU_ROW_MULTIPLE = 8


class KVAccess(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' keys and values [N, Hkv, D] (rotary applied)."""

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Queries [N, Hq, D] (rotary applied, not scaled) -> attention output [N, Hq, D], with
        the model's scale and soft-cap and layer `layer`'s window (TorchModel.scale, .softcap,
        .windows)."""


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8 E4M3 weights, float32 scale per output channel)."""
    w = w.float()
    scale = (w.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def hardware_fp8(device: torch.device) -> bool:
    """torch._scaled_mm with per-row scales works here (Hopper/Ada and a recent torch)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, TypeError):
        return False


class Linear:
    """y = x W^T (+ b) in one weight format. `amax`: a list that collects max |x| (calibration)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 w_scale: torch.Tensor | None = None, act_scale: float | None = None, hw_fp8: bool = False):
        self.fp8 = w_scale is not None
        self.hw = self.fp8 and hw_fp8
        self.act_scale = act_scale
        self.bias = None if bias is None else bias.to(dtype)
        self.amax: list[float] | None = None
        if self.hw:
            self.w8, self.w_scale = w, w_scale.float().view(1, -1)
        elif self.fp8:
            self.w = (w.float() * w_scale.float()[:, None]).to(dtype)   # exact E4M3 values x scale
        else:
            self.w = w.to(dtype)
        self.pad = w.device.type == "cpu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.amax is not None:
            self.amax.append(float(x.abs().max()))
        if self.fp8:
            s = self.act_scale
            xq = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            if self.hw:
                y = torch._scaled_mm(xq, self.w8.t(), scale_a=torch.full((x.shape[0], 1), s, device=x.device),
                                     scale_b=self.w_scale, out_dtype=torch.bfloat16)
                return y if self.bias is None else y + self.bias
            x = (xq.float() * s).to(self.w.dtype)
        return linear_rows(x, self.w, self.bias, self.pad)


def linear_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, pad: bool) -> torch.Tensor:
    """F.linear, with the rows padded to a multiple of CPU_ROW_MULTIPLE where `pad` (CPU)."""
    n = x.shape[0]
    if pad and n % CPU_ROW_MULTIPLE:
        x = F.pad(x, (0, 0, 0, CPU_ROW_MULTIPLE - n % CPU_ROW_MULTIPLE))
        return F.linear(x, w, bias)[:n]
    return F.linear(x, w, bias)


class _Layer:
    def __init__(self, t, i: int, cfg: ModelConfig, dtype, hw_fp8: bool):
        def lin(names: list[str], key: str, bias: list[str] | None = None) -> Linear:
            w = torch.cat([t[f"layers.{i}.{n}"] for n in names])
            fp8 = f"layers.{i}.{names[0]}.scale" in t
            scale = torch.cat([t[f"layers.{i}.{n}.scale"] for n in names]) if fp8 else None
            act = float(t[f"layers.{i}.{key}.act_scale"]) if fp8 else None
            b = None
            if bias and f"layers.{i}.{bias[0]}" in t:
                b = torch.cat([t[f"layers.{i}.{n}"] for n in bias])
            return Linear(w, b, dtype, scale, act, hw_fp8)

        opt = lambda n: None if f"layers.{i}.{n}" not in t else t[f"layers.{i}.{n}"].to(dtype)
        self.attn_norm = opt("attn_norm")                  # absent in an EAGLE-1/2 head's layer
        self.hidden_norm = opt("hidden_norm")              # an EAGLE-3 head's feature norm
        self.mlp_norm = t[f"layers.{i}.mlp_norm"].to(dtype)
        # Gemma: norms of the attention's and the MLP's outputs (where the checkpoint has them,
        # as graph.py), and q/k norms per head (where the model description says so)
        self.post_attn_norm, self.post_mlp_norm = opt("post_attn_norm"), opt("post_mlp_norm")
        self.q_norm = t[f"layers.{i}.q_norm"].to(dtype) if cfg.qk_norm else None
        self.k_norm = t[f"layers.{i}.k_norm"].to(dtype) if cfg.qk_norm else None
        self.qkv = lin(["q", "k", "v"], "qkv", ["q_bias", "k_bias", "v_bias"] if cfg.attention_bias else None)
        self.o = lin(["o"], "o")
        self.gate_up = lin(["gate", "up"], "gate_up")
        self.down = lin(["down"], "down")

    def linears(self) -> dict[str, Linear]:
        return {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}


class TorchModel:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], num_layers: int,
                 device: torch.device, max_positions: int, dtype: torch.dtype | None = None,
                 feature_layers: tuple[int, ...] = ()):
        from backend.engine_format import rope_tables

        self.cfg = cfg
        self.feature_layers = tuple(feature_layers)
        self.device = device
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        t = {k: v.to(device) for k, v in tensors.items()}
        hw = hardware_fp8(device) and any(k.endswith(".scale") for k in t)
        self.hw_fp8 = hw
        self.layers = [_Layer(t, i, cfg, self.dtype, hw) for i in range(num_layers)]
        self.embed = t["embed"].to(self.dtype)
        self.norm = t["norm"].to(self.dtype) if "norm" in t else None     # absent: an EAGLE-1/2 head
        self.lm_head = t.get("lm_head", t["embed"]).to(self.dtype)
        self.fc = Linear(t["fc"], t["fc_bias"], self.dtype) if "fc" in t else None
        tab = lambda a: torch.from_numpy(a).to(device=device, dtype=torch.float32)
        self.rope = {False: tuple(map(tab, rope_tables(cfg, max_positions)))}        # (cos, sin)
        self.local = [cfg.local_rope(i) for i in range(num_layers)]
        if any(self.local):                      # the sliding layers' own base (Gemma-3)
            self.rope[True] = tuple(map(tab, rope_tables(cfg, max_positions, local=True)))
        # Gemma: sqrt(hidden), rounded to the compute dtype as transformers does (a device
        # tensor made here, not in a forward: a CUDA graph capture may not copy from the host)
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=self.dtype, device=device)
                            if cfg.embed_scale != 1.0 else None)
        self.scale = cfg.scale                   # q's multiplier, applied by the attention
        self.windows = [cfg.window(i) for i in range(num_layers)]     # the attention's, per layer
        self.softcap = cfg.attn_logit_softcap    # the attention scores' soft-cap (Gemma-2), 0: none

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if w is None:
            return x
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
                features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [N], positions [N] -> (the features the forward outputs [N, W], final-norm rows
        [N, H] for the LM head), compute dtype. W = H (1 + len(feature_layers)); an EAGLE-3
        head outputs its pre-norm residual stream."""
        cfg = self.cfg
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self.embed[ids]
        eagle3 = self.layers[0].hidden_norm is not None
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
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                aux[i] = x
            if eagle3:
                hn = torch.cat([self._rmsnorm(embeds, layer.attn_norm), self._rmsnorm(x, layer.hidden_norm)], -1)
            else:
                hn = self._rmsnorm(x, layer.attn_norm)
            qkv = layer.qkv(hn).view(-1, nh + 2 * nkv, d)
            q, k = qkv[:, :nh], qkv[:, nh:nh + nkv]
            if layer.q_norm is not None:         # per head, before rotary
                q, k = self._rmsnorm(q, layer.q_norm), self._rmsnorm(k, layer.k_norm)
            q = self._rope(q, positions, self.local[i])
            k = self._rope(k, positions, self.local[i])
            kv.write(i, k, qkv[:, nh + nkv:])
            o = kv.attend(i, q).reshape(-1, nh * d).to(self.dtype)
            x = x + self._rmsnorm(layer.o(o), layer.post_attn_norm)
            gu = layer.gate_up(self._rmsnorm(x, layer.mlp_norm))
            g, u = gu.split(cfg.intermediate_size, -1)
            a = F.gelu(g, approximate="tanh") if cfg.activation == "gelu_tanh" else F.silu(g)
            x = x + self._rmsnorm(layer.down(a * u), layer.post_mlp_norm)
        normed = self._rmsnorm(x, self.norm)
        if eagle3:
            return x, normed
        return torch.cat([normed] + [aux[j] for j in self.feature_layers], -1), normed

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, H] final-norm rows -> [R, V] float32 logits (soft-capped where the model is)."""
        logits = linear_rows(rows, self.lm_head, None, self.device.type == "cpu").float()
        cap = self.cfg.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def linears(self) -> dict[str, Linear]:
        return {f"layers.{i}.{k}": lin for i, layer in enumerate(self.layers) for k, lin in layer.linears().items()}


def load_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def numpy_of(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()
