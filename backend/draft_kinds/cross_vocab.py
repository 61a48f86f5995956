"""A draft model with a vocabulary of its own (issue 28): the `cross-vocab` manifest entry that
`--draft PATH` writes when the checkpoint's tokenizer is not the target's (draft_kinds/
draft_model.py exports it; buildlib/drafts.py adds the vocabulary map), served as `draft-model` by
drafters/cross_vocab.py (SLEM chains and TLI, chosen per step).

Knows: which entry serves, how its cost is timed (a bare draft forward plus the host work the
drafter adds per forward: re-tokenizing its text into target tokens; the catch-up per token plus
encoding the committed text for the draft), how the drafter is made from the manifest. Does not
know: engine formats, the map's construction (vocab_map.py).
"""
from __future__ import annotations

import statistics
import time

from backend.config import DrafterKind
from backend.draft_kinds.base import DraftKind

COST_KEY = "cross-vocab"
# what the re-tokenization is timed on: plain English with punctuation, digits and a newline
SAMPLE = ("Speculative decoding drafts a few tokens with a small model and verifies them with one "
          "forward of the large one. In 2023, two groups showed it keeps the output distribution exactly;\n"
          "the draft only decides how many positions a forward settles, never what they say. ")


def cross_entry(manifest, name: str | None = None) -> str | None:
    """The manifest's cross-vocabulary draft (`name` if it is one), or None."""
    if name is not None:
        return name if name in manifest.drafts and manifest.drafts[name].kind == "cross-vocab" else None
    return next((n for n, d in manifest.drafts.items() if d.kind == "cross-vocab"), None)


def cross_drafter(manifest, name: str, spec, options=None, runtime=None):
    """The CrossVocabDrafter of draft `name`, priced by the manifest's cost model where it has one."""
    from backend.devices import load_runtime
    from backend.drafters.cross_vocab import CrossVocabDrafter
    from backend.drafters.retokenize import load_encoder
    from backend.vocab_map import VocabMap

    d = manifest.drafts[name]
    cost = manifest.cost_model or {}
    verify_s = cost["seconds"][0] if cost.get("seconds") else 1.0
    forward_s = cost.get("draft_step_s", {}).get(COST_KEY, 0.5 * verify_s)
    return CrossVocabDrafter(runtime or load_runtime(manifest, engine=name, options=options),
                             VocabMap.load(manifest.resolve(d.vocab_path)),
                             load_encoder(manifest.resolve(manifest.tokenizer_path).read_text(encoding="utf-8")),
                             load_encoder(manifest.resolve(d.tokenizer_path).read_text(encoding="utf-8")),
                             spec.draft_width, spec.max_draft_tokens, verify_s, forward_s)


def retokenize_seconds(drafter, reps: int = 5) -> tuple[float, float]:
    """(seconds of one SLEM re-tokenization as the text grows by a draft token, seconds to
    encode one committed target token's text for the draft), on SAMPLE."""
    from backend.drafters.retokenize import encode_bytes, retokenize

    vm = drafter.vm
    text = SAMPLE.encode()
    pieces = [vm.draft_bytes[t] for t in encode_bytes(drafter.denc, text, vm.single_bytes)]
    behind = drafter.tenc.encode(" forward of the", add_special_tokens=False).ids
    calls, encodes = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        grown = b""
        for b in pieces[:24]:
            grown += b
            retokenize(drafter.tenc, vm, behind, b" forward of the", grown)
        calls.append((time.perf_counter() - t0) / 24)
        t0 = time.perf_counter()
        n = len(drafter.tenc.encode(SAMPLE, add_special_tokens=False).ids)
        encode_bytes(drafter.denc, text, vm.single_bytes)
        encodes.append((time.perf_counter() - t0) / n)
    return statistics.median(calls), statistics.median(encodes)


class CrossVocabKind(DraftKind):
    name = "draft model (own vocabulary)"
    entry_kinds = ("cross-vocab",)

    def time(self, manifest, context, reps):
        from backend.buildlib.timing import step_and_catch_up
        from backend.config import SpecConfig
        from backend.devices import load_runtime

        name = cross_entry(manifest)
        if name is None:
            return {}
        rt = load_runtime(manifest, engine=name)
        one, per_token = step_and_catch_up(rt, context, reps, 21_000)
        retok, encode = retokenize_seconds(cross_drafter(manifest, name, SpecConfig(), runtime=rt))
        rt.close()
        return {COST_KEY: (one + retok, per_token + encode)}

    def make(self, manifest, spec, options, made, want):
        if DrafterKind.DRAFT_MODEL in made or not want(DrafterKind.DRAFT_MODEL):
            return {}
        name = cross_entry(manifest, spec.draft_model)
        if name is None:
            return {}
        return {DrafterKind.DRAFT_MODEL: cross_drafter(manifest, name, spec, options)}
