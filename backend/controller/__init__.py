"""How much to speculate: controllers choose each step's draft budget per row (the decoder asks
once per step, then clamps each row to its drafter's largest budget and the room it has left).

FixedController: K from the request or the server config (0 = plain decoding).
AdaptiveController (adaptive.py): the budget that maximises expected batch tokens per second,
from the cost model (cost.py), chain acceptance (chains.py), tree yields (trees.py) and the
drafters' catch-up (catch_up.py).
"""
from __future__ import annotations

from typing import Protocol

from backend.config import DrafterKind, SpecConfig
from backend.controller.adaptive import AdaptiveController
from backend.controller.cost import CostModel, UnpricedDrafter
from backend.sequence import SequenceState

__all__ = ["AdaptiveController", "Controller", "CostModel", "FixedController", "UnpricedDrafter"]


class Controller(Protocol):
    wants_previews: bool     # budgets() wants free drafters' previews
    wants_backlogs: bool     # budgets() wants the drafters' catch-up backlogs

    def budgets(self, seqs: list[SequenceState], previews: list[list[int] | None] | None = None,
                backlogs: list[int] | None = None) -> list[int]:
        """Draft budget per row (the decoder clamps it)."""

    def observe(self, seq: SequenceState, draft, verdict) -> None:
        """A row's step: what was drafted (Draft) and what verification kept (TreeVerdict)."""

    def observe_step(self, batch: int, width: int, draft_s: float, verify_s: float, nodes: int | None = None) -> None:
        """A whole step: batch rows x width tokens (`nodes` of them real), its draft and verify seconds."""

    def corrections(self) -> dict[str, float]:
        """Named live / build-time cost ratios, for metrics."""

    def forget(self, seq: SequenceState) -> None:
        """The request finished."""


class FixedController:
    wants_previews = False
    wants_backlogs = False

    def __init__(self, spec: SpecConfig, default_k: int = 4):
        self.k = spec.num_draft_tokens if spec.num_draft_tokens is not None else default_k

    def budgets(self, seqs: list[SequenceState], previews=None, backlogs=None) -> list[int]:
        return [0 if s.drafter is DrafterKind.NONE else
                s.request.num_draft_tokens if s.request.num_draft_tokens is not None else self.k
                for s in seqs]

    def observe(self, seq, draft, verdict) -> None:
        return None

    def observe_step(self, batch: int, width: int, draft_s: float, verify_s: float, nodes: int | None = None) -> None:
        return None

    def corrections(self) -> dict[str, float]:
        return {}

    def forget(self, seq) -> None:
        return None
