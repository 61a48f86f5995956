"""`--draft` specs: what every device's build shares (parsing, checks against the target, the
manifest entry of an EAGLE head, Medusa heads, which are the same on every device). The device
builds (pipeline.py for cpu, torch_engine.py, trt_engine.py) write the engines.
Knows: draft specs, manifest entries. Does not know: engine formats.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from backend.build.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from backend.manifest import DraftEntry, EngineFile, ModelConfig

EAGLE_VOCAB = "draft_eagle_vocab.npy"
EAGLE3_FC = "draft_eagle_fc.npy"          # an EAGLE-3 head's fc, run by the drafter (eagle_export.py)


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
    from backend.drafters.head_formats import head_meta, read_head

    cfg, w = read_head(head)
    meta = head_meta(head, cfg)
    np.save(Path(engine_dir) / EAGLE_VOCAB, vocab)
    if cfg.get("layout") == "eagle3":
        np.save(Path(engine_dir) / EAGLE3_FC, np.asarray(w["fc"], np.float32))
        meta["fc_path"] = EAGLE3_FC
    return DraftEntry("eagle", engine_file, 1, str(head), {**meta, "vocab_path": EAGLE_VOCAB, **extra})


def eagle3_fc(head: Path, target: EngineFile) -> tuple[np.ndarray | None, tuple[int, ...]]:
    """(an EAGLE-3 head's fc [H, 3H], the target engine's feature layers), or (None, ()) for
    other heads: what turns the target's features into the head's (drafters/eagle.head_features)."""
    from backend.drafters.head_formats import read_head

    cfg, w = read_head(head)
    return (np.asarray(w["fc"], np.float32), target.feature_layers) if cfg.get("layout") == "eagle3" else (None, ())


def feature_layers(specs, cfg: ModelConfig) -> tuple[int, ...]:
    """The target layers whose features the EAGLE-3 heads among `specs` read (the target engines
    output them: EngineFile.feature_layers); () without one. Two heads must agree."""
    from backend.drafters.head_formats import feature_layers as head_layers, head_meta

    wanted = {head_layers(head_meta(head_dir(s)), cfg.num_layers) for s in specs if s.startswith("eagle:")} - {()}
    if len(wanted) > 1:
        raise ValueError(f"EAGLE-3 heads reading different target layers {sorted(wanted)}: build one of them")
    return wanted.pop() if wanted else ()


def medusa_entry(spec: str, engine_dir: Path, cfg: ModelConfig, log) -> tuple[str, DraftEntry]:
    """`medusa:DIR`: the heads copied for the drafter (drafters/medusa.py), on any device."""
    from backend.drafters.medusa import ENGINE_FILE, export_medusa

    d = head_dir(spec)
    extra = export_medusa(d, engine_dir, cfg.hidden_size, cfg.vocab_size)
    log(f"Medusa heads from {d}: {extra['num_heads']} heads -> {ENGINE_FILE}")
    return "medusa", DraftEntry("medusa", ENGINE_FILE, 0, str(d), extra)
