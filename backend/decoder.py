"""SpecDecoder: the draft -> verify -> commit -> emit loop over a batch of sequences.

    start(request)   validate, allocate KV, pick the drafter       -> SequenceState
    prefill(seq)     the prompt in one or more forwards, first token  -> StepOutput
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
import time
from dataclasses import replace
from typing import Iterator

import numpy as np

from backend.config import DrafterKind, RequestError, SpecConfig
from backend.drafters.base import Draft, Drafter
from backend.kv_cache import PAD_PARENT
from backend.runtime.base import Runtime
from backend.sampling import sample, target_probs
from backend.sequence import Request, SequenceState, StepOutput, TextState
from backend.stats import SpecStats
from backend.tokenizer import Tokenizer
from backend.verify import Noise, verify_tree


class SpecDecoder:
    def __init__(self, target: Runtime, tokenizer: Tokenizer, drafters: dict[DrafterKind, Drafter],
                 spec: SpecConfig = SpecConfig(), controller=None, prefill_chunk: int = 512):
        from backend.controller import FixedController

        self.target = target
        self.tok = tokenizer
        self.drafters = drafters
        if spec.auto_drafter is DrafterKind.AUTO:
            # prompt lookup: measured best overall with the committed head (docs/perf-notes.md)
            best = DrafterKind.PROMPT_LOOKUP if DrafterKind.PROMPT_LOOKUP in drafters else DrafterKind.NONE
            spec = replace(spec, auto_drafter=best)
        elif spec.auto_drafter is not DrafterKind.NONE and spec.auto_drafter not in drafters:
            raise ValueError(f"default drafter {spec.auto_drafter.value!r} is not available "
                             f"(available: {[k.value for k in drafters]})")
        self.spec = spec
        self.controller = controller or FixedController(spec)
        self.prefill_chunk = prefill_chunk
        self.vocab = target.config.vocab_size
        self.stats = SpecStats()                      # aggregate over finished steps
        self._ids = itertools.count()

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self, request: Request) -> SequenceState:
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestError("text_input", "empty prompt")
        if n >= self.target.max_seq_len:
            raise RequestError("text_input", f"prompt has {n} tokens; the engine's maximum sequence "
                                             f"length is {self.target.max_seq_len}")
        request.params.validate()
        kind = self.spec.resolve(request.drafter)
        if kind is not DrafterKind.NONE:
            if kind not in self.drafters:
                raise RequestError("drafter", f"{kind.value!r} is not available on this server "
                                              f"(available: none, {', '.join(k.value for k in self.drafters)})")
            self.drafters[kind].check_params(request.params)
        tree = kind in (DrafterKind.EAGLE, DrafterKind.LOOKUP_EAGLE)
        limit = self.spec.max_tree_nodes if tree else self.spec.max_draft_tokens
        if request.num_draft_tokens is not None and not 0 <= request.num_draft_tokens <= limit:
            raise RequestError("num_draft_tokens", f"must be in [0, {limit}] for drafter {kind.value}, "
                                                   f"got {request.num_draft_tokens}")
        p = request.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.tok.eos_token_ids))
        seq = SequenceState(next(self._ids), request, kind, np.random.default_rng(p.seed),
                            frozenset(stop_ids), TextState(self.tok, p.stop_strings),
                            max_total_len=self.target.max_seq_len)
        self.target.alloc(seq.seq_id)
        return seq

    def prefill(self, seq: SequenceState) -> StepOutput | None:
        """Feed the next prompt chunk; after the last one sample the first token."""
        ids = np.asarray(seq.prompt_ids, np.int64)
        chunk = ids[seq.prefilled: seq.prefilled + self.prefill_chunk]
        t = chunk.size
        out = self.target.forward([seq.seq_id], chunk[None], np.arange(-1, t - 1, dtype=np.int32)[None],
                                  np.array([[t - 1]]))
        self.target.commit([seq.seq_id], [np.arange(t)])
        drafter = self.drafters.get(seq.drafter)
        if drafter is not None and drafter.needs_hidden:
            h = out.hidden[0].copy()
            seq.prompt_hidden = h if seq.prompt_hidden is None else np.concatenate([seq.prompt_hidden, h])
        seq.prefilled += t
        if seq.prefilled < ids.size:
            return None
        p = target_probs(out.logits[0, -1], seq.params)
        first = int(np.argmax(p)) if seq.params.greedy else sample(p, seq.rng.standard_exponential(self.vocab))
        if drafter is not None:
            drafter.begin(seq, seq.prompt_hidden)
            seq.prompt_hidden = None
        return seq.accept([first])

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
        budgets = self.controller.budgets(seqs, self.target.max_seq_len, self._previews(seqs),
                                          self._backlogs(seqs))
        drafts = self._propose(seqs, budgets)                          # draft
        t1 = time.perf_counter()
        ids, parents, index = _pack(drafts)
        fwd = self.target.forward([s.seq_id for s in seqs], ids, parents, index)   # verify
        verdicts = [verify_tree(d.tree, d.tokens, fwd.logits[b, : d.tree.num_nodes], s.params,
                                None if s.params.greedy else Noise.draw(s.rng, d.tree.num_nodes, self.vocab),
                                d.draft_probs, d.without_replacement)
                    for b, (s, d) in enumerate(zip(seqs, drafts))]
        self.target.commit([s.seq_id for s in seqs], [v.accepted_nodes for v in verdicts])  # commit
        t2 = time.perf_counter()
        self.controller.observe_step(len(seqs), ids.shape[1], t1 - t0, t2 - t1)
        outputs = []
        for b, (s, d, v) in enumerate(zip(seqs, drafts, verdicts)):
            drafter = self.drafters.get(s.drafter)
            if drafter is not None:
                hidden = fwd.hidden[b, v.accepted_nodes] if drafter.needs_hidden else None
                drafter.observe(s, d, v.accepted_nodes, hidden)
            s.stats.record(d.num_draft_tokens, d.tree.max_depth, v.num_accepted,
                           v.output_ids.size, t1 - t0, t2 - t1)
            self.controller.observe(s, d, v, len(seqs), t1 - t0, t2 - t1)
            out = s.accept(v.output_ids)                                # emit
            out.step_draft_tokens, out.step_accepted, out.step_depth = d.num_draft_tokens, v.num_accepted, d.tree.max_depth
            out.step_draft_s, out.step_verify_s = t1 - t0, t2 - t1
            outputs.append(out)
        return outputs

    def _previews(self, seqs: list[SequenceState]) -> list[list[int] | None] | None:
        """What free drafters (prompt lookup) would propose at the largest budget, for a
        controller that budgets with it; None per row where drafting costs a forward."""
        if not self.controller.wants_previews:
            return None
        limit = self.spec.max_draft_tokens
        out = []
        for s in seqs:
            d = self.drafters.get(s.drafter)
            out.append(d.preview(s, limit) if d is not None else None)
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


def _pack(drafts: list[Draft]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
