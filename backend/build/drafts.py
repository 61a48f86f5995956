"""`--draft` specs: what every device's build shares (parsing, checks against the target, the
manifest entry of an EAGLE head, Medusa heads, which are the same on every device). The device
builds (pipeline.py for cpu, torch_engine.py, trt_engine.py) write the engines.
Knows: draft specs, manifest entries. Does not know: engine formats.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from backend.build.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from backend.manifest import DraftEntry, ModelConfig

EAGLE_VOCAB = "draft_eagle_vocab.npy"


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


def eagle_entry(head: Path, engine_dir: Path, engine_file: str, vocab: np.ndarray, **extra) -> DraftEntry:
    """The manifest entry of an EAGLE head written as `engine_file`, its vocabulary map saved."""
    from backend.drafters.head_formats import head_meta

    np.save(Path(engine_dir) / EAGLE_VOCAB, vocab)
    return DraftEntry("eagle", engine_file, 1, str(head), {**head_meta(head), "vocab_path": EAGLE_VOCAB, **extra})


def medusa_entry(spec: str, engine_dir: Path, cfg: ModelConfig, log) -> tuple[str, DraftEntry]:
    """`medusa:DIR`: the heads copied for the drafter (drafters/medusa.py), on any device."""
    from backend.drafters.medusa import ENGINE_FILE, export_medusa

    d = head_dir(spec)
    extra = export_medusa(d, engine_dir, cfg.hidden_size, cfg.vocab_size)
    log(f"Medusa heads from {d}: {extra['num_heads']} heads -> {ENGINE_FILE}")
    return "medusa", DraftEntry("medusa", ENGINE_FILE, 0, str(d), extra)
