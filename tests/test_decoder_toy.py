"""SpecDecoder on the numpy toy runtime: greedy identity for every drafter, stop conditions,
mixed batches, seeded reproducibility, drafter state across speculation on/off."""
import numpy as np
import pytest

from conftest import run_batch

from backend.config import DrafterKind, RequestError, SamplingParams, SpecConfig
from backend.decoder import SpecDecoder
from backend.drafters.draft_model import DraftModelDrafter
from backend.drafters.prompt_lookup import PromptLookupDrafter
from backend.runtime.toy import ToyRuntime, ToyTokenizer
from backend.sequence import Request

PROMPT = (1, 2, 3, 1, 2, 4, 1, 2)


def make(k=4, width=1, eos=()):
    tgt, dr = ToyRuntime(vocab=8, seed=1), ToyRuntime(vocab=8, seed=2)
    drafters = {DrafterKind.PROMPT_LOOKUP: PromptLookupDrafter(1, 3, width),
                DrafterKind.DRAFT_MODEL: DraftModelDrafter(dr, width)}
    return SpecDecoder(tgt, ToyTokenizer(eos), drafters, SpecConfig(num_draft_tokens=k))


def run(dec, kind, params, prompt=PROMPT):
    outs = list(dec.generate(Request(prompt, params, kind)))
    return [t for o in outs for t in o.new_ids], outs


@pytest.mark.parametrize("kind", [DrafterKind.PROMPT_LOOKUP, DrafterKind.DRAFT_MODEL])
@pytest.mark.parametrize("k,width", [(1, 1), (3, 1), (5, 2), (8, 3)])
def test_greedy_identical_to_plain(kind, k, width):
    params = SamplingParams(max_tokens=60)
    plain, _ = run(make(k, width), DrafterKind.NONE, params)
    spec, outs = run(make(k, width), kind, params)
    assert spec == plain
    assert outs[-1].stats.num_steps < 60   # it did speculate


def test_mixed_batch_matches_individual_runs():
    params = SamplingParams(max_tokens=40)
    prompts = [PROMPT, (3, 3, 2, 1), (5, 6, 7, 5, 6)]
    kinds = [DrafterKind.PROMPT_LOOKUP, DrafterKind.DRAFT_MODEL, DrafterKind.NONE]
    expected = [run(make(), DrafterKind.NONE, params, p)[0] for p in prompts]
    dec = make(k=3, width=2)
    seqs = [dec.start(Request(p, params, kd)) for p, kd in zip(prompts, kinds)]
    got = run_batch(dec, seqs)
    assert got == expected


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    p1 = SamplingParams(temperature=0.9, top_k=5, max_tokens=30, seed=11)
    a, _ = run(make(3, 2), DrafterKind.DRAFT_MODEL, p1)
    b, _ = run(make(3, 2), DrafterKind.DRAFT_MODEL, p1)
    c, _ = run(make(3, 2), DrafterKind.DRAFT_MODEL, SamplingParams(temperature=0.9, top_k=5, max_tokens=30, seed=12))
    assert a == b and a != c


def test_stop_conditions():
    dec = make()
    plain, _ = run(dec, DrafterKind.NONE, SamplingParams(max_tokens=30))
    # max_tokens
    toks, outs = run(make(), DrafterKind.PROMPT_LOOKUP, SamplingParams(max_tokens=7))
    assert toks == plain[:7] and outs[-1].finish_reason == "length"
    # stop token: generation ends before it
    stop = plain[5]
    first = plain.index(stop)
    toks, outs = run(make(), DrafterKind.DRAFT_MODEL, SamplingParams(max_tokens=30, stop_token_ids=(stop,)))
    assert toks == plain[:first] and outs[-1].finish_reason == "stop"
    # stop string: text cut before it, never streamed
    text = ToyTokenizer().decode(plain)
    s = text[10:12]
    toks, outs = run(make(), DrafterKind.PROMPT_LOOKUP, SamplingParams(max_tokens=30, stop_strings=(s,)))
    streamed = "".join(o.text for o in outs)
    assert streamed == text[: text.find(s)] and outs[-1].finish_reason == "stop"
    assert s not in streamed


