"""What one drafter kind owns, from `--draft` to the drafter a request is served by.

Knows: the contract (the `--draft` spec form, the manifest entry it writes through the serving
device's backend, the target features it needs, how its cost is timed, the drafters it makes
from a built manifest). Does not know: any particular kind (draft_kinds/*.py), the decode step.

The build (builder/pipeline.py), the cost model (builder/costs.py) and the assembly
(engine.make_drafters) iterate over `draft_kinds.KINDS`, so a kind is its drafter
(drafters/X.py), its kind file here and a registry line; `draft_kinds.registered(kind)` adds
one for a while (tests).
"""
from __future__ import annotations

from typing import Callable

from backend.config import DrafterKind, RuntimeOptions, SpecConfig
from backend.manifest import DraftEntry, EngineFile, EngineManifest, ModelConfig


class DraftKind:
    """The contract; a kind without a build (prompt lookup) keeps the defaults of the build side."""

    name: str = ""                            # for messages: "eagle", "draft model", ...
    spec_form: str | None = None              # `--draft` form for --help ("eagle:DIR"); None: no build
    prefix: str | None = None                 # the spec's prefix ("eagle:"); None: not prefix-matched
    entry_kinds: tuple[str, ...] = ()         # DraftEntry.kind values it writes and reads
    fallback: bool = False                    # takes a spec no other kind's prefix matches (a path)

    def accepts(self, spec: str) -> bool:
        """Whether a `--draft` spec is this kind's (by its prefix)."""
        return self.prefix is not None and spec.startswith(self.prefix)

    def target_features(self, spec: str, cfg: ModelConfig) -> tuple[int, ...]:
        """Target layers whose features the serving engines must output for this draft (EAGLE-3)."""
        return ()

    def export(self, ctx, spec: str, backend, serving: EngineFile) -> tuple[str, DraftEntry]:
        """Write the draft for the serving engine's backend (devices.EngineBackend) ->
        (manifest name, DraftEntry). A kind without a spec form (prompt lookup) is never asked:
        `kind_for` only returns kinds whose prefix a spec has, or the fallback."""
        raise ValueError(f"the {self.name} drafter needs no build: it has no --draft form")

    def time(self, manifest: EngineManifest, context: int, reps: int) -> dict[str, tuple[float, float | None]]:
        """{cost key: (seconds per draft forward, seconds per catch-up token or None)} of the
        drafters this manifest gives the kind; {} when it has none or they are free."""
        return {}

    def make(self, manifest: EngineManifest, spec: SpecConfig, options: RuntimeOptions | None,
             made: dict, want: Callable[[DrafterKind], bool]) -> dict:
        """{DrafterKind: drafter} this kind serves from `manifest`. `made`: the drafters made so
        far (prompt lookup first, and a draft node's remote drafter in place of a local one),
        which a kind may build on; `want(kind)`: whether the caller asked for it."""
        return {}
