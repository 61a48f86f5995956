"""Draft-model drafting: a smaller model with the target's vocabulary proposes tokens
autoregressively (Leviathan et al. 2023; Chen et al. 2023). The draft runs through the same
Runtime code as the target: a separate checkpoint (`--draft PATH`) or the target's own first
N layers plus its head (`--draft self:N`).

Per step, for each sequence: feed the committed tokens the draft has not seen (the root at
least), then draw one token per depth. With width w > 1 each depth also gets w - 1 sibling
leaves (a "chain with alternatives" tree). Greedy requests take the draft's top tokens;
sampled requests take argmax(q / E) with q the draft's logits warped by the request's own
temperature/top-k/top-p/min-p and E the noise of the output position the token is drafted for:
the same noise the target samples that position with, so the draft agrees with the target as
often as the two distributions allow (verify.py: the Gumbel-max coupling), and the siblings are
the next best of q / E (draws without replacement). Every sampling parameter is served
losslessly, and the output is that of plain sampling with the request's seed.

The draft's KV keeps every token it was fed; after verification it is truncated back to the
committed sequence (what was accepted), so its state stays valid whatever budget the
controller gives (including steps with no speculation). Where the draft's runtime keeps a
prefix cache of its own (engine.enable_prefix_caches), a sequence starts with the cached blocks
of its prompt and the first catch-up feeds only the rest.
"""
from __future__ import annotations

import numpy as np

from backend.config import SamplingParams
from backend.drafters.base import Draft, DrafterTraits
from backend.kv_cache import PAD_PARENT
from backend.runtime.base import Runtime
from backend.sampling import target_probs
from backend.sequence import SequenceState
from backend.tree import TokenTree


class DraftModelDrafter:
    name = "draft-model"

    def __init__(self, runtime: Runtime, width: int = 1, max_tokens: int = 8):
        self.rt = runtime
        self.width = max(1, width)
        self.traits = self.make_traits(max_tokens)
        self._fed: dict[int, int] = {}           # seq_id -> tokens of all_ids in the draft KV

    @classmethod
    def make_traits(cls, max_tokens: int) -> DrafterTraits:
        return DrafterTraits(tree=False, max_budget=max_tokens, max_forwards=max_tokens,
                             cost_key=cls.name, catches_up=True)

    def check_params(self, params: SamplingParams) -> None:
        return None                              # any draw is lossless (verify.py)

    def begin(self, seq: SequenceState, prompt_hidden) -> None:
        self.rt.alloc(seq.seq_id)
        cache = getattr(self.rt, "prefix_cache", None)       # the draft's own (engine.py)
        self._fed[seq.seq_id] = cache.attach(seq.seq_id, seq.prompt_ids).tokens if cache is not None else 0

    def end(self, seq: SequenceState) -> None:
        self.rt.free(seq.seq_id)
        self._fed.pop(seq.seq_id, None)

    def observe(self, seq: SequenceState, draft: Draft, accepted_nodes, hidden) -> None:
        # the draft KV holds all_ids (as of proposing) + the chain's tokens but the last;
        # keep the accepted prefix of the chain only.
        chain = _chain_nodes(draft.tree)
        fed_chain = max(0, len(chain) - 2)       # chain tokens fed while drafting (not the last)
        accepted_chain = 0
        for node in accepted_nodes[1:]:
            if accepted_chain < fed_chain and node == chain[accepted_chain + 1]:
                accepted_chain += 1
            else:
                break
        base = self._fed[seq.seq_id]
        if fed_chain:
            self.rt.truncate(seq.seq_id, base + accepted_chain)
        self._fed[seq.seq_id] = base + accepted_chain

    def preview(self, seq: SequenceState, limit: int) -> None:
        return None                                  # drafting costs a forward

    def backlog(self, seq: SequenceState) -> int:
        return len(seq.prompt_ids) + len(seq.output_ids) - self._fed.get(seq.seq_id, 0)

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[Draft]:
        active = [i for i, k in enumerate(max_tokens) if k > 0]
        drafts = [Draft.empty(s.root) for s in seqs]
        if not active:
            return drafts
        rows = [seqs[i] for i in active]
        depth = max(max_tokens[i] for i in active)
        # 1) catch up: feed unseen committed tokens (>= 1: the root) in one ragged forward
        pend = [np.asarray(s.all_ids()[self._fed[s.seq_id]:], np.int64) for s in rows]
        t = max(p.size for p in pend)
        ids = np.zeros((len(rows), t), np.int64)
        parents = np.full((len(rows), t), PAD_PARENT, np.int32)
        for r, p in enumerate(pend):
            ids[r, : p.size] = p
            parents[r, : p.size] = np.arange(-1, p.size - 1)
        last = np.array([[p.size - 1] for p in pend])
        out = self.rt.forward([s.seq_id for s in rows], ids, parents, last)
        self.rt.commit([s.seq_id for s in rows], [np.arange(p.size) for p in pend])
        cache = getattr(self.rt, "prefix_cache", None)
        for s, p in zip(rows, pend):
            if cache is not None and self._fed[s.seq_id] < len(s.prompt_ids):
                cache.publish(s.seq_id, s.prompt_ids)        # the prompt is in the draft's KV now
            self._fed[s.seq_id] += p.size
        # 2) one token (plus siblings) per depth
        nodes = [[(-1, s.root)] for s in rows]                # (parent, token)
        chain_tip = [0] * len(rows)
        logits = out.logits[:, 0]
        for d in range(depth):
            live = [r for r, i in enumerate(active) if d < max_tokens[i]]
            nxt = []
            for r in live:
                s = rows[r]
                toks = self._draw(logits[r], s, d)
                parent = chain_tip[r]
                for j, tok in enumerate(toks):
                    nodes[r].append((parent, int(tok)))
                    if j == 0:
                        chain_tip[r] = len(nodes[r]) - 1
                nxt.append(int(toks[0]))
            if d == depth - 1 or not live:
                break
            live_ids = [rows[r].seq_id for r in live if d + 1 < max_tokens[active[r]]]
            if not live_ids:
                break
            feed = np.array([[nxt[live.index(r)]] for r in live if d + 1 < max_tokens[active[r]]], np.int64)
            o = self.rt.forward(live_ids, feed, np.full((len(live_ids), 1), -1, np.int32),
                                np.zeros((len(live_ids), 1), np.int64))
            self.rt.commit(live_ids, [np.array([0])] * len(live_ids))
            row_of = {rows[r].seq_id: r for r in live}
            logits = np.zeros((len(rows), o.logits.shape[-1]), np.float32)
            for j, sid in enumerate(live_ids):
                logits[row_of[sid]] = o.logits[j, 0]
        for r, i in enumerate(active):
            drafts[i] = Draft(TokenTree(np.array([p for p, _ in nodes[r]], np.int32)),
                              np.array([t for _, t in nodes[r]], np.int64))
        return drafts

    def _draw(self, logits: np.ndarray, seq: SequenceState, depth: int) -> np.ndarray:
        """Tokens for the output position `depth` places ahead, chain token first."""
        if seq.params.greedy:
            return np.argsort(-logits, kind="stable")[: self.width]
        q = target_probs(logits, seq.params)
        keys = q / seq.position_noise(depth)          # the target's noise at that position
        support = int(np.count_nonzero(q))
        return np.argsort(-keys, kind="stable")[: min(self.width, support)]


def _chain_nodes(tree: TokenTree) -> list[int]:
    """The chain spine: root, then each depth's first child."""
    spine = [0]
    while tree.children[spine[-1]]:
        spine.append(tree.children[spine[-1]][0])
    return spine
