"""The model directory Dynamo's frontend reads for a specdec node: the engine's own tokenizer and
chat template, so the frontend tokenizes and templates a request exactly as our own doors do.

Dynamo registers a model by a directory in Hugging Face's layout (its model deployment card names
each file with its checksum; the frontend loads them from that path): `tokenizer.json` (the
engine's, copied), `tokenizer_config.json` (the chat template, BOS/EOS tokens and whether BOS is
added), `config.json` (context length, EOS/BOS ids) and `generation_config.json` (the EOS ids
the frontend passes on as hidden stop tokens). It is written beside the engines
(`<repository>/specdec/engine/dynamo/`), derived from the manifest, rewritten only when its
content changes (atomically: nodes on one machine write it at the same time), so a frontend on
another machine reads it at the same path in its copy of the repository.
Knows: the manifest, the file layout. Does not know: Dynamo's API.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from backend.manifest import EngineManifest
from backend.tokenizer import Tokenizer

CARD_DIR = "dynamo"


def card_files(engine_dir: Path) -> dict[str, bytes]:
    """File name -> content of the card of the engines in `engine_dir`."""
    m = EngineManifest.load(engine_dir)
    tok = Tokenizer.from_manifest(m)
    name = lambda i: tok.id_to_token(i) if i is not None else None
    eos = list(m.model.eos_token_ids)
    tok_config = {"add_bos_token": tok.add_bos_token, "add_eos_token": False,
                  "bos_token": name(m.model.bos_token_id), "eos_token": name(eos[0]) if eos else None,
                  "model_max_length": m.max_seq_len, "tokenizer_class": "PreTrainedTokenizerFast"}
    if m.chat_template:
        tok_config["chat_template"] = m.chat_template
    config = {"architectures": [m.model.architecture], "model_type": m.model.architecture,
              "max_position_embeddings": m.max_seq_len, "vocab_size": m.model.vocab_size,
              "bos_token_id": m.model.bos_token_id, "eos_token_id": eos}
    dumps = lambda d: (json.dumps(d, indent=1, ensure_ascii=False) + "\n").encode()
    return {"tokenizer.json": m.resolve(m.tokenizer_path).read_bytes(),
            "tokenizer_config.json": dumps(tok_config), "config.json": dumps(config),
            "generation_config.json": dumps({"bos_token_id": m.model.bos_token_id, "eos_token_id": eos})}


def write_card(engine_dir: str | Path) -> Path:
    """Write (or keep) the card of the engines in `engine_dir` -> its directory."""
    out = Path(engine_dir) / CARD_DIR
    out.mkdir(exist_ok=True)
    for name, content in card_files(Path(engine_dir)).items():
        path = out / name
        if path.exists() and path.read_bytes() == content:
            continue
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    return out
