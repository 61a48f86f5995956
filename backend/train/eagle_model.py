"""The EAGLE-style draft head in torch (training only; serving runs its ONNX export).

Input at position t: the target's final-norm feature f_t and the embedding of the next token
x_{t+1}; an FC layer fuses them (EAGLE, Li et al. 2024, arXiv:2401.15077), one Llama decoder
layer with the target's dimensions runs over the sequence (causal / tree attention, its own KV
cache at serve time), a final RMSNorm gives the predicted feature f^_{t+1}, and the target's
frozen LM head restricted to the draft vocabulary (FR-Spec, Zhao et al. 2025) gives logits for
x_{t+2}. The same math is emitted as ONNX by build/graph.py (GraphSpec.eagle).

`Eagle3Head` is EAGLE-3 (Li et al. 2025, arXiv:2503.01840): its input feature is fc(the target's
low, middle and high layer features) [3H -> H] at the first step and its own pre-norm output
after; that feature is the residual stream, the attention reads [norm(embedding of x_{t+1}),
norm(feature)]; its own LM head (initialised from the target's rows) gives the logits. It is
saved in the layout the EAGLE-3 reference publishes (build/heads/formats.py reads it).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

LAYER_KEYS = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class EagleHead(nn.Module):
    def __init__(self, cfg: dict, embed: np.ndarray, head_rows: np.ndarray, cos: np.ndarray,
                 sin: np.ndarray):
        super().__init__()
        h, nh, nkv, d, f = (cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"],
                            cfg["head_dim"], cfg["intermediate_size"])
        self.nh, self.nkv, self.d = nh, nkv, d
        eps = cfg["rms_norm_eps"]
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.attn_norm, self.mlp_norm, self.final_norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.q = nn.Linear(h, nh * d, bias=False)
        self.k = nn.Linear(h, nkv * d, bias=False)
        self.v = nn.Linear(h, nkv * d, bias=False)
        self.o = nn.Linear(nh * d, h, bias=False)
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)
        frozen = lambda a: torch.from_numpy(np.array(a, np.float32))              # copies
        self.register_buffer("embed", frozen(embed), persistent=False)
        self.register_buffer("head", frozen(head_rows), persistent=False)
        self.register_buffer("cos", frozen(cos), persistent=False)
        self.register_buffer("sin", frozen(sin), persistent=False)

    def _rope(self, x, positions):                      # x [B, T, n, D], positions [B, T]
        c = self.cos[positions][:, :, None, :]
        s = self.sin[positions][:, :, None, :]
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def _attend(self, hn, positions, mask):
        """The layer's attention over its (normed) input hn [B,T,*] -> [B,T,H]."""
        b, t, _ = hn.shape
        q = self._rope(self.q(hn).view(b, t, self.nh, self.d), positions).transpose(1, 2)
        k = self._rope(self.k(hn).view(b, t, self.nkv, self.d), positions).transpose(1, 2)
        v = self.v(hn).view(b, t, self.nkv, self.d).transpose(1, 2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / np.sqrt(self.d) + mask, dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, t, self.nh * self.d))

    def _mlp(self, x):
        hn = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(hn)) * self.up(hn))

    def fuse(self, feats):
        """Target features as the head's feature input (EAGLE-1/2: as they are)."""
        return feats

    def forward(self, feats, tokens, positions, mask):
        """feats [B,T,H], tokens [B,T], positions [B,T], mask [B,1,T,T] additive
        -> (predicted features [B,T,H], draft logits [B,T,Vd])."""
        x = self.fc(torch.cat([self.embed[tokens], feats], dim=-1))
        x = self._mlp(x + self._attend(self.attn_norm(x), positions, mask))
        feat = self.final_norm(x)
        return feat, feat @ self.head.T

    def export_weights(self) -> dict[str, np.ndarray]:
        """Canonical tensor names (as checkpoint.py produces for a 1-layer model), float32."""
        w = {f"layers.0.{k}": getattr(self, k).weight.detach().float().numpy() for k in LAYER_KEYS}
        w["norm"] = self.final_norm.weight.detach().float().numpy()
        w["fc"] = self.fc.weight.detach().float().numpy()
        w["fc_bias"] = self.fc.bias.detach().float().numpy()
        return w

    def load_weights(self, w: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for k in LAYER_KEYS:
                getattr(self, k).weight.copy_(torch.from_numpy(np.asarray(w[f"layers.0.{k}"], np.float32)))
            self.final_norm.weight.copy_(torch.from_numpy(np.asarray(w["norm"], np.float32)))
            self.fc.weight.copy_(torch.from_numpy(np.asarray(w["fc"], np.float32)))
            self.fc.bias.copy_(torch.from_numpy(np.asarray(w["fc_bias"], np.float32)))


def causal_mask(t: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    m = torch.full((t, t), -1e30)
    m = torch.triu(m, diagonal=1)
    return m[None, None]


_EAGLE3_NAMES = {"attn_norm": "midlayer.input_layernorm.weight", "hidden_norm": "midlayer.hidden_norm.weight",
                 "mlp_norm": "midlayer.post_attention_layernorm.weight", "final_norm": "norm.weight",
                 "fc": "fc.weight", **{n: f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"},
                 **{n: f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}}


class Eagle3Head(EagleHead):
    """EAGLE-3's draft layer (module docstring); `head` stays the target's frozen LM-head rows
    (the training labels), `lm_head` is the head's own."""

    def __init__(self, cfg: dict, embed: np.ndarray, head_rows: np.ndarray, cos: np.ndarray, sin: np.ndarray):
        super().__init__(cfg, embed, head_rows, cos, sin)
        h, nh, nkv, d = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        self.hidden = h
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.q = nn.Linear(2 * h, nh * d, bias=False)
        self.k = nn.Linear(2 * h, nkv * d, bias=False)
        self.v = nn.Linear(2 * h, nkv * d, bias=False)
        self.lm_head = nn.Parameter(torch.from_numpy(np.array(head_rows, np.float32)))

    def fuse(self, feats):
        """The target's three layer features [.., 3H] -> the head's feature [.., H] (its own
        features pass as they are)."""
        return self.fc(feats) if feats.shape[-1] != self.hidden else feats

    def forward(self, feats, tokens, positions, mask):
        """feats [B,T,3H] (the target's) or [B,T,H] (its own) -> (pre-norm output [B,T,H],
        draft logits [B,T,Vd])."""
        x = self.fuse(feats)
        hn = torch.cat([self.attn_norm(self.embed[tokens]), self.hidden_norm(x)], -1)
        x = self._mlp(x + self._attend(hn, positions, mask))
        return x, self.final_norm(x) @ self.lm_head.T

    def export_weights(self) -> dict[str, np.ndarray]:
        """Under the EAGLE-3 reference's key names, float32."""
        out = {key: getattr(self, n).weight.detach().float().numpy() for n, key in _EAGLE3_NAMES.items()}
        out["lm_head.weight"] = self.lm_head.detach().float().numpy()
        return out

    def load_weights(self, w: dict[str, np.ndarray]) -> None:
        """From build/heads/formats.read_head's names (an EAGLE-3 head's), through the one map
        from the reference's key names to ours."""
        from backend.build.heads.formats import EAGLE3_KEYS

        with torch.no_grad():
            for n, key in _EAGLE3_NAMES.items():
                getattr(self, n).weight.copy_(torch.from_numpy(np.asarray(w[EAGLE3_KEYS[key]], np.float32)))
            self.lm_head.copy_(torch.from_numpy(np.asarray(w["lm_head"], np.float32)))
