"""Assemble a SpecDecoder from an engine directory: runtime, tokenizer, drafters, controller.

Used by the Triton adapters, the offline benchmarks and tests, so every path builds the decoder
the same way from the manifest (the only source of truth at serve time).
"""
from __future__ import annotations

from dataclasses import replace

from backend.config import DrafterKind, ServeConfig, SpecConfig
from backend.decoder import SpecDecoder
from backend.manifest import EngineManifest
from backend.runtime import load_draft_runtime, load_runtime
from backend.controller import AdaptiveController, CostModel, FixedController
from backend.tokenizer import Tokenizer


def default_draft_model(manifest: EngineManifest) -> str | None:
    for name, d in manifest.drafts.items():
        if d.kind == "model":
            return name
    for name, d in manifest.drafts.items():
        if d.kind == "self":
            return name
    return None


def make_decoder(cfg: ServeConfig, manifest: EngineManifest | None = None) -> SpecDecoder:
    from backend.drafters.prompt_lookup import PromptLookupDrafter

    manifest = manifest or EngineManifest.load(cfg.engine_dir)
    spec = cfg.spec
    target = load_runtime(manifest, cfg.weight_format, threads=cfg.threads, spinning=cfg.spinning)
    drafters = {DrafterKind.PROMPT_LOOKUP: PromptLookupDrafter(
        spec.prompt_lookup_min_ngram, spec.prompt_lookup_max_ngram, spec.prompt_lookup_width)}
    name = spec.draft_model or default_draft_model(manifest)
    if name is not None:
        from backend.drafters.draft_model import DraftModelDrafter

        drafters[DrafterKind.DRAFT_MODEL] = DraftModelDrafter(
            load_draft_runtime(manifest, name, threads=cfg.threads, spinning=cfg.spinning),
            spec.draft_width)
    if "eagle" in manifest.drafts:
        from backend.drafters.eagle import EagleDrafter
        from backend.drafters.hybrid import LookupEagleDrafter

        eagle = EagleDrafter.from_manifest(manifest, spec, threads=cfg.threads)
        drafters[DrafterKind.EAGLE] = eagle
        drafters[DrafterKind.LOOKUP_EAGLE] = LookupEagleDrafter(
            drafters[DrafterKind.PROMPT_LOOKUP], eagle, spec.max_draft_tokens)
    controller = FixedController(spec)
    if spec.num_draft_tokens is None and manifest.cost_model:
        controller = AdaptiveController(spec, CostModel.from_json(manifest.cost_model),
                                        tree_kinds=frozenset({DrafterKind.EAGLE, DrafterKind.LOOKUP_EAGLE}))
    return SpecDecoder(target, Tokenizer.from_manifest(manifest), drafters, spec, controller,
                       prefill_chunk=cfg.prefill_chunk)
