"""Drafter kinds: every kind's build, pricing and assembly side, listed once (`KINDS`).

Knows: the kinds, which one takes a `--draft` spec. Does not know: what a kind does inside
(draft_kinds/*.py, contract in base.py). Layering: above the device seam and the build's
library (backend/buildlib; a kind exports through the serving backend and loads its runtime
through it), below the assembly (engine.py) and the build's orchestration (builder/pipeline.py,
builder/costs.py).
"""
from __future__ import annotations

import contextlib

from backend.draft_kinds.base import DraftKind
from backend.draft_kinds.cross_vocab import CrossVocabKind
from backend.draft_kinds.draft_model import DraftModelKind, default_draft_model
from backend.draft_kinds.eagle import EagleKind, eagle_drafter
from backend.draft_kinds.medusa import MedusaKind
from backend.draft_kinds.prompt_lookup import PromptLookupKind
from backend.draft_kinds.suffix import SuffixKind

__all__ = ["KINDS", "DraftKind", "default_draft_model", "eagle_drafter", "kind_for", "registered", "spec_forms"]

# One line per kind, in the order their drafters are made (a kind may build on earlier ones:
# lookup+eagle on prompt lookup).
KINDS: list[DraftKind] = [PromptLookupKind(), SuffixKind(), DraftModelKind(), CrossVocabKind(), EagleKind(),
                          MedusaKind()]


def kind_for(spec: str) -> DraftKind:
    """The kind of a `--draft` spec: the one whose prefix it has, else the fallback (a path)."""
    for k in KINDS:
        if k.accepts(spec):
            return k
    for k in KINDS:
        if k.fallback:
            return k
    raise ValueError(f"--draft {spec!r}: not a draft this build knows ({spec_forms()})")


def spec_forms() -> str:
    return ", ".join(k.spec_form for k in KINDS if k.spec_form)


@contextlib.contextmanager
def registered(kind: DraftKind):
    """`kind` in the registry for a while (a test's own kind); its drafter name with it."""
    KINDS.append(kind)
    try:
        yield kind
    finally:
        KINDS.remove(kind)
