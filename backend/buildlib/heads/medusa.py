"""Medusa heads in the published layout (FasterDecoding/Medusa, Medusa-1): `config.json` with
`medusa_num_heads`, `medusa_num_layers`, and `medusa_lm_head.safetensors` (or `.pt`) with keys
`{k}.{j}.linear.weight` / `.bias` for block j of head k and `{k}.{num_layers}.weight` for its LM
head; checked against the target and copied into the engine directory for the host drafter
(drafters/medusa.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ENGINE_FILE = "draft_medusa.npz"


def read_medusa(head_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config, weights) of Medusa heads in the published layout."""
    head_dir = Path(head_dir)
    cfg = json.loads((head_dir / "config.json").read_text())
    if (head_dir / "medusa_lm_head.safetensors").exists():
        from safetensors.numpy import load_file

        w = load_file(str(head_dir / "medusa_lm_head.safetensors"))
    elif (head_dir / "medusa_lm_head.pt").exists():
        import torch

        w = {k: v.float().numpy() for k, v in torch.load(str(head_dir / "medusa_lm_head.pt"), map_location="cpu",
                                                         weights_only=True).items()}
    else:
        raise ValueError(f"{head_dir}: no medusa_lm_head.safetensors or medusa_lm_head.pt")
    return cfg, {k: np.asarray(v, np.float32) for k, v in w.items()}


def export_medusa(head_dir: Path, engine_dir: Path, hidden_size: int, vocab_size: int) -> dict:
    """Check the heads against the target and write them for the drafter -> DraftEntry extra."""
    cfg, w = read_medusa(head_dir)
    k, layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    arrays = {}
    for h in range(k):
        head = w.get(f"{h}.{layers}.weight")
        if head is None or head.shape != (vocab_size, hidden_size):
            raise ValueError(f"Medusa head {h} of {head_dir}: LM head {None if head is None else head.shape}, the "
                             f"target needs [{vocab_size}, {hidden_size}]")
        arrays[f"head{h}"] = head
        for j in range(layers):
            arrays[f"w{h}_{j}"] = w[f"{h}.{j}.linear.weight"]
            arrays[f"b{h}_{j}"] = w[f"{h}.{j}.linear.bias"]
    np.savez(Path(engine_dir) / ENGINE_FILE, **arrays)
    return {"num_heads": k, "num_layers": layers}
