"""EAGLE-style drafting with dynamic trees (EAGLE-2, Li et al. 2024, arXiv:2406.16858).

The head (train/eagle_model.py, exported to ONNX) runs in the same runtime code as the target,
with its own KV cache. Per step and sequence:
  1. catch up: feed the pairs (f_t, x_{t+1}) the head has not seen, with the TARGET's features
     of the tokens committed since the last step (the verify forward returned them);
  2. grow the tree: the root's children are the head's top-k tokens; then, D-1 times, the k
     most probable frontier nodes (by path log-probability under the draft) are fed in one head
     forward (tree attention over the scratch tree) and each proposes its top-k children;
  3. keep the N most probable nodes overall (ancestor-closed, since path probabilities only
     shrink) as the tree the target verifies. The head's scratch KV is then dropped.
Drafts are deterministic (q = point masses), so verification is lossless for every sampling
parameter. The head's vocabulary is a subset of the target's (FR-Spec); `vocab` maps it back.
Where the head's runtime keeps a prefix cache (engine.enable_prefix_caches), a sequence starts
with the head's cached columns of its prompt and catches up on the rest.
An EAGLE-3 head (Li et al. 2025, arXiv:2503.01840) reads the target's low, middle and high layer
features through its fc (`head_features`, here on the host: the head engine takes H-wide
features, and its own outputs skip the fc); its tree search is the same.
"""
from __future__ import annotations

import numpy as np

from backend.config import SamplingParams, SpecConfig
from backend.drafters.base import Draft, DrafterTraits
from backend.kv_cache import PAD_PARENT
from backend.prefix_cache import chain_root
from backend.sequence import SequenceState
from backend.tree import TokenTree


