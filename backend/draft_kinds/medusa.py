"""Medusa-1 heads (`--draft medusa:DIR`), served as the `medusa` drafter in host numpy on every
device. Knows: the spec, the entry, how a proposal is timed. Does not know: the published
layout (buildlib/heads/medusa.py)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from backend.config import DrafterKind
from backend.draft_kinds.base import DraftKind


class MedusaKind(DraftKind):
    name = "Medusa heads"
    spec_form = "medusa:DIR"
    prefix = "medusa:"
    entry_kinds = ("medusa",)

    def export(self, ctx, spec, backend, serving):
        """The heads copied for the host drafter: the same on every device."""
        from backend.buildlib import drafts as drafts_mod
        from backend.buildlib.heads.medusa import ENGINE_FILE, export_medusa
        from backend.manifest import DraftEntry

        d = drafts_mod.head_dir(spec)
        head = export_medusa(d, ctx.engine_dir, ctx.ck.config.hidden_size, ctx.ck.config.vocab_size)
        ctx.log(f"Medusa heads from {d}: {head['num_heads']} heads -> {ENGINE_FILE}")
        return "medusa", DraftEntry("medusa", ENGINE_FILE, 0, str(d), head=head)

    def time(self, manifest, context, reps):
        """Seconds of one proposal of every head for one sequence (host numpy)."""
        if "medusa" not in manifest.drafts:
            return {}
        from backend.drafters.medusa import MedusaDrafter

        drafter = MedusaDrafter.from_manifest(manifest)
        h = np.random.default_rng(0).standard_normal((1, manifest.model.hidden_size)).astype(np.float32)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            drafter.heads(h, drafter.k).argmax(-1)
            times.append(time.perf_counter() - t0)
        return {DrafterKind.MEDUSA.value: (statistics.median(times[1:]), None)}

    def make(self, manifest, spec, options, made, want):
        if "medusa" not in manifest.drafts or not want(DrafterKind.MEDUSA):
            return {}
        from backend.drafters.medusa import MedusaDrafter

        return {DrafterKind.MEDUSA: MedusaDrafter.from_manifest(manifest)}
