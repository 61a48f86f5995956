"""EAGLE-style heads in the layouts they are published in, read into our head format (the one
train/eagle_train.py writes: canonical tensor names, a draft vocabulary map, config keys
`hidden_size`, `num_heads`, `num_kv_heads`, `head_dim`, `intermediate_size`, `rms_norm_eps`,
`rope_theta`, `draft_vocab_size`, `target_vocab_size`).

Layouts:
  specdec   config.json + head.safetensors (ours)
  EAGLE     config.json (a LlamaConfig with one layer) + model.safetensors or pytorch_model.bin,
            keys fc.weight [H, 2H] (+ fc.bias), layers.0.self_attn.{q,k,v,o}_proj.weight,
            layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight;
            the reference implementation's first layer has no input norm and the head no final
            norm (its output goes straight to the target's LM head), so those stay absent here
            and the graphs skip them; the draft vocabulary is the target's. EAGLE-2 heads are
            EAGLE-1 heads (the tree is drawn at decode time).
  EAGLE-3 and Medusa are recognised and refused with what they need (EAGLE-3 reads the
            target's low, middle and high layer features; Medusa heads are not EAGLE layers).
Knows: published key names. Does not know: graphs, runtimes.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

OURS = "head.safetensors"
_EAGLE_KEYS = {"fc.weight": "fc", "fc.bias": "fc_bias", "norm.weight": "norm",
               "layers.0.input_layernorm.weight": "layers.0.attn_norm",
               "layers.0.post_attention_layernorm.weight": "layers.0.mlp_norm",
               **{f"layers.0.self_attn.{n}_proj.weight": f"layers.0.{n}" for n in "qkvo"},
               **{f"layers.0.mlp.{n}_proj.weight": f"layers.0.{n}" for n in ("gate", "up", "down")}}
_IGNORED = {"embed_tokens.weight"}          # EAGLE checkpoints may carry the target's embedding


class HeadFormatError(ValueError):
    pass


def _weights(head_dir: Path) -> dict[str, np.ndarray]:
    if (head_dir / "model.safetensors").exists():
        from safetensors.numpy import load_file

        return load_file(str(head_dir / "model.safetensors"))
    if (head_dir / "pytorch_model.bin").exists():
        import torch

        state = torch.load(str(head_dir / "pytorch_model.bin"), map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise HeadFormatError(f"{head_dir}: no head weights (head.safetensors, model.safetensors or pytorch_model.bin)")


def layout(head_dir: Path) -> str:
    """"specdec", "eagle", or a HeadFormatError saying what the directory holds instead."""
    head_dir = Path(head_dir)
    if (head_dir / OURS).exists():
        return "specdec"
    keys = set(_weights(head_dir))
    if any(k.startswith("midlayer.") for k in keys) or "d2t" in keys:
        raise HeadFormatError(f"{head_dir} is an EAGLE-3 head: it reads the target's low, middle and high "
                              f"layer features, which the target engines do not output yet; EAGLE-1/2 heads load")
    if any("medusa" in k for k in keys) or any(k.split(".")[0].isdigit() for k in keys):
        raise HeadFormatError(f"{head_dir} looks like Medusa heads (parallel heads on the last hidden state), "
                              f"not an EAGLE layer: build them with --draft medusa:DIR")
    if "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys:
        return "eagle"
    raise HeadFormatError(f"{head_dir}: unrecognised head layout (keys: {sorted(keys)[:8]} ...)")


def read_head(head_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config in our keys, weights in our names, `draft_vocab` included) of a head in any
    supported layout."""
    head_dir = Path(head_dir)
    kind = layout(head_dir)
    cfg_json = json.loads((head_dir / "config.json").read_text())
    if kind == "specdec":
        from safetensors.numpy import load_file

        return cfg_json, load_file(str(head_dir / OURS))
    raw = _weights(head_dir)
    unknown = sorted(set(raw) - set(_EAGLE_KEYS) - _IGNORED)
    if unknown:
        raise HeadFormatError(f"{head_dir}: EAGLE head with keys this reader does not know: {unknown[:6]}")
    w = {_EAGLE_KEYS[k]: np.asarray(v, np.float32) for k, v in raw.items() if k in _EAGLE_KEYS}
    hidden = int(cfg_json["hidden_size"])
    heads = int(cfg_json["num_attention_heads"])
    if "fc_bias" not in w:
        w["fc_bias"] = np.zeros(hidden, np.float32)
    vocab = int(cfg_json["vocab_size"])
    w["draft_vocab"] = np.arange(vocab, dtype=np.int64)
    cfg = {"hidden_size": hidden, "num_heads": heads,
           "num_kv_heads": int(cfg_json.get("num_key_value_heads", heads)),
           "head_dim": int(cfg_json.get("head_dim") or hidden // heads),
           "intermediate_size": int(cfg_json["intermediate_size"]),
           "rms_norm_eps": float(cfg_json.get("rms_norm_eps", 1e-6)),
           "rope_theta": float(cfg_json.get("rope_theta") or (cfg_json.get("rope_parameters") or {}).get("rope_theta")
                               or 10000.0),
           "draft_vocab_size": vocab, "target_vocab_size": vocab, "target_hidden_size": hidden,
           "layout": "eagle", "norms": sorted(k for k in ("layers.0.attn_norm", "norm") if k in w)}
    if w["fc"].shape != (hidden, 2 * hidden):
        raise HeadFormatError(f"{head_dir}: fc.weight is {w['fc'].shape}, an EAGLE-1/2 head has [H, 2H] = "
                              f"[{hidden}, {2 * hidden}]")
    return cfg, w


def head_meta(head_dir: Path) -> dict:
    """What a manifest's DraftEntry records of a head (its config, without training history)."""
    cfg, _ = read_head(head_dir)
    return {k: v for k, v in cfg.items() if k != "training"}
