"""EAGLE-1/2/3 feature heads (`--draft eagle:DIR`: ours or a published layout), served as the
`eagle` drafter (an EAGLE-2 tree) and behind prompt lookup as `lookup+eagle`.

Knows: the head spec, the target features an EAGLE-3 head reads, the head's manifest entry, how
a drafting step is timed (as the drafter runs it). Does not know: head layouts
(buildlib/heads/formats.py), engine formats (the backend writes the head's engine).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from backend.config import DrafterKind, SpecConfig
from backend.draft_kinds.base import DraftKind


def eagle_drafter(manifest, spec: SpecConfig, options=None):
    """The EAGLE head built into `manifest`, on the runtime its engine loads on."""
    from backend.devices import load_runtime
    from backend.drafters.eagle import EagleDrafter

    return EagleDrafter.from_manifest(manifest, spec, load_runtime(manifest, engine="eagle", options=options))


class EagleKind(DraftKind):
    name = "EAGLE head"
    spec_form = "eagle:DIR"
    prefix = "eagle:"
    entry_kinds = ("eagle",)

    def target_features(self, spec, cfg):
        from backend.buildlib import drafts as drafts_mod
        from backend.buildlib.heads.formats import feature_layers, head_meta

        return feature_layers(head_meta(drafts_mod.head_dir(spec)), cfg.num_layers)

    def export(self, ctx, spec, backend, serving):
        from backend.buildlib import drafts as drafts_mod

        return backend.export_head(ctx, drafts_mod.head_dir(spec), serving)

    def time(self, manifest, context, reps, steps: int = 6):
        """The head's propose() at the largest tree, once right after a `context`-token prompt
        (the catch-up over all of it) and then `steps` times one token later; medians over `reps`
        sequences -> (seconds per tree depth, seconds per catch-up token)."""
        if "eagle" not in manifest.drafts:
            return {}
        from backend.buildlib.timing import TimingSeq

        spec = SpecConfig()
        drafter = eagle_drafter(manifest, spec)
        rng = np.random.default_rng(0)
        v = manifest.model.vocab_size
        h = manifest.model.hidden_size * (1 + len(manifest.engine().feature_layers))   # the target's features
        budget = spec.max_tree_nodes
        first, steady = [], []
        for r in range(reps + 1):                   # the first sequence warms up: not counted
            seq = TimingSeq(40_000 + r, rng.integers(3, v, context).tolist())
            drafter.begin(seq, rng.standard_normal((context, h)).astype(np.float32))
            for i in range(steps + 1):
                t0 = time.perf_counter()
                draft, = drafter.propose([seq], [budget])
                dt = time.perf_counter() - t0
                if r:
                    (steady if i else first).append(dt)
                drafter.observe(seq, draft, np.array([0]), rng.standard_normal((1, h)).astype(np.float32))
                seq.output_ids.append(int(draft.tokens[-1]))
            drafter.end(seq)
        drafter.rt.close()
        step = statistics.median(steady)
        per_depth = step / min(spec.eagle_depth, budget)
        return {DrafterKind.EAGLE.value: (per_depth, max(0.0, (statistics.median(first) - step) / (context - 1)))}

    def make(self, manifest, spec, options, made, want):
        eagle = made.get(DrafterKind.EAGLE)
        if eagle is None and "eagle" in manifest.drafts and want(DrafterKind.EAGLE):
            eagle = eagle_drafter(manifest, spec, options)
        if eagle is None:
            return {}
        from backend.drafters.hybrid import LookupEagleDrafter

        return {DrafterKind.EAGLE: eagle,
                DrafterKind.LOOKUP_EAGLE: LookupEagleDrafter(made[DrafterKind.PROMPT_LOOKUP], eagle)}
