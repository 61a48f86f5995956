"""The EAGLE-style draft head in torch (training only; serving runs its ONNX export).

Input at position t: the target's final-norm feature f_t and the embedding of the next token
x_{t+1}; an FC layer fuses them (EAGLE, Li et al. 2024, arXiv:2401.15077), one Llama decoder
layer with the target's dimensions runs over the sequence (causal / tree attention, its own KV
cache at serve time), a final RMSNorm gives the predicted feature f^_{t+1}, and the target's
frozen LM head restricted to the draft vocabulary (FR-Spec, Zhao et al. 2025) gives logits for
x_{t+2}. The layer is the head's program (manifest.ModelConfig.eagle_head's Llama layer,
backend/program.py), interpreted here over [B, T] rows as every engine interprets it.

`Eagle3Head` is EAGLE-3 (Li et al. 2025, arXiv:2503.01840): its input feature is fc(the target's
low, middle and high layer features) [3H -> H] at the first step and its own pre-norm output
after; that feature is the residual stream, the attention reads [norm(embedding of x_{t+1}),
norm(feature)]; its own LM head (initialised from the target's rows) gives the logits. It is
saved in the layout the EAGLE-3 reference publishes (buildlib/heads/formats.py reads it).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from backend import program
from backend.manifest import ModelConfig

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
        self.program = layer_program(cfg, len(head_rows), len(cos), eagle3=isinstance(self, Eagle3Head))
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

    def _heads(self, h):
        """q [B,T,Hq,D], k and v [B,T,Hkv,D] of q/k/v rows h (as they are where h is split)."""
        if isinstance(h, tuple):
            return h
        b, t, _ = h.shape
        q, k, v = h.split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], -1)
        return q.view(b, t, self.nh, self.d), k.view(b, t, self.nkv, self.d), v.view(b, t, self.nkv, self.d)

    def _attend(self, op: program.Attention, q, k, v, mask):
        """Attention over the sequence (mask [B,1,T,T] additive: causal or a tree) -> [B,T,Hq*D]."""
        assert op == program.Attention(scale=op.scale), f"a head's layer is a Llama layer's: {op}"
        b, t = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) * op.scale + mask, dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, self.nh * self.d)

    def _layer(self, x, emb, positions, mask):
        """The head's layer program on its stream x [B,T,H] (emb: an EAGLE-3 head's token
        embeddings), op by op, as the engines run it (backend/program.py). Its modules are named
        after the program's weights: norms attn_norm, mlp_norm, hidden_norm; linears q ... down."""
        h, pending = x, None
        for op in self.program:
            if isinstance(op, program.Norm):
                h = (torch.cat([getattr(self, op.weight)(emb), getattr(self, op.feature)(h)], -1) if op.feature
                     else getattr(self, op.weight)(h))
            elif isinstance(op, program.Linear):
                h = torch.cat([getattr(self, p)(h) for p in op.parts], -1)
            elif isinstance(op, program.HeadNorm):
                q, k, v = self._heads(h)
                h = getattr(self, op.q)(q), getattr(self, op.k)(k), v
            elif isinstance(op, program.Rope):
                assert op.table == "global", "a head's layer has the global rope table"
                q, k, v = self._heads(h)
                h = self._rope(q, positions), self._rope(k, positions), v
            elif isinstance(op, program.Attention):
                h = self._attend(op, *self._heads(h), mask)
            elif isinstance(op, program.Gate):
                g, u = h.chunk(2, -1)
                h = (nn.functional.gelu(g, approximate="tanh") if op.act == "gelu_tanh" else nn.functional.silu(g)) * u
            elif isinstance(op, program.Residual):
                t = getattr(self, op.norm)(h) if op.norm else h
                if op.parallel:
                    pending = t
                else:
                    x, pending = (x if pending is None else x + pending) + t, None
                h = x
        return x

    def fuse(self, feats):
        """Target features as the head's feature input (EAGLE-1/2: as they are)."""
        return feats

    def forward(self, feats, tokens, positions, mask):
        """feats [B,T,H], tokens [B,T], positions [B,T], mask [B,1,T,T] additive
        -> (predicted features [B,T,H], draft logits [B,T,Vd])."""
        x = self._layer(self.fc(torch.cat([self.embed[tokens], feats], dim=-1)), None, positions, mask)
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


def layer_program(cfg: dict, vocab_size: int, max_positions: int, eagle3: bool) -> tuple:
    """The head's layer (backend/program.py): a Llama layer of the head's shape, as the build
    describes it (ModelConfig.eagle_head) and every engine runs it."""
    mc = ModelConfig(architecture="llama", vocab_size=vocab_size, hidden_size=cfg["hidden_size"],
                     intermediate_size=cfg["intermediate_size"], num_layers=1, num_heads=cfg["num_heads"],
                     num_kv_heads=cfg["num_kv_heads"], head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"],
                     rope_theta=float(cfg.get("rope_theta") or 10000.0), max_position_embeddings=max_positions,
                     tie_word_embeddings=False)
    return mc.program(0, eagle3=eagle3)


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
        x = self._layer(self.fuse(feats), self.embed[tokens], positions, mask)
        return x, self.final_norm(x) @ self.lm_head.T

    def export_weights(self) -> dict[str, np.ndarray]:
        """Under the EAGLE-3 reference's key names, float32."""
        out = {key: getattr(self, n).weight.detach().float().numpy() for n, key in _EAGLE3_NAMES.items()}
        out["lm_head.weight"] = self.lm_head.detach().float().numpy()
        return out

    def load_weights(self, w: dict[str, np.ndarray]) -> None:
        """From buildlib/heads/formats.read_head's names (an EAGLE-3 head's), through the one map
        from the reference's key names to ours."""
        from backend.buildlib.heads.formats import EAGLE3_KEYS

        with torch.no_grad():
            for n, key in _EAGLE3_NAMES.items():
                getattr(self, n).weight.copy_(torch.from_numpy(np.asarray(w[EAGLE3_KEYS[key]], np.float32)))
            self.lm_head.copy_(torch.from_numpy(np.asarray(w["lm_head"], np.float32)))
