"""The Drafter protocol: everything that proposes token trees for the target to verify.

A drafter proposes, per sequence, a `Draft`: a TokenTree whose root is the sequence's last token
plus the drafted tokens. Verification needs nothing else: whatever a drafter drew its tokens
from, the token emitted at each output position is the target's own sample with that position's
noise (verify.py), so a drafter only decides which candidates get checked.
`max_tokens` bounds the drafted nodes (0 = propose nothing: a plain decoding step). After the
target verified a step, `observe` tells the drafter which nodes were kept and gives the target's
final-norm features of the kept nodes (EAGLE heads read them). A drafter keeps its own
per-sequence state keyed by seq_id and must stay valid when a step proposes nothing (speculation
switched off and on again by the controller).

Each drafter states what it is once, in its `traits` (tree or chain, largest budget, the draft
forwards a budget costs, its cost-model entry); the decoder, the controllers and the build read
them there and nowhere else keep lists of drafter kinds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from backend.config import SamplingParams
from backend.sequence import SequenceState
from backend.tree import TokenTree


@dataclass(frozen=True)
class DrafterTraits:
    tree: bool              # proposes trees whose size is the budget (the controller learns tokens
                            # per tree size); False: chains (it learns acceptance per depth)
    max_budget: int         # largest budget: chain length or tree nodes, the root excluded
    max_forwards: int       # sequential draft forwards the largest budget costs (0: free)
    cost_key: str           # its entry in the build's cost model (draft_step_s, catch_up_s)
    catches_up: bool = False    # a model of its own that must be fed what it has not seen
    needs_hidden: bool = False  # wants the target's final-norm features in begin()/observe()

    def forwards(self, budget: int) -> int:
        """Sequential draft forwards of one step with this budget."""
        return min(budget, self.max_forwards) if budget > 0 else 0


_ROOT_ALONE = TokenTree.chain(0)


@dataclass
class Draft:
    tree: TokenTree
    tokens: np.ndarray                     # [num_nodes] int64, tokens[0] = root (last token)

    @classmethod
    def empty(cls, root: int) -> "Draft":
        """The root alone (a plain step): one tree shared by every such draft (nothing changes a
        tree after it is made), so a plain step builds and checks no tree (perf-notes §40)."""
        return cls(_ROOT_ALONE, np.array([root], np.int64))

    @property
    def num_draft_tokens(self) -> int:
        return self.tree.num_nodes - 1


class Drafter(Protocol):
    name: str
    traits: DrafterTraits

    def check_params(self, params: SamplingParams) -> None:
        """Raise RequestError if this drafter cannot serve these parameters losslessly."""

    def begin(self, seq: SequenceState, prompt_hidden: np.ndarray | None) -> None:
        """A sequence was prefilled (prompt_hidden: [P, H] target features, if needed)."""

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[Draft]:
        """One Draft per sequence with at most max_tokens[i] drafted nodes."""

    def preview(self, seq: SequenceState, limit: int) -> list[int] | None:
        """Free drafters only (no forward, no state change): the chain propose() would start with,
        up to `limit` tokens ([] = it has nothing to propose); None = drafting costs a forward.
        The controller budgets with it and scores it against the text that follows."""

    def backlog(self, seq: SequenceState) -> int:
        """Tokens the next propose() must feed its own model before drafting (the catch-up over
        the prompt and the steps it did not draft; 0 for drafters without a model). The
        controller prices it: a first draft after a long prompt costs a forward over all of it."""

    def observe(self, seq: SequenceState, draft: Draft, accepted_nodes: np.ndarray,
                hidden: np.ndarray | None) -> None:
        """Target verdict for a step: kept nodes (root first) and their features [n, H]."""

    def end(self, seq: SequenceState) -> None:
        """The sequence finished or was cancelled: free its state."""
