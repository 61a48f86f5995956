"""What every device's draft export shares: spec arguments checked against the target, a draft
checkpoint's vocabulary (the target's, or another: then the vocabulary map by decoded bytes,
backend/vocab_map.py, and the draft's own tokenizer beside the engines), the manifest entry of an
EAGLE head. The kinds (backend/draft_kinds) parse `--draft`; the backends (backend/devices) write
the engines.
Knows: draft specs' arguments, manifest entries. Does not know: engine formats.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from backend.buildlib.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from backend.manifest import DraftEntry, EngineFile, ModelConfig
from backend.vocab_map import TokenBytes, VocabMap

EAGLE_VOCAB = "draft_eagle_vocab.npy"
EAGLE3_FC = "draft_eagle_fc.npy"          # an EAGLE-3 head's fc, run by the drafter (buildlib/heads/eagle.py)
VOCAB_MAP = "draft_vocab_map.npz"         # a draft with its own vocabulary: the map (vocab_map.py)
DRAFT_TOKENIZER = "draft_tokenizer.json"  # ... and its tokenizer


def self_layers(spec: str, cfg: ModelConfig) -> int:
    """N of `self:N`, checked against the target's layers."""
    n = int(spec.split(":", 1)[1])
    if not 0 < n < cfg.num_layers:
        raise ValueError(f"--draft self:N needs 0 < N < {cfg.num_layers}, got {n}")
    return n


def draft_checkpoint(spec: str, cfg: ModelConfig) -> Checkpoint:
    """A draft model's checkpoint, with the target's vocabulary or its own (`vocabulary_map`)."""
    return load_checkpoint(spec)


def tokenizer_json(ck: Checkpoint) -> str:
    from backend.tokenizer import tokenizer_json_from_gguf

    return ck.tokenizer.tokenizer_json or tokenizer_json_from_gguf(ck.tokenizer.gguf_vocab)


def vocabulary_map(dck: Checkpoint, target: Checkpoint, target_json: str) -> VocabMap | None:
    """None where the draft's tokens are the target's (the same bytes id for id, the same
    vocabulary size); else the map from the draft's vocabulary to the target's."""
    try:
        d, t = TokenBytes.from_json(tokenizer_json(dck)), TokenBytes.from_json(target_json)
    except ValueError as exc:
        if dck.config.vocab_size == target.config.vocab_size:
            return None                      # a tokenizer we cannot map, of the target's size: as before
        raise CheckpointError(f"draft {dck.source}: vocabulary size {dck.config.vocab_size} differs from the "
                              f"target's {target.config.vocab_size} and its tokenizer cannot be mapped ({exc})") from None
    if d.table == t.table and dck.config.vocab_size == target.config.vocab_size:
        return None
    bos = dck.config.bos_token_id if dck.tokenizer.add_bos_token and dck.config.bos_token_id is not None else -1
    return VocabMap.build(d.padded(dck.config.vocab_size), t.padded(target.config.vocab_size), bos)


def cross_vocab_entry(ctx, entry: DraftEntry, dck: Checkpoint, vmap: VocabMap) -> DraftEntry:
    """A draft model's entry made a cross-vocabulary one: the map and the draft's tokenizer
    written beside the engines, the map's coverage recorded."""
    import dataclasses

    vmap.save(Path(ctx.engine_dir) / VOCAB_MAP)
    (Path(ctx.engine_dir) / DRAFT_TOKENIZER).write_text(tokenizer_json(dck), encoding="utf-8")
    cov = vmap.coverage()
    ctx.log(f"draft {entry.source}: its own vocabulary; {cov['mapped']} of its {cov['draft_text_tokens']} text "
            f"tokens ({100 * cov['share']:.1f}%) are target tokens (by decoded bytes)")
    return dataclasses.replace(entry, kind="cross-vocab", vocab_path=VOCAB_MAP, tokenizer_path=DRAFT_TOKENIZER,
                               coverage=cov)


def head_dir(spec: str) -> Path:
    return Path(spec.split(":", 1)[1]).resolve()


def eagle_entry(head: Path, engine_dir: Path, engine_file: str, vocab: np.ndarray, model: ModelConfig,
                weights: str | None = None) -> DraftEntry:
    """The manifest entry of an EAGLE head written as `engine_file`, its vocabulary map saved;
    `model`: the head's description (ModelConfig.eagle_head), which loading reads."""
    from backend.buildlib.heads.formats import head_meta, read_head

    cfg, w = read_head(head)
    np.save(Path(engine_dir) / EAGLE_VOCAB, vocab)
    fc = None
    if cfg.get("layout") == "eagle3":
        np.save(Path(engine_dir) / EAGLE3_FC, np.asarray(w["fc"], np.float32))
        fc = EAGLE3_FC
    return DraftEntry("eagle", engine_file, 1, str(head), weights=weights, head=head_meta(head, cfg),
                      vocab_path=EAGLE_VOCAB, fc_path=fc, model=model)


def eagle3_fc(head: Path, target: EngineFile) -> tuple[np.ndarray | None, tuple[int, ...]]:
    """(an EAGLE-3 head's fc [H, 3H], the target engine's feature layers), or (None, ()) for
    other heads: what turns the target's features into the head's (drafters/eagle.head_features)."""
    from backend.buildlib.heads.formats import read_head

    cfg, w = read_head(head)
    return (np.asarray(w["fc"], np.float32), target.feature_layers) if cfg.get("layout") == "eagle3" else (None, ())
