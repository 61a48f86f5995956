"""Prompt lookup (n-gram match over the prompt and the output): no build, free to draft."""
from __future__ import annotations

from backend.config import DrafterKind
from backend.draft_kinds.base import DraftKind


class PromptLookupKind(DraftKind):
    name = "prompt lookup"

    def time(self, manifest, context, reps):
        return {DrafterKind.PROMPT_LOOKUP.value: (0.0, None)}

    def make(self, manifest, spec, options, made, want):
        from backend.drafters.prompt_lookup import PromptLookupDrafter

        return {DrafterKind.PROMPT_LOOKUP: PromptLookupDrafter(spec.prompt_lookup_min_ngram, spec.prompt_lookup_max_ngram,
                                                               spec.prompt_lookup_width, spec.max_draft_tokens)}
