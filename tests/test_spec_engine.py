"""Speculative decoding on the real embedded default (SmolLM2-135M): greedy output is
token-identical to plain greedy decoding for every drafter, several K and tree shapes, mixed
batches, and every weight format; seeded sampling is reproducible. The drafters' matrix runs on
the CPU default, the native engine (gguf: its step a tenth of ONNX Runtime's fp32 one; perf-notes §47); the two
ONNX Runtime formats verify a chain and a tree each (their verify paths; the drafters above them
are the same code)."""
import pytest

from backend.builder.pipeline import ENGINE_SUBDIR
from backend.config import DrafterKind, SamplingParams, ServeConfig, SpecConfig
from backend.controller import AdaptiveController, CostModel
from backend.engine import make_decoder
from backend.sequence import Request
from conftest import run_batch, load_prompts, prompt_ids

pytestmark = pytest.mark.slow
MAX_NEW = 48


@pytest.fixture(scope="module")
def prompts(tokenizer):
    items = load_prompts()
    picked = [next(p for p in items if p["kind"] == k) for k in ("edit", "summarize", "chat")]
    return [prompt_ids(tokenizer, p["messages"]) for p in picked]


def decoder(built_repo, fmt="gguf", **spec):
    return make_decoder(ServeConfig(engine_dir=str(built_repo / ENGINE_SUBDIR), weight_format=fmt,
                                    spec=SpecConfig(**spec)))


def generate(dec, ids, kind, params=SamplingParams(max_tokens=MAX_NEW)):
    toks, stats = [], None
    for out in dec.generate(Request(tuple(ids), params, kind)):
        toks.extend(out.new_ids)
        stats = out.stats
    return toks, stats


@pytest.fixture(scope="module")
def plain(built_repo, prompts):
    dec = decoder(built_repo)
    return [generate(dec, ids, DrafterKind.NONE)[0] for ids in prompts]


CONFIGS = [
    ("prompt-lookup", dict(num_draft_tokens=3)),
    ("prompt-lookup", dict(num_draft_tokens=6, prompt_lookup_width=2)),
    ("prompt-lookup", dict()),                                   # adaptive K
    ("draft-model", dict(num_draft_tokens=2)),
    ("draft-model", dict(num_draft_tokens=4, draft_width=2)),
    ("eagle", dict(num_draft_tokens=12)), ("eagle", dict()), ("lookup+eagle", dict()),   # the committed head
]


@pytest.mark.parametrize("kind,spec", CONFIGS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CONFIGS)])
def test_greedy_spec_identical_to_plain(built_repo, prompts, plain, kind, spec):
    dec = decoder(built_repo, **spec)
    if isinstance(dec.controller, AdaptiveController):
        # whether a cold controller speculates depends on the costs the build measured on this
        # machine (CI once measured costs under which prompt lookup never drafted, and this test
        # passed nothing through the verifier); a flat cost model makes speculation pay on any
        # machine, so adaptive K is exercised, varying with acceptance, everywhere
        keys = {d.traits.cost_key: 0.0 for d in dec.drafters.values()}
        dec.controller = AdaptiveController({k: d.traits for k, d in dec.drafters.items()},
                                            CostModel([1, 64], [0.02, 0.02], 0.0, keys, keys))
    drafted = 0
    for ids, ref in zip(prompts, plain):
        toks, stats = generate(dec, ids, DrafterKind(kind))
        assert toks == ref
        drafted += stats.num_draft_tokens
    assert drafted > 0


def test_mixed_batch_identical_to_plain(built_repo, prompts, plain):
    dec = decoder(built_repo, num_draft_tokens=4, draft_width=2)
    kinds = [DrafterKind.PROMPT_LOOKUP, DrafterKind.DRAFT_MODEL, DrafterKind.NONE]
    seqs = [dec.start(Request(tuple(ids), SamplingParams(max_tokens=MAX_NEW), k)) for ids, k in zip(prompts, kinds)]
    got = run_batch(dec, seqs)
    assert got == plain


