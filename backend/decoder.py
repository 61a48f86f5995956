"""SpecDecoder: the draft -> verify -> commit -> emit loop over a batch of sequences.

    start(request)   validate, allocate KV, pick the drafter       -> SequenceState
    prefill(seq)     the prompt in one or more forwards, after the part the target's prefix
                     cache holds (prefix_cache.py), first token     -> StepOutput
    step(seqs)       one speculative step for a batch                 -> [StepOutput]
    finish(seq)      free KV and drafter state
    generate(req)    the three above for one request (streaming and non-streaming share it)

Plain decoding is the same step with empty drafts (one root node per sequence), so speculative
and plain output come from one code path and one sampling function. The scheduler
(scheduler.py) calls start/prefill/step/finish for many requests at once.
Knows: the algorithm's order of operations. Does not know: ONNX, Triton, tensors beyond logits.
"""
from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import replace
from typing import Iterator

import numpy as np

from backend.config import DrafterKind, SpecConfig
from backend.controller import Controller, FixedController
from backend.drafters.base import Draft, Drafter
from backend.kv_cache import PAD_PARENT
from backend.runtime.base import Runtime, forward_verify
from backend.sampling import PositionNoise, target_token
from backend.sequence import (Request, RequestLimits, SequenceState, StepOutput, TextState,
                              validate_request)
from backend.stats import SpecStats
from backend.tokenizer import Tokenizer


