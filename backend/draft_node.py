"""The draft node: a draft model or EAGLE head serving drafts to remote targets (drafters/remote.py).

Each target sequence has a shadow here (its tokens, the drafter's KV) keyed by the target's key.
A call brings the shadow up to the target's committed tokens and proposes: first the drafter is
told its last proposal kept only the root (a draft model then drops the speculative part of its
KV; a head takes the new target features), the new tokens are appended, and the drafter's own
catch-up feeds them. A call whose `synced` length differs from the shadow's (a node restart, a
call the target gave up on) gets `resync`, and the target sends the whole history next time.
Shadows beyond `max_sequences` are dropped oldest first (the target resyncs them if it returns).
A drafter that counts its draft tokens outside the target's vocabulary (a draft model with a
vocabulary of its own, drafters/cross_vocab.py) has the call's counts sent back in `vocab`
([drawn, outside]), for the target's metrics.
Knows: drafters, shadows. Does not know: Triton, the target.
"""
from __future__ import annotations

import collections
import itertools

import numpy as np

from backend import request_schema
from backend.config import SamplingParams
from backend.drafters.base import Draft
from backend.sampling import PositionNoise


class Shadow:
    """What a drafter reads of a sequence, rebuilt from the target's calls."""

    def __init__(self, seq_id: int, tokens: list[int]):
        self.seq_id = seq_id
        self.prompt_ids = tuple(tokens[:-1])
        self.output_ids = [tokens[-1]]
        self.params = SamplingParams()
        self.noise: PositionNoise | None = None
        self.position = 0                            # the target's sequence position (its noise key)
        self.last_draft: Draft | None = None

    def all_ids(self) -> list[int]:
        return list(self.prompt_ids) + self.output_ids

    @property
    def root(self) -> int:
        return self.output_ids[-1]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def position_noise(self, depth: int) -> np.ndarray:
        return self.noise.at(self.position + depth)


class DraftNode:
    def __init__(self, drafter, vocab: int, max_sequences: int = 256):
        self.drafter = drafter
        self.vocab = vocab
        self.max_sequences = max_sequences
        self._shadows: collections.OrderedDict[str, Shadow] = collections.OrderedDict()
        self._ids = itertools.count()
        self._vocab: list[int] | None = None
        if hasattr(drafter, "on_vocab"):
            self._vocab = [0, 0, {}]
            drafter.on_vocab = self._count

    def _count(self, drawn: int, outside: int, methods: dict | None = None) -> None:
        self._vocab[0] += drawn
        self._vocab[1] += outside
        for m, n in (methods or {}).items():
            self._vocab[2][m] = self._vocab[2].get(m, 0) + n

    def handle(self, request: dict, features: np.ndarray | None) -> dict:
        for key in request.get("released", ()):
            self._drop(key)
        feats = np.zeros((0, 0), np.float32) if features is None else np.asarray(features, np.float32)
        offset, live, budgets, out = 0, [], [], []
        for row in request["rows"]:
            n_feat = int(row.get("features", 0))
            f = feats[offset:offset + n_feat]
            offset += n_feat
            shadow = self._sync(row, f)
            if shadow is None:
                out.append({"resync": True})
                continue
            live.append((len(out), shadow))
            budgets.append(int(row["budget"]))
            out.append(None)
        if live:
            for (j, shadow), d in zip(live, self.drafter.propose([s for _, s in live], budgets)):
                shadow.last_draft = d
                out[j] = {"tokens": d.tokens[1:].tolist(), "parents": d.tree.parents.tolist()}
        if self._vocab is None:
            return {"rows": out}
        counts, self._vocab = self._vocab, [0, 0, {}]
        return {"rows": out, "vocab": counts}

    def _sync(self, row: dict, feats: np.ndarray) -> Shadow | None:
        key, synced, tokens = row["key"], int(row["synced"]), [int(t) for t in row["tokens"]]
        shadow = self._shadows.get(key)
        if synced == 0:
            self._drop(key)
            shadow = Shadow(next(self._ids), tokens)
            self.drafter.begin(shadow, feats if self.drafter.traits.needs_hidden else None)
            self._shadows[key] = shadow
            while len(self._shadows) > self.max_sequences:
                self._drop(next(iter(self._shadows)))
        elif shadow is None or shadow.length != synced:
            return None
        else:
            last = shadow.last_draft or Draft.empty(shadow.root)
            self.drafter.observe(shadow, last, np.array([0]), feats)   # keep only what is committed
            shadow.output_ids.extend(tokens)
            self._shadows.move_to_end(key)
        p = row.get("params", {})
        shadow.params = SamplingParams(**{f.param: f.py_type(p[f.param]) for f in request_schema.DRAFT if f.param in p})
        if shadow.noise is None or shadow.noise.seed != int(row["seed"]):
            shadow.noise = PositionNoise(int(row["seed"]), self.vocab)
        shadow.position = int(row["position"])
        return shadow

    def _drop(self, key: str) -> None:
        shadow = self._shadows.pop(key, None)
        if shadow is not None:
            self.drafter.end(shadow)

    def __len__(self) -> int:
        return len(self._shadows)
