"""A draft model with another tokenizer than the target's (issue 28; Timor et al., ICML 2025,
arXiv:2502.05202), served as the `draft-model` drafter. Two methods, chosen per row and step by
measured acceptance and cost (controller/methods.py):

- SLEM (string-level exact match): the draft writes in its own vocabulary, its text is
  re-tokenized by the target's tokenizer (drafters/retokenize.py: look-behind, the last
  candidate dropped when it could grow) and the target tokens are proposed as a chain. It can
  propose target tokens the draft has no single token for, and more than one per forward.
- TLI (token-level intersection): the draft's distribution restricted to the tokens both
  vocabularies share, summed where several draft tokens are one target token (the pushforward,
  VocabMap.compact), drawn as argmax(q / E) with the target's own noise E of that output
  position, so sampled acceptance keeps the Gumbel-max coupling (verify.py); siblings are the
  next best (a chain with alternatives, `width`).
Whatever is proposed, verification emits the target's own token at every position (verify.py),
so output is plain decoding's, greedy or seeded sampled, token for token.

State per sequence: the committed text (bytes of the target's tokens), the draft's tokens in its
KV and the byte each one ends at. Before a proposal the last one is scored against the ids the
target committed (the same locally and on a draft node) and the KV is cut back to the draft
tokens whose text the target committed; one more token is backed off and the new committed text
is encoded with the draft's tokenizer (so a word the target finished is the draft's own token
again). A text that ends inside a UTF-8 character is not drafted from until it is complete.
Counts: draft tokens drawn and those outside the intersection (the draft's own choice had no
target token), and the rows drafted by each method (SLEM, TLI: MethodChoice's pick), reported
through `on_vocab` (metrics).
Knows: the vocabulary map, both tokenizers, the draft runtime. Does not know: Triton, the build.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import numpy as np

from backend.config import SamplingParams
from backend.controller.methods import MethodChoice
from backend.drafters.base import Draft, DrafterTraits
from backend.drafters.retokenize import encode_bytes, incomplete_tail, look_behind, retokenize
from backend.kv_cache import PAD_PARENT
from backend.runtime.base import Runtime
from backend.sampling import target_probs
from backend.tree import TokenTree
from backend.vocab_map import VocabMap

SLEM, TLI = "slem", "tli"


@dataclass
class _Seq:
    ids: list[int] = field(default_factory=list)         # committed target tokens read
    text: bytearray = field(default_factory=bytearray)   # committed text
    ends: list[int] = field(default_factory=list)        # byte end of each target token read
    toks: list[int] = field(default_factory=list)        # draft tokens in the draft's KV
    tends: list[int] = field(default_factory=list)       # byte end of each of them (prefix: 0)
    kv: bytearray = field(default_factory=bytearray)     # the text the draft's KV stands for
    sure: int = 0                                        # kv[:sure] is committed text
    last: tuple | None = None                            # the last draft: (method, forwards, host
                                                         # seconds, Draft, committed ids then)


class CrossVocabDrafter:
    name = "draft-model"

    def __init__(self, runtime: Runtime, vmap: VocabMap, target_encoder, draft_encoder,
                 width: int = 1, max_tokens: int = 8, verify_s: float = 1.0, forward_s: float = 0.5,
                 methods: tuple[str, ...] = (SLEM, TLI)):
        self.rt, self.vm = runtime, vmap
        self.tenc, self.denc = target_encoder, draft_encoder
        self.width = max(1, width)
        self.traits = self.make_traits(max_tokens)
        self.choice = MethodChoice(methods, verify_s, forward_s)
        self.prefix = [vmap.draft_bos] if vmap.draft_bos >= 0 else []
        self.union = vmap.union
        mapped, where = vmap.mapped, vmap.compact[vmap.mapped]
        self.first_pre = np.zeros(self.union.size, np.int64)     # union index -> a draft token of it
        self.first_pre[where[::-1]] = mapped[::-1]
        counts = np.bincount(where, minlength=self.union.size)
        self.many = {int(u): mapped[where == u] for u in np.flatnonzero(counts > 1)}   # several: the likeliest
        self.on_vocab = lambda drafted, outside, methods=None: None
        self.drafted = self.outside = 0
        self.method_rows: dict[str, int] = dict.fromkeys(methods, 0)   # rows drafted by each, since start
        self._s: dict[int, _Seq] = {}

    @classmethod
    def make_traits(cls, max_tokens: int) -> DrafterTraits:
        return DrafterTraits(tree=False, max_budget=max_tokens, max_forwards=max_tokens,
                             cost_key="cross-vocab", catches_up=True)

    def check_params(self, params: SamplingParams) -> None:
        return None                                    # any proposal is lossless (verify.py)

    def begin(self, seq, prompt_hidden) -> None:
        self.rt.alloc(seq.seq_id)
        self._s[seq.seq_id] = _Seq()

    def end(self, seq) -> None:
        self.rt.free(seq.seq_id)
        self._s.pop(seq.seq_id, None)

    def preview(self, seq, limit: int) -> None:
        return None                                    # drafting costs a forward

    def backlog(self, seq) -> int:
        st = self._read(seq)
        return len(st.ends) - bisect.bisect_right(st.ends, self._same(st)) + 1

    def observe(self, seq, draft: Draft, accepted_nodes, hidden) -> None:
        return None            # settled at the next proposal, from the committed ids (_settle)

    # --- committed text and the draft's KV ----------------------------------------------------
    def _read(self, seq) -> _Seq:
        """Append the bytes of target tokens committed since the last read."""
        st = self._s[seq.seq_id]
        ids = seq.all_ids()
        st.ids += ids[len(st.ids):]
        for t in st.ids[len(st.ends):]:
            st.text += self.vm.target_bytes[t] or b""
            st.ends.append(len(st.text))
        return st

    @staticmethod
    def _same(st: _Seq) -> int:
        """How much of the text the draft's KV stands for is committed text."""
        spec, new = bytes(st.kv[st.sure:]), bytes(st.text[st.sure:len(st.kv)])
        return st.sure + next((i for i, (a, b) in enumerate(zip(spec, new)) if a != b), len(new))

    def _settle(self, seq, st: _Seq) -> None:
        """After a verified step: score the last draft against the ids the target committed
        (walking its tree: the accepted count, the same locally and on a draft node, whose
        observe sees only the root kept) and cut the KV back to committed text."""
        if st.last is not None and len(st.ids) > st.last[4]:
            method, forwards, seconds, draft, n = st.last
            node, accepted = 0, 0
            for t in st.ids[n:]:
                node = next((c for c in draft.tree.children[node] if int(draft.tokens[c]) == t), None)
                if node is None:
                    break
                accepted += 1
            self.choice.observe(seq.params.greedy, method, accepted, forwards, seconds)
            st.last = None
        self._cut(seq, st, bisect.bisect_right(st.tends, self._same(st)))
        st.sure = len(st.kv)

    def _cut(self, seq, st: _Seq, n: int) -> None:
        """Keep the first n draft tokens of the KV."""
        if n < len(st.toks):
            self.rt.truncate(seq.seq_id, n)
            del st.toks[n:], st.tends[n:]
            del st.kv[st.tends[-1] if st.tends else 0:]
            st.sure = min(st.sure, len(st.kv))

    def _catch_up(self, seq, st: _Seq) -> list[int] | None:
        """Back off the last draft token (its text may merge with what followed) and encode the
        committed text after it -> tokens to feed, or None when the row cannot draft now."""
        if incomplete_tail(bytes(st.text[-4:])) or not (st.text or self.prefix):
            return None
        n = len(st.toks)
        if n > len(self.prefix):
            end = st.tends[-1]
            while n > len(self.prefix) and st.tends[n - 1] == end:
                n -= 1
        elif len(st.kv) == len(st.text):       # nothing new: the prefix again, for its logits
            n = 0
        self._cut(seq, st, n)
        feed = [] if st.toks else list(self.prefix)
        start = len(st.kv)
        pending = bytes(st.text[start:])
        ids = encode_bytes(self.denc, pending, self.vm.single_bytes)
        spelled = [self.vm.draft_bytes[t] or b"" for t in ids]
        feed += ids
        if not feed:
            return None
        st.toks += feed
        if b"".join(spelled) == pending:
            st.tends += [0] * (len(feed) - len(ids)) + (start + np.cumsum([len(b) for b in spelled])).tolist()
        else:                             # the encoding does not spell the text: one unit
            st.tends += [0] * (len(feed) - len(ids)) + [len(st.text)] * len(ids)
        st.kv += pending
        st.sure = len(st.kv)
        return feed

    # --- the step --------------------------------------------------------------------------
    def propose(self, seqs, max_tokens: list[int]) -> list[Draft]:
        drafts = [Draft.empty(s.root) for s in seqs]
        rows, feeds = [], []
        for i, (s, k) in enumerate(zip(seqs, max_tokens)):
            if k <= 0:
                continue
            st = self._read(s)
            self._settle(s, st)
            if self.rt.length(s.seq_id) + len(st.text) - len(st.kv) + k + 8 >= self.rt.max_seq_len:
                continue                   # the draft's KV would overflow (its tokens outnumber the target's)
            feed = self._catch_up(s, st)
            if feed is not None:
                rows.append(i)
                feeds.append(feed)
        if not rows:
            return drafts
        t = max(len(f) for f in feeds)
        ids = np.zeros((len(rows), t), np.int64)
        parents = np.full((len(rows), t), PAD_PARENT, np.int32)
        for r, f in enumerate(feeds):
            ids[r, :len(f)] = f
            parents[r, :len(f)] = np.arange(-1, len(f) - 1)
        sids = [seqs[i].seq_id for i in rows]
        out = self.rt.forward(sids, ids, parents, np.array([[len(f) - 1] for f in feeds]))
        self.rt.commit(sids, [np.arange(len(f)) for f in feeds])
        logits = {r: out.logits[n, 0] for n, r in enumerate(rows)}
        made = {}
        for i in rows:
            s = seqs[i]
            method = self.choice.pick(s.params.greedy)
            made[i] = (_Slem if method == SLEM else _Tli)(self, s, self._s[s.seq_id], max_tokens[i])
        live = dict(made)
        while live:
            step = {i: tok for i, row in live.items() if (tok := row.draw(logits[i])) is not None}
            if not step:
                break
            sids = [seqs[i].seq_id for i in step]
            o = self.rt.forward(sids, np.array([[tok] for tok in step.values()], np.int64),
                                np.full((len(step), 1), -1, np.int32), np.zeros((len(step), 1), np.int64))
            self.rt.commit(sids, [np.array([0])] * len(step))
            for n, (i, tok) in enumerate(step.items()):
                st = self._s[seqs[i].seq_id]
                st.kv += self.vm.draft_bytes[tok]
                st.toks.append(tok)
                st.tends.append(len(st.kv))
                logits[i] = o.logits[n, 0]
                live[i].forwards += 1
            live = {i: live[i] for i in step}
        drawn = outside = 0
        methods: dict[str, int] = {}
        for i, row in made.items():
            drafts[i] = row.draft()
            st = self._s[seqs[i].seq_id]
            st.last = (row.method, row.forwards, row.seconds, drafts[i], len(st.ids))
            drawn, outside = drawn + row.drawn, outside + row.outside
            methods[row.method] = methods.get(row.method, 0) + 1
        self.drafted += drawn
        self.outside += outside
        for m, n in methods.items():
            self.method_rows[m] = self.method_rows.get(m, 0) + n
        self.on_vocab(drawn, outside, methods)
        return drafts

    # --- draws ------------------------------------------------------------------------------
    def probs(self, logits: np.ndarray, params: SamplingParams) -> np.ndarray:
        """The draft's distribution over its vocabulary: the request's warping where it samples,
        the plain softmax where it is greedy (TLI sums probabilities, not logits)."""
        if params.greedy:
            z = logits.astype(np.float64)
            p = np.exp(z - z.max())
            return p / p.sum()
        return target_probs(logits, params)