def _top_logprobs(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits [..., V] -> (the k most probable entries of each row, best first (the lower index
    on ties) [..., k], their log-probabilities [..., k]). k argmax passes over a copy: ~10x
    faster than argpartition for the small k of a tree (perf-notes §13), and the log-softmax
    is taken of the k entries only."""
    flat = x.reshape(-1, x.shape[-1])
    y, rows = flat.copy(), np.arange(flat.shape[0])
    idx = np.empty((flat.shape[0], k), np.int64)
    for j in range(k):
        idx[:, j] = y.argmax(-1)
        y[rows, idx[:, j]] = -np.inf
    top = flat[rows[:, None], idx]                                 # [rows, k], best first
    lse = top[:, :1] + np.log(np.exp(flat - top[:, :1]).sum(-1, keepdims=True))
    return idx.reshape(x.shape[:-1] + (k,)), (top - lse).reshape(x.shape[:-1] + (k,))


class HostFC:
    """An EAGLE-3 head's fc [H, 3H] on the host, as the head's runtime multiplies between its
    steps (Runtime.host_matmul: the native kernel's blocked matmul on the engine's own threads,
    where numpy's OpenBLAS would start threads that fight them: measured, EAGLE-3 drafting went
    from 0.27 to 0.47 of step time with numpy, perf-notes §13)."""

    def __init__(self, w: np.ndarray, runtime):
        self.w = np.asarray(w, np.float32)                      # [H, 3H]
        self.product = runtime.host_matmul(self.w)              # repacked once, not per step

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.product(x)


def head_features(hidden: np.ndarray, hidden_size: int, fc: HostFC | None) -> np.ndarray:
    """Target features [n, W] (the forward's `hidden`) -> the head's input features [n, H]: the
    final-norm part (EAGLE-1/2), or an EAGLE-3 head's fc over the layer features that follow
    it (EngineFile.feature_layers)."""
    if fc is None:
        return np.ascontiguousarray(hidden[:, :hidden_size], np.float32)
    assert hidden.shape[1] == hidden_size + fc.w.shape[1], (hidden.shape, fc.w.shape)
    if not len(hidden):
        return np.zeros((0, hidden_size), np.float32)
    return fc(np.ascontiguousarray(hidden[:, hidden_size:], np.float32))


def level_gate(cost_model: dict | None) -> float:
    """The confidence gate from the measured costs: one more tree level costs a head forward and
    adds at most one accepted token (worth a plain step) with the probability of the best
    frontier path, so it pays above p = head forward / plain step. 0 without a cost model.
    (A per-candidate gate, verifying only candidates with p above the verify curve's marginal
    cost per token, was measured and dropped: perf-notes §10.)"""
    if not cost_model or "eagle" not in cost_model.get("draft_step_s", {}):
        return 0.0
    step = float(np.interp(1, list(cost_model["tokens"]), list(cost_model["seconds"])))
    return min(0.5, cost_model["draft_step_s"]["eagle"] / step)


def _head_prefix(seq: SequenceState) -> tuple:
    """The head's prefix-cache chain (prefix_cache.chain_root): its column j holds the pair
    (target feature of token j, token j + 1), a function of the prompt's first j + 2 tokens."""
    return seq.prompt_ids[1:], chain_root(b"eagle", seq.prompt_ids[0])


class EagleDrafter:
    name = "eagle"

    def __init__(self, runtime, vocab: np.ndarray, depth: int = 5, topk: int = 4, max_nodes: int = 12,
                 level_gate: float = 0.0, fc: HostFC | None = None):
        """level_gate: grow another level only while some row's most probable frontier path
        (the head's probability) is at least this (confidence gating, `level_gate`; 0 =
        EAGLE-2's fixed depth). fc: an EAGLE-3 head's (`head_features`)."""
        self.rt = runtime
        self.fc = fc
        self.vocab = np.asarray(vocab, np.int64)             # [Vd] draft index -> token id
        self.depth, self.topk, self.max_nodes = depth, topk, max_nodes
        self.level_gate = level_gate
        self.traits = self.make_traits(depth, max_nodes)
        self._pending: dict[int, list[np.ndarray]] = {}      # chunks of [n, H] target features not yet fed
        self._fed: dict[int, int] = {}

    @classmethod
    def make_traits(cls, depth: int, max_nodes: int) -> DrafterTraits:
        return DrafterTraits(tree=True, max_budget=max_nodes, max_forwards=depth, cost_key=cls.name,
                             catches_up=True, needs_hidden=True)

    @classmethod
    def from_manifest(cls, manifest, spec: SpecConfig, runtime) -> "EagleDrafter":
        """The head built into `manifest`, on `runtime` (the head's engine, loaded by the
        caller: draft_kinds.eagle_drafter)."""
        entry = manifest.drafts["eagle"]
        vocab = np.load(manifest.resolve(entry.vocab_path))
        gate = level_gate(manifest.cost_model) if spec.eagle_gate else 0.0
        fc = HostFC(np.load(manifest.resolve(entry.fc_path)), runtime) if entry.fc_path else None
        return cls(runtime, vocab, spec.eagle_depth, spec.eagle_topk, spec.max_tree_nodes, gate, fc)

    def check_params(self, params: SamplingParams) -> None:
        return None                                  # point-mass drafts: lossless for all

    def begin(self, seq: SequenceState, prompt_hidden) -> None:
        assert prompt_hidden is not None and len(prompt_hidden) == len(seq.prompt_ids), "prompt features"
        self.rt.alloc(seq.seq_id)
        cache, n = getattr(self.rt, "prefix_cache", None), 0    # the head's own (engine.py)
        if cache is not None:
            tokens, root = _head_prefix(seq)
            n = cache.attach(seq.seq_id, tokens, root=root).tokens
        self._pending[seq.seq_id] = [np.asarray(prompt_hidden[n:], np.float32)]
        self._fed[seq.seq_id] = n

    def observe(self, seq: SequenceState, draft: Draft, accepted_nodes, hidden) -> None:
        self._pending[seq.seq_id].append(hidden.astype(np.float32))   # joined at catch-up, not per step

    def end(self, seq: SequenceState) -> None:
        self.rt.free(seq.seq_id)
        self._pending.pop(seq.seq_id, None)
        self._fed.pop(seq.seq_id, None)

    def preview(self, seq: SequenceState, limit: int) -> None:
        return None                                  # drafting costs a forward

    def backlog(self, seq: SequenceState) -> int:
        # pending features = committed tokens the head has not seen (catch-up asserts it)
        return len(seq.prompt_ids) + len(seq.output_ids) - 1 - self._fed.get(seq.seq_id, 0)

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[Draft]:
        drafts = [Draft.empty(s.root) for s in seqs]
        rows = [i for i, k in enumerate(max_tokens) if k > 0]
        if not rows:
            return drafts
        sids = [seqs[i].seq_id for i in rows]
        logits, feats = self._catch_up([seqs[i] for i in rows])
        k, nr = self.topk, len(rows)
        budget = np.array([min(self.max_nodes, max_tokens[i]) for i in rows])
        depth = min(self.depth, int(budget.max()))
        # candidates of all rows at once, [R, C]: parent (candidate index, -1 = root), target
        # token, path log-probability (float64, as summed), scratch node id once fed (-1 before)
        size = k + (depth - 1) * k * k
        parent = np.full((nr, size), -1, np.int64)
        token = np.zeros((nr, size), np.int64)
        score = np.full((nr, size), -np.inf)
        scratch = np.full((nr, size), -1, np.int64)
        top, lp = _top_logprobs(logits, k)                          # [R, k]
        token[:, :k] = self.vocab[top]
        score[:, :k] = lp
        frontier = np.broadcast_to(np.arange(k), (nr, k)).copy()     # [R, k] candidates to feed
        feed = np.repeat(feats[:, None], k, 1)                       # [R, k, H] their features
        n, n_scratch, rr = k, 0, np.arange(nr)[:, None]
        for _ in range(depth - 1):
            fscore = np.take_along_axis(score, frontier, 1)          # [R, k]
            if np.exp(fscore.max()) < self.level_gate:               # no row's next level would pay
                break
            fpar = np.take_along_axis(parent, frontier, 1)
            par = np.where(fpar >= 0, np.take_along_axis(scratch, np.maximum(fpar, 0), 1), -1).astype(np.int32)
            out = self.rt.forward(sids, np.take_along_axis(token, frontier, 1), par,
                                  np.broadcast_to(np.arange(k), (nr, k)).copy(),
                                  {"features": np.ascontiguousarray(feed, np.float32)})
            np.put_along_axis(scratch, frontier, n_scratch + np.arange(k)[None], 1)
            top, lp = _top_logprobs(out.logits, k)                   # [R, k, k]
            new = fscore[:, :, None] + lp                            # [R, k, k] (float64)
            block = slice(n, n + k * k)
            parent[:, block] = np.repeat(frontier, k, 1)
            token[:, block] = self.vocab[top].reshape(nr, k * k)
            score[:, block] = new.reshape(nr, k * k)
            best = np.argsort(-new.reshape(nr, k * k), 1, kind="stable")[:, :k]   # the next frontier
            frontier = n + best
            feed = out.hidden[rr, best // k]
            n, n_scratch = n + k * k, n_scratch + k
        self.rt.commit(sids, [np.zeros(0, np.int64)] * len(sids))   # drop the scratch tree
        for r, i in enumerate(rows):
            drafts[i] = self._select(seqs[i].root, parent[r, :n], token[r, :n], score[r, :n], int(budget[r]))
        return drafts

    def _catch_up(self, seqs: list[SequenceState]) -> tuple[np.ndarray, np.ndarray]:
        """Feed pending (target feature, next token) pairs; -> (root logits [R, Vd],
        predicted root features [R, H])."""
        pend, toks = [], []
        for s in seqs:
            f = head_features(np.concatenate(self._pending[s.seq_id]), self.rt.config.hidden_size, self.fc)
            fed = self._fed[s.seq_id]
            ids = s.all_ids()
            assert fed + len(f) == len(ids) - 1, (fed, len(f), len(ids))
            pend.append(f)
            toks.append(np.asarray(ids[fed + 1:], np.int64))
        t = max(len(f) for f in pend)
        h = pend[0].shape[1]
        ids = np.zeros((len(seqs), t), np.int64)
        feats = np.zeros((len(seqs), t, h), np.float32)
        parents = np.full((len(seqs), t), PAD_PARENT, np.int32)
        for r, (f, tk) in enumerate(zip(pend, toks)):
            ids[r, : len(f)] = tk
            feats[r, : len(f)] = f
            parents[r, : len(f)] = np.arange(-1, len(f) - 1)
        last = np.array([[len(f) - 1] for f in pend])
        out = self.rt.forward([s.seq_id for s in seqs], ids, parents, last, {"features": feats})
        logits = out.logits[:, 0].copy()
        root_feat = np.stack([out.hidden[r, len(f) - 1] for r, f in enumerate(pend)])
        self.rt.commit([s.seq_id for s in seqs], [np.arange(len(f)) for f in pend])
        cache = getattr(self.rt, "prefix_cache", None)
        for s, f in zip(seqs, pend):
            if cache is not None and self._fed[s.seq_id] < len(s.prompt_ids) - 1:
                tokens, root = _head_prefix(s)
                cache.publish(s.seq_id, tokens, root=root)   # the prompt is in the head's KV now
            self._fed[s.seq_id] += len(f)
            self._pending[s.seq_id] = []
        return logits, root_feat

    @staticmethod
    def _select(root: int, parent: np.ndarray, token: np.ndarray, score: np.ndarray, n: int) -> Draft:
        """The n most probable candidates ([C] arrays) as a TokenTree (parents before children)."""
        order = np.argsort(-score, kind="stable")[:n].tolist()
        keep = set(order)
        for c in order:                              # ancestor closure (ties could break it)
            p = int(parent[c])
            while p >= 0 and p not in keep:
                keep.add(p)
                p = int(parent[p])
        depth = {}
        for c in sorted(keep):
            p = int(parent[c])
            depth[c] = 1 if p < 0 else depth[p] + 1
        nodes = sorted(keep, key=lambda c: (depth[c], -score[c]))
        index = {c: i + 1 for i, c in enumerate(nodes)}
        parents = [-1] + [index[int(parent[c])] if parent[c] >= 0 else 0 for c in nodes]
        tokens = [root] + [int(token[c]) for c in nodes]
        return Draft(TokenTree(np.array(parents, np.int32)), np.array(tokens, np.int64))