class SpecDecoder:
    def __init__(self, target: Runtime, tokenizer: Tokenizer, drafters: dict[DrafterKind, Drafter],
                 spec: SpecConfig = SpecConfig(), controller: Controller | None = None,
                 prefill_chunk: int = 512):
        self.target = target
        self.tok = tokenizer
        self.drafters = drafters
        if spec.auto_drafter is DrafterKind.AUTO:
            # suffix decoding, else prompt lookup: both free of forwards, measured best overall
            # with the committed head (docs/perf-notes.md); suffix decoding also drafts from
            # earlier requests' answers (docs/results/suffix_2026-12-03.json)
            best = next((k for k in (DrafterKind.SUFFIX, DrafterKind.PROMPT_LOOKUP) if k in drafters), DrafterKind.NONE)
            spec = replace(spec, auto_drafter=best)
        elif spec.auto_drafter is not DrafterKind.NONE and spec.auto_drafter not in drafters:
            raise ValueError(f"default drafter {spec.auto_drafter.value!r} is not available "
                             f"(available: {[k.value for k in drafters]})")
        self.spec = spec
        self.controller = controller or FixedController(spec)
        self.prefill_chunk = prefill_chunk
        self.vocab = target.config.vocab_size
        self.limits = RequestLimits(target.max_seq_len, {k: d.traits.max_budget for k, d in drafters.items()})
        self.stats = SpecStats()                      # aggregate over finished steps
        self._ids = itertools.count()

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self, request: Request) -> SequenceState:
        kind = self.spec.resolve(request.drafter)
        validate_request(request, self.limits, kind)
        if kind is not DrafterKind.NONE:
            self.drafters[kind].check_params(request.params)
        p = request.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.tok.eos_token_ids))
        seed = p.seed if p.seed is not None else secrets.randbits(64)
        seq = SequenceState(next(self._ids), request, kind, PositionNoise(seed, self.vocab),
                            frozenset(stop_ids), TextState(self.tok, p.stop_strings),
                            max_total_len=self.target.max_seq_len)
        self.target.alloc(seq.seq_id)
        return seq

    def prefill(self, seq: SequenceState) -> StepOutput | None:
        """Feed the next prompt chunk (the first starts after the prompt's cached prefix); after
        the last one publish the prompt's blocks to the prefix cache and sample the first token."""
        ids = np.asarray(seq.prompt_ids, np.int64)
        drafter = self.drafters.get(seq.drafter)
        needs_hidden = drafter is not None and drafter.traits.needs_hidden
        cache = getattr(self.target, "prefix_cache", None)
        if cache is not None and seq.prefilled == 0:
            hit = cache.attach(seq.seq_id, seq.prompt_ids, needs_hidden)
            seq.prefilled = seq.cached_prompt_tokens = hit.tokens
            seq.prompt_hidden = hit.hidden if hit.tokens else None
        chunk = ids[seq.prefilled: seq.prefilled + self.prefill_chunk]
        t = chunk.size
        out = self.target.forward([seq.seq_id], chunk[None], np.arange(-1, t - 1, dtype=np.int32)[None],
                                  np.array([[t - 1]]))
        self.target.commit([seq.seq_id], [np.arange(t)])
        if needs_hidden:
            h = out.hidden[0].copy()
            seq.prompt_hidden = h if seq.prompt_hidden is None else np.concatenate([seq.prompt_hidden, h])
        seq.prefilled += t
        if seq.prefilled < ids.size:
            return None
        if cache is not None:
            cache.publish(seq.seq_id, seq.prompt_ids, seq.prompt_hidden)
        first = target_token(out.logits[0, -1], seq.params,
                             None if seq.params.greedy else seq.position_noise(0))
        if drafter is not None:
            drafter.begin(seq, seq.prompt_hidden)
            seq.prompt_hidden = None
        return seq.accept([first])

    def room(self) -> int:
        """How many more sequences the target's KV can hold now."""
        return self.target.room()

    def prefix_stats(self) -> dict:
        """Each prefix cache's counters, by engine: `target`, and a drafter's own (draft-model)."""
        caches = {"target": getattr(self.target, "prefix_cache", None)}
        caches.update((k.value, getattr(getattr(d, "rt", None), "prefix_cache", None))
                      for k, d in self.drafters.items())
        return {name: c.stats for name, c in caches.items() if c is not None}

    def finish(self, seq: SequenceState) -> None:
        self.target.free(seq.seq_id)
        self.controller.forget(seq)
        drafter = self.drafters.get(seq.drafter)
        if drafter is not None:
            drafter.end(seq)
        self.stats.merge(seq.stats)

    def generate(self, request: Request) -> Iterator[StepOutput]:
        seq = self.start(request)
        try:
            out = None
            while out is None:
                out = self.prefill(seq)
            yield out
            while not seq.finished:
                yield self.step([seq])[0]
        finally:
            self.finish(seq)

    # --- the speculative step ------------------------------------------------------------------
    def step(self, seqs: list[SequenceState]) -> list[StepOutput]:
        t0 = time.perf_counter()
        budgets = self._budgets(seqs)
        drafts = self._propose(seqs, budgets)                          # draft
        t1 = time.perf_counter()
        ids, parents, index = pack_drafts(drafts)
        fwd, verdicts = forward_verify(self.target, [s.seq_id for s in seqs], ids, parents, index,   # verify
                                       drafts, [s.params for s in seqs], [s.noise for s in seqs],
                                       [s.position for s in seqs])
        self.target.commit([s.seq_id for s in seqs], [v.accepted_nodes for v in verdicts])  # commit
        t2 = time.perf_counter()
        self.controller.observe_step(len(seqs), ids.shape[1], t1 - t0, t2 - t1, int((parents != PAD_PARENT).sum()))
        outputs = []
        for b, (s, d, v) in enumerate(zip(seqs, drafts, verdicts)):
            drafter = self.drafters.get(s.drafter)
            if drafter is not None:
                hidden = fwd.hidden[b, v.accepted_nodes] if drafter.traits.needs_hidden else None
                drafter.observe(s, d, v.accepted_nodes, hidden)
            s.stats.record(d.num_draft_tokens, d.tree.max_depth, v.num_accepted,
                           v.output_ids.size, t1 - t0, t2 - t1)
            self.controller.observe(s, d, v)
            out = s.accept(v.output_ids)                                # emit
            out.step_draft_tokens, out.step_accepted, out.step_depth = d.num_draft_tokens, v.num_accepted, d.tree.max_depth
            out.step_draft_s, out.step_verify_s = t1 - t0, t2 - t1
            outputs.append(out)
        return outputs

    def _budgets(self, seqs: list[SequenceState]) -> list[int]:
        """The controller's budget per row, clamped to the drafter's largest budget and to the
        room the row has left (0 for plain rows)."""
        ks = self.controller.budgets(seqs, self._previews(seqs), self._backlogs(seqs))
        return [0 if s.drafter is DrafterKind.NONE else
                min(k, self.drafters[s.drafter].traits.max_budget, s.draft_room())
                for s, k in zip(seqs, ks)]

    def _previews(self, seqs: list[SequenceState]) -> list[list[int] | None] | None:
        """What free drafters (prompt lookup) would propose at their largest budget, for a
        controller that budgets with it; None per row where drafting costs a forward."""
        if not self.controller.wants_previews:
            return None
        out = []
        for s in seqs:
            d = self.drafters.get(s.drafter)
            out.append(d.preview(s, d.traits.max_budget) if d is not None else None)
        return out

    def _backlogs(self, seqs: list[SequenceState]) -> list[int] | None:
        """Per row, what its drafter must catch up on before drafting (controllers that price it)."""
        if not self.controller.wants_backlogs:
            return None
        out = []
        for s in seqs:
            d = self.drafters.get(s.drafter)
            out.append(d.backlog(s) if d is not None else 0)
        return out

    def _propose(self, seqs: list[SequenceState], budgets: list[int]) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(seqs)
        for kind, drafter in self.drafters.items():
            rows = [i for i, s in enumerate(seqs) if s.drafter is kind]
            if rows:
                for i, d in zip(rows, drafter.propose([seqs[i] for i in rows], [budgets[i] for i in rows])):
                    drafts[i] = d
        return [d if d is not None else Draft.empty(s.root) for d, s in zip(drafts, seqs)]


def pack_drafts(drafts: list[Draft]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ragged trees -> input_ids [B, T], parents [B, T] (PAD_PARENT padding), logits_index [B, T]."""
    t = max(d.tree.num_nodes for d in drafts)
    b = len(drafts)
    ids = np.zeros((b, t), np.int64)
    parents = np.full((b, t), PAD_PARENT, np.int32)
    for r, d in enumerate(drafts):
        n = d.tree.num_nodes
        ids[r, :n] = d.tokens
        ids[r, n:] = d.tokens[0]
        parents[r, :n] = d.tree.parents
    return ids, parents, np.broadcast_to(np.arange(t), (b, t)).copy()
