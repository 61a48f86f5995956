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
  EAGLE-3   (Li et al. 2025, arXiv:2503.01840) config.json (LlamaForCausalLMEagle3: `vocab_size`
            the target's, `draft_vocab_size`) + model.safetensors or pytorch_model.bin, keys
            fc.weight [H, 3H] (the target's low, middle and high layer features -> H),
            midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
            midlayer.self_attn.{q,k,v}_proj.weight [*, 2H] (attention reads [norm(embedding),
            norm(feature)]), o_proj, midlayer.mlp.*, norm.weight, lm_head.weight [Vd, H] (its own
            LM head over the draft vocabulary), d2t [Vd] (target id = draft id + d2t[draft id]);
            t2d and embed_tokens are derivable or the target's and are not read. The feature
            layers are `eagle_aux_hidden_state_layer_ids` where the config pins them, else the
            reference's (2, L/2, L-3) of an L-layer target (`feature_layers`).
  Medusa heads are recognised and sent to --draft medusa:DIR.
Knows: published key names. Does not know: graphs, runtimes.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backend.errors import UserError

OURS = "head.safetensors"
_EAGLE_KEYS = {"fc.weight": "fc", "fc.bias": "fc_bias", "norm.weight": "norm",
               "layers.0.input_layernorm.weight": "layers.0.attn_norm",
               "layers.0.post_attention_layernorm.weight": "layers.0.mlp_norm",
               **{f"layers.0.self_attn.{n}_proj.weight": f"layers.0.{n}" for n in "qkvo"},
               **{f"layers.0.mlp.{n}_proj.weight": f"layers.0.{n}" for n in ("gate", "up", "down")}}
EAGLE3_KEYS = {"fc.weight": "fc", "norm.weight": "norm", "lm_head.weight": "lm_head", "d2t": "d2t",
                "midlayer.input_layernorm.weight": "layers.0.attn_norm",
                "midlayer.hidden_norm.weight": "layers.0.hidden_norm",
                "midlayer.post_attention_layernorm.weight": "layers.0.mlp_norm",
                **{f"midlayer.self_attn.{n}_proj.weight": f"layers.0.{n}" for n in "qkvo"},
                **{f"midlayer.mlp.{n}_proj.weight": f"layers.0.{n}" for n in ("gate", "up", "down")}}
_IGNORED = {"embed_tokens.weight", "t2d"}   # the target's embedding; t2d is d2t's inverse


class HeadFormatError(UserError, ValueError):
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
    """"specdec", "eagle", "eagle3", or a HeadFormatError saying what the directory holds instead."""
    head_dir = Path(head_dir)
    if (head_dir / OURS).exists():
        return "specdec"
    keys = set(_weights(head_dir))
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
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
    if kind == "eagle3":
        return _read_eagle3(head_dir, cfg_json, raw)
    unknown = sorted(set(raw) - set(_EAGLE_KEYS) - _IGNORED)
    if unknown:
        raise HeadFormatError(f"{head_dir}: EAGLE head with keys this reader does not know: {unknown[:6]}")
    w = {_EAGLE_KEYS[k]: np.asarray(v, np.float32) for k, v in raw.items() if k in _EAGLE_KEYS}
    hidden = int(cfg_json["hidden_size"])
    if "fc_bias" not in w:
        w["fc_bias"] = np.zeros(hidden, np.float32)
    vocab = int(cfg_json["vocab_size"])
    w["draft_vocab"] = np.arange(vocab, dtype=np.int64)
    cfg = {**_layer_config(cfg_json), "draft_vocab_size": vocab, "target_vocab_size": vocab,
           "target_hidden_size": hidden, "layout": "eagle",
           "norms": sorted(k for k in ("layers.0.attn_norm", "norm") if k in w)}
    if w["fc"].shape != (hidden, 2 * hidden):
        raise HeadFormatError(f"{head_dir}: fc.weight is {w['fc'].shape}, an EAGLE-1/2 head has [H, 2H] = "
                              f"[{hidden}, {2 * hidden}]")
    return cfg, w


def _layer_config(cfg_json: dict) -> dict:
    """The layer's dimensions from a published head's (Llama) config.json, in our keys."""
    hidden, heads = int(cfg_json["hidden_size"]), int(cfg_json["num_attention_heads"])
    return {"hidden_size": hidden, "num_heads": heads,
            "num_kv_heads": int(cfg_json.get("num_key_value_heads", heads)),
            "head_dim": int(cfg_json.get("head_dim") or hidden // heads),
            "intermediate_size": int(cfg_json["intermediate_size"]),
            "rms_norm_eps": float(cfg_json.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(cfg_json.get("rope_theta") or (cfg_json.get("rope_parameters") or {}).get("rope_theta")
                                or 10000.0)}


def _read_eagle3(head_dir: Path, cfg_json: dict, raw: dict) -> tuple[dict, dict[str, np.ndarray]]:
    unknown = sorted(set(raw) - set(EAGLE3_KEYS) - _IGNORED)
    missing = sorted(set(EAGLE3_KEYS) - set(raw))
    if unknown or missing:
        raise HeadFormatError(f"{head_dir}: EAGLE-3 head with keys this reader does not know {unknown[:6]} "
                              f"or without {missing[:6]}")
    if cfg_json.get("norm_before_residual"):
        raise HeadFormatError(f"{head_dir}: norm_before_residual=true (the residual is the normed feature) is "
                              f"not supported; the EAGLE-3 reference's residual is the feature itself")
    w = {EAGLE3_KEYS[k]: np.asarray(v, np.float32) for k, v in raw.items() if k in EAGLE3_KEYS}
    hidden = int(cfg_json["hidden_size"])
    d2t = np.asarray(raw["d2t"]).astype(np.int64)
    w["draft_vocab"] = np.arange(d2t.size, dtype=np.int64) + d2t
    del w["d2t"]
    cfg = {**_layer_config(cfg_json), "draft_vocab_size": int(d2t.size),
           "target_vocab_size": int(cfg_json["vocab_size"]), "target_hidden_size": hidden, "layout": "eagle3",
           "norms": ["layers.0.attn_norm", "layers.0.hidden_norm", "norm"]}
    ids = cfg_json.get("eagle_aux_hidden_state_layer_ids") or (cfg_json.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        cfg["feature_layers"] = [int(i) for i in ids]
    checks = {"fc.weight": (w["fc"].shape, (hidden, 3 * hidden)),
              "lm_head.weight": (w["lm_head"].shape, (d2t.size, hidden)),
              "midlayer.self_attn.q_proj.weight": (w["layers.0.q"].shape[1], 2 * hidden)}
    for key, (got, want) in checks.items():
        if got != want:
            raise HeadFormatError(f"{head_dir}: {key} is {got}, an EAGLE-3 head of hidden size {hidden} has {want}")
    vocab = w["draft_vocab"]
    if vocab.min() < 0 or vocab.max() >= cfg["target_vocab_size"] or np.unique(vocab).size != vocab.size:
        raise HeadFormatError(f"{head_dir}: d2t maps draft ids outside the target vocabulary or onto one id twice")
    return cfg, w


def feature_layers(head_cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 head reads (vLLM's aux-layer indexing), checked
    against the target's depth; () for a head that reads the final-norm features."""
    if head_cfg.get("layout") != "eagle3":
        return ()
    ids = tuple(head_cfg.get("feature_layers") or (2, num_layers // 2, num_layers - 3))
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise HeadFormatError(f"EAGLE-3 feature layers {ids}: need three layers of the target's {num_layers}")
    return ids


def head_meta(head_dir: Path, cfg: dict | None = None) -> dict:
    """What a manifest's DraftEntry records of a head (its config, without training history);
    `cfg`: the head's config already read (read_head), else it is read."""
    cfg = read_head(head_dir)[0] if cfg is None else cfg
    return {k: v for k, v in cfg.items() if k != "training"}
