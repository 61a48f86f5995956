"""Export a trained EAGLE head (train/eagle_train.py) to ONNX for a built target: the head's
layer plus the target's embedding table and the target's LM-head rows of the draft vocabulary,
through the same graph builder as the target (GraphSpec.eagle).

An EAGLE-3 head keeps its own LM head, and its layer has a second input norm
(`layers.0.hidden_norm`: the attention reads [norm(embedding), norm(feature)], 2H wide). Its fc
(the target's three layer features, 3H -> H) is not in the engine: it applies to the target's
features only, never to the head's own, so the drafter runs it on the host at catch-up
(drafters/eagle.py; `fc_path` in the manifest entry), and the engine takes H-wide features on
every runtime."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from backend.buildlib.checkpoint import Checkpoint, SourceTensor, TokenizerSource
from backend.buildlib.graph import GraphSpec, build_decoder, save_model
from backend.manifest import WeightFormat

EAGLE_ONNX = "draft_eagle.onnx"


def head_checkpoint(head_dir: Path, target: Checkpoint) -> tuple[Checkpoint, np.ndarray]:
    """The head (any layout buildlib/heads/formats.py reads) as a 1-layer Checkpoint (vocab =
    draft vocabulary) and its vocab map [Vd]."""
    from backend.buildlib.heads.formats import read_head

    cfg, w = read_head(head_dir)
    if cfg["target_vocab_size"] != target.config.vocab_size or cfg["hidden_size"] != target.config.hidden_size:
        raise ValueError(f"EAGLE head {head_dir} was trained for a target with vocab "
                         f"{cfg['target_vocab_size']} / hidden {cfg['hidden_size']}, not this one "
                         f"({target.config.vocab_size} / {target.config.hidden_size})")
    vocab = np.asarray(w["draft_vocab"], np.int64)
    eagle3 = cfg.get("layout") == "eagle3"
    head = w["lm_head"] if eagle3 else target.tensors.get("lm_head", target.tensor("embed")).float32()[vocab]
    tensors = {k: SourceTensor(k, "F32", tuple(v.shape), np.asarray(v, np.float32))
               for k, v in w.items() if k != "draft_vocab" and not (eagle3 and k == "fc")}
    tensors["embed"] = target.tensor("embed")
    tensors["lm_head"] = SourceTensor("lm_head", "F32", head.shape, head)
    config = target.config.eagle_head(cfg, vocab.size)
    return Checkpoint(config, tensors, TokenizerSource(), str(head_dir)), vocab


def export_eagle_head(head_dir: Path, target: Checkpoint, engine_dir: Path, max_positions: int
                      ) -> tuple[Path, np.ndarray, object]:
    """The head as an ONNX engine in `engine_dir` -> (its path, the draft vocabulary map, its
    model description: the manifest records it, so loading the head needs no builder)."""
    ck, vocab = head_checkpoint(Path(head_dir), target)
    model = build_decoder(ck, GraphSpec(WeightFormat.FP32, 1, max_positions, eagle=True))
    path = Path(engine_dir) / EAGLE_ONNX
    save_model(model, path)
    return path, vocab, ck.config
