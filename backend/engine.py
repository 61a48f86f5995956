"""Assemble a SpecDecoder from an engine directory: runtime, tokenizer, drafters, controller.

Used by the Triton adapters, the offline benchmarks, the build's checks and tests, so every
path builds the decoder the same way from the manifest (the only source of truth at serve time).
"""
from __future__ import annotations

from backend.config import DrafterKind, RuntimeOptions, ServeConfig, SpecConfig
from backend.controller import AdaptiveController, Controller, CostModel, FixedController
from backend.decoder import SpecDecoder
from backend.drafters.base import Drafter
from backend.manifest import EngineManifest
from backend.runtime import load_runtime
from backend.tokenizer import Tokenizer


def default_draft_model(manifest: EngineManifest) -> str | None:
    for name, d in manifest.drafts.items():
        if d.kind == "model":
            return name
    for name, d in manifest.drafts.items():
        if d.kind == "self":
            return name
    return None


def make_drafters(manifest: EngineManifest, spec: SpecConfig,
                  options: RuntimeOptions | None = None) -> dict[DrafterKind, Drafter]:
    """Every drafter the manifest can run: prompt lookup always, a draft model and the EAGLE
    head (alone and behind prompt lookup) where the build made them."""
    from backend.drafters.prompt_lookup import PromptLookupDrafter

    lookup = PromptLookupDrafter(spec.prompt_lookup_min_ngram, spec.prompt_lookup_max_ngram,
                                 spec.prompt_lookup_width, spec.max_draft_tokens)
    drafters: dict[DrafterKind, Drafter] = {DrafterKind.PROMPT_LOOKUP: lookup}
    name = spec.draft_model or default_draft_model(manifest)
    if name is not None:
        from backend.drafters.draft_model import DraftModelDrafter

        drafters[DrafterKind.DRAFT_MODEL] = DraftModelDrafter(
            load_runtime(manifest, engine=name, options=options), spec.draft_width, spec.max_draft_tokens)
    if "eagle" in manifest.drafts:
        from backend.drafters.eagle import EagleDrafter
        from backend.drafters.hybrid import LookupEagleDrafter

        eagle = EagleDrafter.from_manifest(manifest, spec, options)
        drafters[DrafterKind.EAGLE] = eagle
        drafters[DrafterKind.LOOKUP_EAGLE] = LookupEagleDrafter(lookup, eagle)
    return drafters


def make_controller(manifest: EngineManifest, spec: SpecConfig,
                    drafters: dict[DrafterKind, Drafter]) -> Controller:
    """The adaptive controller over the build's cost model, unless the server fixes K (or the
    build measured no costs). Fails (UnpricedDrafter) if a drafter has no cost entry."""
    if spec.num_draft_tokens is None and manifest.cost_model:
        return AdaptiveController({k: d.traits for k, d in drafters.items()},
                                  CostModel.from_json(manifest.cost_model))
    return FixedController(spec)


def make_decoder(cfg: ServeConfig, manifest: EngineManifest | None = None) -> SpecDecoder:
    manifest = manifest or EngineManifest.load(cfg.engine_dir)
    target = load_runtime(manifest, cfg.weight_format, options=cfg.runtime)
    drafters = make_drafters(manifest, cfg.spec, cfg.runtime)
    return SpecDecoder(target, Tokenizer.from_manifest(manifest), drafters, cfg.spec,
                       make_controller(manifest, cfg.spec, drafters), prefill_chunk=cfg.prefill_chunk)