def test_draft_model_state_survives_speculation_off_and_on():
    """Budgets 4, 0, 0, 4, ...: the draft's KV must stay in sync (acceptance must not collapse)."""
    dec = make(k=4)
    budgets = iter([4, 0, 0, 4, 0, 4, 4, 0] * 10)
    dec.controller.budgets = lambda seqs, previews=None, backlogs=None: [min(next(budgets), s.draft_room()) for s in seqs]
    toks, outs = run(dec, DrafterKind.DRAFT_MODEL, SamplingParams(max_tokens=60))
    plain, _ = run(make(), DrafterKind.NONE, SamplingParams(max_tokens=60))
    assert toks == plain
    ref_rate = run(make(k=4), DrafterKind.DRAFT_MODEL, SamplingParams(max_tokens=60))[1][-1].stats.acceptance_rate
    assert outs[-1].stats.acceptance_rate >= 0.8 * ref_rate


def test_bad_requests_are_refused_with_field_names():
    dec = make()
    with pytest.raises(RequestError, match="text_input"):
        dec.start(Request((), SamplingParams()))
    with pytest.raises(RequestError, match="temperature"):
        dec.start(Request(PROMPT, SamplingParams(temperature=-1)))
    with pytest.raises(RequestError, match="top_p"):
        dec.start(Request(PROMPT, SamplingParams(temperature=1, top_p=0)))
    with pytest.raises(RequestError, match="drafter"):
        dec.start(Request(PROMPT, SamplingParams(), DrafterKind.EAGLE))
    with pytest.raises(RequestError, match="num_draft_tokens"):
        dec.start(Request(PROMPT, SamplingParams(), DrafterKind.PROMPT_LOOKUP, num_draft_tokens=99))
    long = tuple(range(8)) * 600
    with pytest.raises(RequestError, match="maximum sequence length"):
        dec.start(Request(long, SamplingParams()))


@pytest.mark.parametrize("kind", [DrafterKind.PROMPT_LOOKUP, DrafterKind.DRAFT_MODEL])
def test_seeded_sampling_is_plain_sampling_whatever_the_drafter_and_budget(kind):
    """The noise is keyed to the output position, so a seeded sampled request emits plain
    sampling's tokens one for one: with any drafter, any budget (one that changes every step
    too) and any batch. The draft model draws with the same noise, so it is often accepted."""
    params = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02, max_tokens=80, seed=77)
    plain, _ = run(make(), DrafterKind.NONE, params)
    for k, width in ((1, 1), (4, 1), (6, 3)):
        toks, outs = run(make(k, width), kind, params)
        assert toks == plain, (k, width)
        assert outs[-1].stats.num_accepted_tokens > 0
    dec = make()
    budgets = iter([3, 0, 7, 1, 0, 5] * 50)
    dec.controller.budgets = lambda seqs, previews=None, backlogs=None: [next(budgets) for _ in seqs]
    others = [Request(p, SamplingParams(temperature=1.0, max_tokens=50), kind) for p in ((3, 3, 2, 1), (5, 6, 7))]
    seqs = [dec.start(Request(PROMPT, params, kind))] + [dec.start(r) for r in others]
    assert run_batch(dec, seqs)[0] == plain


def test_decoder_clamps_every_budget_to_the_drafters_largest():
    dec = make()
    dec.controller.budgets = lambda seqs, previews=None, backlogs=None: [99 for _ in seqs]
    _, outs = run(dec, DrafterKind.DRAFT_MODEL, SamplingParams(max_tokens=40))
    assert 0 < max(o.step_depth for o in outs) <= dec.drafters[DrafterKind.DRAFT_MODEL].traits.max_budget
