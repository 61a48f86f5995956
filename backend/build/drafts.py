"""What every device's draft export shares: spec arguments checked against the target, a draft
checkpoint's vocabulary, the manifest entry of an EAGLE head. The kinds (backend/draft_kinds)
parse `--draft`; the backends (backend/devices) write the engines.
Knows: draft specs' arguments, manifest entries. Does not know: engine formats.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from backend.build.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from backend.manifest import DraftEntry, EngineFile, ModelConfig

EAGLE_VOCAB = "draft_eagle_vocab.npy"
EAGLE3_FC = "draft_eagle_fc.npy"          # an EAGLE-3 head's fc, run by the drafter (build/heads/eagle.py)


def self_layers(spec: str, cfg: ModelConfig) -> int:
    """N of `self:N`, checked against the target's layers."""
    n = int(spec.split(":", 1)[1])
    if not 0 < n < cfg.num_layers:
        raise ValueError(f"--draft self:N needs 0 < N < {cfg.num_layers}, got {n}")
    return n


def draft_checkpoint(spec: str, cfg: ModelConfig) -> Checkpoint:
    """A draft model's checkpoint, which must share the target's vocabulary."""
    dck = load_checkpoint(spec)
    if dck.config.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"draft {spec}: vocabulary size {dck.config.vocab_size} differs from the "
                              f"target's {cfg.vocab_size}; the draft must share the vocabulary")
    return dck


def head_dir(spec: str) -> Path:
    return Path(spec.split(":", 1)[1]).resolve()


def eagle_entry(head: Path, engine_dir: Path, engine_file: str, vocab: np.ndarray,
                weights: str | None = None) -> DraftEntry:
    """The manifest entry of an EAGLE head written as `engine_file`, its vocabulary map saved."""
    from backend.build.heads.formats import head_meta, read_head

    cfg, w = read_head(head)
    np.save(Path(engine_dir) / EAGLE_VOCAB, vocab)
    fc = None
    if cfg.get("layout") == "eagle3":
        np.save(Path(engine_dir) / EAGLE3_FC, np.asarray(w["fc"], np.float32))
        fc = EAGLE3_FC
    return DraftEntry("eagle", engine_file, 1, str(head), weights=weights, head=head_meta(head, cfg),
                      vocab_path=EAGLE_VOCAB, fc_path=fc)


def eagle3_fc(head: Path, target: EngineFile) -> tuple[np.ndarray | None, tuple[int, ...]]:
    """(an EAGLE-3 head's fc [H, 3H], the target engine's feature layers), or (None, ()) for
    other heads: what turns the target's features into the head's (drafters/eagle.head_features)."""
    from backend.build.heads.formats import read_head

    cfg, w = read_head(head)
    return (np.asarray(w["fc"], np.float32), target.feature_layers) if cfg.get("layout") == "eagle3" else (None, ())
