"""A numpy toy language model behind the Runtime protocol, for tests and documentation.

Its next-token logits depend on the last `order` tokens of the path through a fixed random table,
so exact output distributions are known, and it honours token trees, commits and truncation
exactly as a real runtime must (nanochat's MockModel idea).
"""
from __future__ import annotations

import numpy as np

from backend.kv_cache import PAD_PARENT
from backend.manifest import ModelConfig
from backend.runtime.base import ForwardOutput, verify_on_host
from backend.runtime.host import HostSide


def toy_config(vocab: int, hidden: int = 8) -> ModelConfig:
    return ModelConfig("toy", vocab, hidden, hidden, 1, 1, 1, 2, 1e-6, 1e4, 4096, True,
                       eos_token_ids=())


class ToyRuntime(HostSide):
    ragged = False
    def __init__(self, vocab: int = 8, order: int = 2, seed: int = 0, scale: float = 2.0,
                 max_seq_len: int = 4096, hidden: int = 8):
        self.config = toy_config(vocab, hidden)
        self.num_layers = 1
        self.max_seq_len = max_seq_len
        self.order = order
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((vocab ** order, vocab)) * scale).astype(np.float32)
        self.embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
        self._seqs: dict[int, list[int]] = {}
        self._pending: dict[int, list[list[int]]] = {}   # per seq: tokens path per new node
        self.num_forwards = 0

    def logits_for(self, context: list[int]) -> np.ndarray:
        v = self.config.vocab_size
        key = 0
        for t in ([0] * self.order + list(context))[-self.order:]:
            key = key * v + int(t)
        return self.table[key]

    def alloc(self, seq_id: int) -> None:
        assert seq_id not in self._seqs, seq_id
        self._seqs[seq_id] = []

    def free(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def length(self, seq_id: int) -> int:
        return len(self._seqs[seq_id])

    def room(self) -> int:
        return 2 ** 31 - 1

    def verify(self, out, drafts, params, noises, positions):
        return verify_on_host(out, drafts, params, noises, positions)

    def forward(self, seq_ids, input_ids, parents, logits_index, extra_inputs=None) -> ForwardOutput:
        b, t = input_ids.shape
        self.num_forwards += 1
        logits = np.zeros((b, logits_index.shape[1], self.config.vocab_size), np.float32)
        hidden = np.zeros((b, t, self.config.hidden_size), np.float32)
        for r, sid in enumerate(seq_ids):
            base = self._seqs[sid]
            paths: list[list[int]] = []
            for i in range(t):
                p = int(parents[r, i])
                prefix = paths[p] if p >= 0 else ([] if p == PAD_PARENT else [])
                paths.append(prefix + [int(input_ids[r, i])])
            self._pending[sid] = paths
            for j, i in enumerate(logits_index[r]):
                if parents[r, i] != PAD_PARENT:
                    logits[r, j] = self.logits_for(base + paths[i])
            hidden[r] = self.embed[input_ids[r]]
        return ForwardOutput(logits, hidden)

    def commit(self, seq_ids, keep) -> None:
        for sid, nodes in zip(seq_ids, keep):
            paths = self._pending.pop(sid)
            nodes = list(np.asarray(nodes))
            if not nodes:
                continue
            last = paths[nodes[-1]]
            assert len(last) == len(nodes), "kept nodes must form one root-to-node path"
            self._seqs[sid].extend(last)

    def truncate(self, seq_id: int, length: int) -> None:
        del self._seqs[seq_id][length:]

    def close(self) -> None:
        self._seqs.clear()


class ToyTokenizer:
    """Token ids <-> text for toy vocabularies: token i is the letter chr(97 + i)."""

    def __init__(self, eos_token_ids: tuple[int, ...] = ()):
        self.eos_token_ids = eos_token_ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + int(i) % 26) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 97 for c in text]