def best(keys: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest keys, largest first (ties: the lower index), without sorting all."""
    if n == 1:
        return np.array([int(np.argmax(keys))])
    top = np.argpartition(-keys, n - 1)[:n] if n < keys.size else np.arange(keys.size)
    return top[np.lexsort((top, -keys[top]))]


class _Row:
    """One row's draft in one step: draws from the draft's logits and says which draft token to
    feed next (None: done)."""

    method = ""

    def __init__(self, d: CrossVocabDrafter, seq, st: _Seq, budget: int):
        self.d, self.seq, self.st, self.budget = d, seq, st, budget
        self.forwards, self.seconds = 1, 0.0         # the catch-up forward; host seconds
        self.drawn = self.outside = 0                # draft tokens drawn, outside the intersection

    def own(self, logits: np.ndarray, q: np.ndarray | None, offset: int) -> int:
        """The draft's own token (its argmax, or its sample with the target's noise of that
        position, VocabMap.noise_index), counted."""
        if q is None:
            tok = int(np.argmax(logits))
        else:
            tok = int(np.argmax(q / self.seq.position_noise(offset)[self.d.vm.noise_index]))
        self.drawn += 1
        self.outside += int(self.d.vm.to_target[tok] < 0)
        return tok


class _Slem(_Row):
    """The draft writes freely; its text, re-tokenized by the target, is the chain."""

    method = SLEM

    def __init__(self, d, seq, st, budget):
        super().__init__(d, seq, st, budget)
        self.behind_ids, self.behind = look_behind(d.vm, st.ids, st.text, st.ends)
        self.text = bytearray()
        self.cands: list[int] = []

    def draw(self, logits: np.ndarray) -> int | None:
        p = self.seq.params
        tok = self.own(logits, None if p.greedy else self.d.probs(logits, p), len(self.cands))
        b = self.d.vm.draft_bytes[tok]
        if b is None:                                 # the draft ends its text (EOS, a control token)
            return None
        self.text += b
        t0 = time.perf_counter()
        self.cands = retokenize(self.d.tenc, self.d.vm, self.behind_ids, self.behind, bytes(self.text))[: self.budget]
        self.seconds += time.perf_counter() - t0
        return None if len(self.cands) >= self.budget or self.forwards >= self.budget else tok

    def draft(self) -> Draft:
        return Draft(TokenTree.chain(len(self.cands)), np.array([self.seq.root] + self.cands, np.int64))


class _Tli(_Row):
    """One target token per forward from the draft's distribution on the intersection, drawn with
    the target's noise; `width - 1` next best siblings per depth."""

    method = TLI

    def __init__(self, d, seq, st, budget):
        super().__init__(d, seq, st, budget)
        self.nodes = [(-1, seq.root)]                # (parent, token)
        self.tip = self.depth = 0                    # the chain's last node and its depth

    def draw(self, logits: np.ndarray) -> int | None:
        d, p = self.d, self.seq.params
        depth = self.depth
        q = d.probs(logits, p)
        self.own(logits, None if p.greedy else q, depth)
        qu = d.vm.pushforward(q)
        if not qu.any():                  # the request's cut-offs left nothing shared: the softmax
            qu = d.vm.pushforward(d.probs(logits, SamplingParams()))
        keys = qu if p.greedy else qu / self.seq.position_noise(depth)[d.union]
        order = best(keys, d.width)
        order = order[qu[order] > 0]
        if not order.size:
            return None
        parent = self.tip
        for j, u in enumerate(order):
            self.nodes.append((parent, int(d.union[u])))
            if j == 0:
                self.tip = len(self.nodes) - 1
        self.depth += 1
        if self.depth >= self.budget:
            return None
        u = int(order[0])
        pre = d.many.get(u)
        return int(d.first_pre[u] if pre is None else pre[np.argmax(q[pre])])

    def draft(self) -> Draft:
        return Draft(TokenTree(np.array([n for n, _ in self.nodes], np.int32)),
                     np.array([t for _, t in self.nodes], np.int64))
