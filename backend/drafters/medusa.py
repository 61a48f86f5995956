"""Medusa heads (Cai et al. 2024) as a drafter: K small heads on the target's last final-norm
hidden state; head k proposes the token k + 2 positions ahead of the one that state was computed
at, i.e. the (k+1)-th token after the root. Each head is `num_layers` residual blocks
x + SiLU(W x + b) followed by its own LM head [V, H]. The drafter proposes the chain of the
heads' top tokens (a point-mass draft: verification emits the target's tokens whatever they are,
so every sampling parameter is served losslessly).

Published layout (FasterDecoding/Medusa, Medusa-1): `config.json` with `medusa_num_heads`,
`medusa_num_layers`, and `medusa_lm_head.safetensors` (or `medusa_lm_head.pt`) with keys
`{k}.{j}.linear.weight` / `.bias` for block j of head k and `{k}.{num_layers}.weight` for its LM
head. The build copies the heads into the engine directory (`draft_medusa.npz`); they run in
numpy on the host, one matrix product per block and head (buildlib/heads/medusa.py reads and
copies them). Knows: Medusa's math. Does not know: the target's runtime.
"""
from __future__ import annotations

import numpy as np

from backend.config import SamplingParams
from backend.drafters.base import Draft, DrafterTraits
from backend.sequence import SequenceState
from backend.tree import TokenTree


class MedusaDrafter:
    name = "medusa"

    def __init__(self, weights: dict[str, np.ndarray], num_heads: int, num_layers: int):
        self.w, self.k, self.layers = weights, num_heads, num_layers
        self.traits = self.make_traits(num_heads)
        self._last: dict[int, np.ndarray] = {}          # seq_id -> final-norm hidden of the last fed token

    @classmethod
    def make_traits(cls, num_heads: int) -> DrafterTraits:
        return DrafterTraits(tree=False, max_budget=num_heads, max_forwards=1, cost_key=cls.name,
                             needs_hidden=True)

    @classmethod
    def from_manifest(cls, manifest) -> "MedusaDrafter":
        d = manifest.drafts["medusa"]
        with np.load(manifest.resolve(d.path)) as z:
            weights = {k: z[k] for k in z.files}
        return cls(weights, int(d.head["num_heads"]), int(d.head["num_layers"]))

    def check_params(self, params: SamplingParams) -> None:
        return None                                      # point-mass drafts: lossless for all

    def begin(self, seq: SequenceState, prompt_hidden) -> None:
        self._last[seq.seq_id] = self._final_norm(prompt_hidden[-1])

    def observe(self, seq: SequenceState, draft: Draft, accepted_nodes, hidden) -> None:
        self._last[seq.seq_id] = self._final_norm(hidden[-1])

    def _final_norm(self, h: np.ndarray) -> np.ndarray:
        """The final-norm part of a target feature row (EAGLE-3 layer features may follow it)."""
        return np.asarray(h[: self.w["head0"].shape[1]], np.float32)

    def end(self, seq: SequenceState) -> None:
        self._last.pop(seq.seq_id, None)

    def preview(self, seq: SequenceState, limit: int) -> None:
        return None

    def backlog(self, seq: SequenceState) -> int:
        return 0

    def heads(self, h: np.ndarray, n: int) -> np.ndarray:
        """Logits [R, n, V] of the first n heads on hidden states h [R, H]."""
        out = []
        for k in range(n):
            x = h
            for j in range(self.layers):
                y = x @ self.w[f"w{k}_{j}"].T + self.w[f"b{k}_{j}"]
                x = x + y / (1.0 + np.exp(-y))           # x + SiLU(W x + b)
            out.append(x @ self.w[f"head{k}"].T)
        return np.stack(out, 1)

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[Draft]:
        drafts = [Draft.empty(s.root) for s in seqs]
        rows = [i for i, m in enumerate(max_tokens) if m > 0]
        if not rows:
            return drafts
        n = min(self.k, max(max_tokens[i] for i in rows))
        top = self.heads(np.stack([self._last[seqs[i].seq_id] for i in rows]), n).argmax(-1)   # [R, n]
        for r, i in enumerate(rows):
            m = min(n, max_tokens[i])
            drafts[i] = Draft(TokenTree.chain(m), np.array([seqs[i].root, *top[r, :m]], np.int64))
        return drafts
