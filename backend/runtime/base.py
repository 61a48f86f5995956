"""The Runtime protocol: what the decoder and drafters may ask of an engine.

A runtime runs one decoder graph (target or draft) over batches of sequences it keeps KV for.
Everything above this line (decoder, drafters, scheduler, verification) is device-agnostic and
only handles small host arrays: token ids, tree parents, accepted node lists.

    alloc(seq_id) / free(seq_id)      a sequence's KV storage
    forward(seq_ids, input_ids, parents, logits_index)
                                      one pass over T new tokens per sequence (a token tree per
                                      row); their KV is pending until commit. Parents may also
                                      name nodes of earlier forwards since the last commit
                                      (a drafter growing a tree level by level)
    commit(seq_ids, keep)             keep the accepted nodes' KV, drop the rest
    truncate(seq_id, length)          forget committed tokens beyond `length` (draft rollback)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from backend.manifest import ModelConfig


@dataclass
class ForwardOutput:
    logits: np.ndarray    # [B, R, V] float32 (rows chosen by logits_index); valid until next forward
    hidden: np.ndarray    # [B, T, H] float32 final-norm features of every new token


class Runtime(Protocol):
    config: ModelConfig
    num_layers: int
    max_seq_len: int

    def alloc(self, seq_id: int) -> None: ...

    def free(self, seq_id: int) -> None: ...

    def length(self, seq_id: int) -> int: ...

    def forward(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                logits_index: np.ndarray, extra_inputs: dict | None = None) -> ForwardOutput: ...

    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> None: ...

    def truncate(self, seq_id: int, length: int) -> None: ...

    def close(self) -> None: ...
