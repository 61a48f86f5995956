"""A draft model: a separate checkpoint (`--draft PATH`) or the target's own first N layers and
head (`--draft self:N`), served as the `draft-model` drafter. A checkpoint with a vocabulary of
its own is exported the same way and its entry becomes `cross-vocab` (the vocabulary map beside
it, buildlib/drafts.py), which draft_kinds/cross_vocab.py times and serves.

Knows: both spec forms, which built draft serves (a separate model over the first layers), how a
draft forward and its catch-up are timed. Does not know: engine formats (the backend writes them).
"""
from __future__ import annotations

from backend.config import DrafterKind
from backend.draft_kinds.base import DraftKind
from backend.manifest import EngineManifest


def default_draft_model(manifest: EngineManifest) -> str | None:
    """The manifest draft `draft-model` serves unless SpecConfig.draft_model names one: a
    separate draft model, else the first self-draft."""
    for kind in ("model", "self"):
        for name, d in manifest.drafts.items():
            if d.kind == kind:
                return name
    return None


class DraftModelKind(DraftKind):
    name = "draft model"
    spec_form = "PATH | self:N"
    prefix = "self:"
    fallback = True                    # a spec no other kind takes is a checkpoint path
    entry_kinds = ("model", "self")

    def export(self, ctx, spec, backend, serving):
        from backend.buildlib import drafts as drafts_mod

        if spec.startswith(self.prefix):
            return backend.export_layers(ctx, drafts_mod.self_layers(spec, ctx.ck.config), serving)
        dck = drafts_mod.draft_checkpoint(spec, ctx.ck.config)
        vmap = drafts_mod.vocabulary_map(dck, ctx.ck, ctx.tokenizer_json.read_text(encoding="utf-8"))
        name, entry = backend.export_model(ctx, spec, serving)
        return (name, entry) if vmap is None else (name, drafts_mod.cross_vocab_entry(ctx, entry, dck, vmap))

    def time(self, manifest, context, reps):
        from backend.buildlib.timing import step_and_catch_up
        from backend.devices import load_runtime

        name = default_draft_model(manifest)
        if name is None:
            return {}
        rt = load_runtime(manifest, engine=name)
        cost = step_and_catch_up(rt, context, reps, 20_000)
        rt.close()
        return {DrafterKind.DRAFT_MODEL.value: cost}

    def make(self, manifest, spec, options, made, want):
        if DrafterKind.DRAFT_MODEL in made or not want(DrafterKind.DRAFT_MODEL):
            return {}
        name = spec.draft_model or default_draft_model(manifest)
        if name is None or (name in manifest.drafts and manifest.drafts[name].kind not in self.entry_kinds):
            return {}
        from backend.devices import load_runtime
        from backend.drafters.draft_model import DraftModelDrafter

        return {DrafterKind.DRAFT_MODEL: DraftModelDrafter(load_runtime(manifest, engine=name, options=options),
                                                           spec.draft_width, spec.max_draft_tokens)}