def test_eagle_batch_identical_to_plain(built_repo, prompts, plain):
    """Feature drafters in a batch: each row's hidden states reach its own drafter."""
    dec = decoder(built_repo, num_draft_tokens=8)
    kinds = [DrafterKind.EAGLE, DrafterKind.LOOKUP_EAGLE, DrafterKind.EAGLE]
    seqs = [dec.start(Request(tuple(ids), SamplingParams(max_tokens=MAX_NEW), k)) for ids, k in zip(prompts, kinds)]
    got = run_batch(dec, seqs)
    assert got == plain
    assert all(s.stats.num_draft_tokens > 0 for s in seqs)


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_onnx_formats_greedy_spec_identical_to_their_plain(built_repo, prompts, manifest, fmt):
    """ONNX Runtime's engines: a chain (prompt lookup) and a tree (the EAGLE head) verified, on the
    edit prompt (where lookup drafts most); the drafters' matrix above is the native engine's."""
    assert manifest.engine(fmt).batch_invariant, f"the build measured {fmt} as not batch invariant"
    dec = decoder(built_repo, fmt, num_draft_tokens=4, prompt_lookup_width=2)
    ref = generate(dec, prompts[0], DrafterKind.NONE)[0]
    for kind in (DrafterKind.PROMPT_LOOKUP, DrafterKind.EAGLE):
        toks, stats = generate(dec, prompts[0], kind)
        assert toks == ref and stats.num_draft_tokens > 0, (fmt, kind)


def test_seeded_sampling_reproducible(built_repo, prompts):
    dec = decoder(built_repo, num_draft_tokens=3)
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=1234)
    a = generate(dec, prompts[2], DrafterKind.DRAFT_MODEL, p)[0]
    b = generate(dec, prompts[2], DrafterKind.DRAFT_MODEL, p)[0]
    assert a == b and len(a) > 0


def test_seeded_sampling_is_the_same_text_with_any_drafter_budget_and_batch(built_repo, prompts):
    """Noise keyed to the output position: a seeded sampled request gives plain sampling's text
    token for token, whatever drafts (lookup, draft model, EAGLE trees), however many draft
    tokens each step gets, and whoever shares its batch."""
    p = SamplingParams(temperature=0.7, top_k=50, top_p=0.95, max_tokens=MAX_NEW, seed=2024)
    ids = prompts[0]                                  # an edit prompt: lookup drafts a lot
    ref = generate(decoder(built_repo), ids, DrafterKind.NONE, p)[0]
    kinds = [DrafterKind.PROMPT_LOOKUP, DrafterKind.DRAFT_MODEL, DrafterKind.EAGLE]
    drafted = 0
    for k in (2, 6):
        dec = decoder(built_repo, num_draft_tokens=k)
        for kind in kinds:
            toks, stats = generate(dec, ids, kind, p)
            assert toks == ref, (kind, k)
            drafted += stats.num_draft_tokens
    assert drafted > 0
    budgets = iter([5, 0, 1, 7, 3, 0, 8] * 40)        # a budget that changes every step
    dec = decoder(built_repo)
    dec.controller.budgets = lambda seqs, previews=None, backlogs=None: [next(budgets) for _ in seqs]
    others = [Request(tuple(q), SamplingParams(temperature=1.0, max_tokens=MAX_NEW), DrafterKind.PROMPT_LOOKUP)
              for q in prompts[1:]]
    seqs = [dec.start(Request(tuple(ids), p, DrafterKind.PROMPT_LOOKUP))] + [dec.start(r) for r in others]
    assert run_batch(dec, seqs)[0] == ref


def test_eagle_acceptance_survives_speculation_off_and_on(built_repo, prompts, plain):
    """Known failure elsewhere: acceptance silently collapsing after re-enabling speculation."""
    dec = decoder(built_repo, num_draft_tokens=12)
    always = generate(dec, prompts[0], DrafterKind.EAGLE)
    budgets = iter([12, 0, 0, 12, 0, 12, 12, 0] * 20)
    dec.controller.budgets = lambda seqs, previews=None, backlogs=None: [min(next(budgets), s.draft_room()) for s in seqs]
    toggled = generate(dec, prompts[0], DrafterKind.EAGLE)
    assert toggled[0] == plain[0]

    def depth1(stats):   # a tree drafts many nodes per step: the first depth is the clean signal
        return stats.accepted_per_pos[0] / max(stats.drafted_per_pos[0], 1)

    assert toggled[1].drafted_per_pos[0] >= 8 and always[1].drafted_per_pos[0] >= 8
    assert depth1(always[1]) > 0.3           # measured 0.57 on this prompt with the committed head
    assert depth1(toggled[1]) >= 0.6 * depth1(always[1])   # stale features after a pause would give ~0
