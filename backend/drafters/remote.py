"""A drafter on another node: the draft model or EAGLE head runs as its own Triton model
(`draft`, backend/draft_node.py), on this server or another, reached once per step over gRPC
with a deadline.

It can never hurt the target's output or availability: whatever the node returns is only a
proposal that the target verifies (verify.py: the emitted tokens are the target's own, whatever
was drafted, so greedy output stays token-identical and seeded sampled output stays plain
sampling's), and when the node errors, times out or is gone the step drafts with the local
fallback (prompt lookup: free, no model) instead. A failed node is left alone for a back-off that
doubles up to `retry_max_s` and is tried again after it, and used again when it answers.

State: the node keeps a shadow of each sequence (its KV) keyed by `key`; each call sends only the
tokens (and for a head, the target's features) committed since the last call the node answered.
A node that lost the shadow (restarted) or holds another length answers `resync`; the next call
then sends the whole history. Sequences that ended are released on the next call.
Knows: the node protocol, back-off. Does not know: Triton (the transport is injected).
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from backend import request_schema
from backend.config import SamplingParams
from backend.drafters.base import Draft, DrafterTraits
from backend.sequence import SequenceState
from backend.tree import TokenTree

Transport = Callable[[dict, "np.ndarray | None"], dict]   # (request, features [N, H]) -> response


class NodeError(RuntimeError):
    """The node failed this call (error, timeout, unreachable): draft with the fallback."""


@dataclass
class _Sync:
    key: str
    synced: int = 0                                          # tokens the node's shadow holds
    feats: list[np.ndarray] = field(default_factory=list)    # target features, all so far (heads)
    sent_feats: int = 0                                      # features the node holds


def params_json(p: SamplingParams) -> dict:
    """The sampling parameters that shape the draft's distribution (the request schema's `draft` fields)."""
    return {f.param: getattr(p, f.param) for f in request_schema.DRAFT}


class RemoteDrafter:
    name = "remote"

    def __init__(self, kind: str, traits: DrafterTraits, transport: Transport, fallback,
                 retry_s: float = 0.5, retry_max_s: float = 30.0, on_call=None):
        self.kind = kind                                     # "draft-model" | "eagle" on the node
        self.traits = traits
        self.transport = transport
        self.fallback = fallback
        self.retry_s, self.retry_max_s = retry_s, retry_max_s
        self.on_call = on_call or (lambda outcome, seconds, fallback_rows: None)
        self.on_vocab = lambda drawn, outside, methods=None: None   # a node's cross-vocabulary counts
        self._seqs: dict[int, _Sync] = {}
        self._released: list[str] = []
        self._down_until = 0.0
        self._backoff = retry_s
        self._keys = itertools.count()
        self._prefix = f"{os.getpid()}-{id(self):x}-"

    def check_params(self, params: SamplingParams) -> None:
        return None                                  # any draw is lossless (verify.py)

    def begin(self, seq: SequenceState, prompt_hidden) -> None:
        self.fallback.begin(seq, None)
        sync = _Sync(f"{self._prefix}{next(self._keys)}")
        if self.traits.needs_hidden:
            sync.feats.append(np.asarray(prompt_hidden, np.float32))
        self._seqs[seq.seq_id] = sync

    def observe(self, seq: SequenceState, draft: Draft, accepted_nodes, hidden) -> None:
        self.fallback.observe(seq, draft, accepted_nodes, None)
        if self.traits.needs_hidden:
            self._seqs[seq.seq_id].feats.append(np.asarray(hidden, np.float32))

    def end(self, seq: SequenceState) -> None:
        self.fallback.end(seq)
        sync = self._seqs.pop(seq.seq_id, None)
        if sync is not None:
            self._released.append(sync.key)

    def preview(self, seq: SequenceState, limit: int) -> None:
        return None                                  # drafting costs a call

    def backlog(self, seq: SequenceState) -> int:
        return len(seq.prompt_ids) + len(seq.output_ids) - self._seqs[seq.seq_id].synced

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[Draft]:
        rows = [i for i, k in enumerate(max_tokens) if k > 0]
        drafts = [Draft.empty(s.root) for s in seqs]
        if not rows:
            return drafts
        if time.monotonic() < self._down_until:
            return self._fall_back(seqs, max_tokens, rows, drafts, None)
        request, feats = self._request(seqs, max_tokens, rows)
        t0 = time.perf_counter()
        try:
            response = self.transport(request, feats)
        except Exception as exc:                     # the node must not fail the request
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self.retry_max_s, 2 * self._backoff)
            outcome = "timeout" if "deadline" in str(exc).lower() or "timeout" in str(exc).lower() else "error"
            return self._fall_back(seqs, max_tokens, rows, drafts, (outcome, time.perf_counter() - t0))
        self._backoff = self.retry_s
        self._released = [k for k in self._released if k not in request["released"]]
        if "vocab" in response:
            self.on_vocab(*response["vocab"])
        resync = []
        for i, row in zip(rows, response["rows"]):
            sync = self._seqs[seqs[i].seq_id]
            if row.get("resync"):
                sync.synced, sync.sent_feats = 0, 0          # send the whole history next time
                resync.append(i)
                continue
            sync.synced = len(seqs[i].prompt_ids) + len(seqs[i].output_ids)
            sync.sent_feats = sum(len(f) for f in sync.feats)
            tokens = np.concatenate([[seqs[i].root], np.asarray(row["tokens"], np.int64)]).astype(np.int64)
            drafts[i] = Draft(TokenTree(np.array(row["parents"], np.int32)), tokens)
        seconds = time.perf_counter() - t0
        if resync:
            return self._fall_back(seqs, max_tokens, resync, drafts, ("resync", seconds))
        self.on_call("ok", seconds, 0)
        return drafts

    def _request(self, seqs, max_tokens, rows) -> tuple[dict, np.ndarray | None]:
        out, feats = [], []
        for i in rows:
            s, sync = seqs[i], self._seqs[seqs[i].seq_id]
            ids = s.all_ids()
            row = {"key": sync.key, "synced": sync.synced, "tokens": [int(t) for t in ids[sync.synced:]],
                   "budget": int(max_tokens[i]), "params": params_json(s.params), "seed": int(s.noise.seed),
                   "position": s.position}
            if self.traits.needs_hidden:
                have = np.concatenate(sync.feats) if sync.feats else np.zeros((0, 0), np.float32)
                sync.feats = [have]
                feats.append(have[sync.sent_feats if sync.synced else 0:])
                row["features"] = int(len(feats[-1]))
            out.append(row)
        request = {"kind": self.kind, "rows": out, "released": list(self._released)}
        return request, (np.concatenate(feats) if feats else None)

    def _fall_back(self, seqs, max_tokens, rows, drafts, call) -> list[Draft]:
        for i, d in zip(rows, self.fallback.propose([seqs[i] for i in rows], [max_tokens[i] for i in rows])):
            drafts[i] = d
        if call is not None:
            self.on_call(call[0], call[1], len(rows))
        else:
            self.on_call("skipped", 0.0, len(rows))
        return drafts
