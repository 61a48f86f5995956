"""The adaptive controller's four models, each on its own, and the drafter traits they read."""
import numpy as np
import pytest

from backend.config import DrafterKind, SamplingParams
from backend.controller import AdaptiveController, CostModel, UnpricedDrafter
from backend.controller.catch_up import RUN_PRIOR, CatchUp
from backend.controller.chains import ChainAcceptance
from backend.controller.cost import SETTLE, CostCorrection
from backend.controller.trees import TreeYields
from backend.drafters.base import DrafterTraits
from backend.drafters.eagle import EagleDrafter
from backend.drafters.hybrid import LookupEagleDrafter
from backend.drafters.prompt_lookup import PromptLookupDrafter
from backend.runtime.toy import ToyTokenizer
from backend.sampling import PositionNoise
from backend.sequence import Request, SequenceState, TextState

EAGLE = DrafterTraits(True, 16, 5, "eagle", catches_up=True, needs_hidden=True)
FLAT = CostModel([1, 64], [0.02, 0.02], 0.0, {"eagle": 0.004, "prompt-lookup": 0.0}, {"eagle": 1e-4})


def seq(i, kind=DrafterKind.PROMPT_LOOKUP, max_tokens=1000):
    s = SequenceState(i, Request((1, 2, 3), SamplingParams(max_tokens=max_tokens), kind), kind,
                      PositionNoise(0, 50), frozenset(), TextState(ToyTokenizer(), ()), 4096)
    s.output_ids.append(5)
    return s


def test_traits_state_each_drafter_once_and_the_hybrid_is_priced_as_its_head():
    lookup = PromptLookupDrafter(2, 4, 2, max_tokens=6)
    head = EagleDrafter(None, np.arange(10), depth=4, topk=3, max_nodes=12)
    hybrid = LookupEagleDrafter(lookup, head)
    assert (lookup.traits.tree, lookup.traits.max_budget, lookup.traits.forwards(6)) == (False, 6, 0)
    assert (head.traits.tree, head.traits.max_budget, head.traits.forwards(12), head.traits.forwards(2)) == (True, 12, 4, 2)
    assert hybrid.traits == head.traits and hybrid.max_lookup == 6
    c = AdaptiveController({DrafterKind.LOOKUP_EAGLE: hybrid.traits}, FLAT)
    assert c._draft_cost({DrafterKind.LOOKUP_EAGLE}, 1, 8) == pytest.approx(0.004 * 4)   # not free


def test_an_unpriced_drafter_is_refused_by_name():
    with pytest.raises(UnpricedDrafter, match="drafter 'lookup\\+eagle' has no cost entry 'eagle'"):
        AdaptiveController({DrafterKind.LOOKUP_EAGLE: EAGLE}, CostModel([1], [0.02], 0.0, {"prompt-lookup": 0.0}))
    with pytest.raises(UnpricedDrafter, match="catch_up_s"):
        AdaptiveController({DrafterKind.EAGLE: EAGLE}, CostModel([1], [0.02], 0.0, {"eagle": 0.001}))


def test_cost_correction_charges_garbage_to_the_speculative_step_and_learns_plain_from_clean_steps():
    cost = CostModel([1, 64], [0.02, 0.02 + 63 * 0.001])

    def run(garbage_s):
        corr, now = CostCorrection(cost), 0
        for _ in range(400):                  # clean plain steps as the model says
            now += 1
            corr.observe(1, 1, 0.0, cost.verify(1, 1), 0.0, now)
        for _ in range(3):                    # a 5-wide step as modelled, then plain steps that
            now += 1                          # each pay garbage_s of its garbage columns
            corr.observe(1, 5, 0.0, cost.verify(1, 5), 0.0, now)
            for _ in range(SETTLE):
                now += 1
                corr.observe(1, 1, 0.0, cost.verify(1, 1) + garbage_s, 0.0, now)
        return corr.verify_ratio(1, 1, now), corr.verify_ratio(1, 5, now), corr.verify_ratio(8, 5, now)

    plain, spec, other_band = run(0.0)
    assert plain == pytest.approx(1.0) and spec == pytest.approx(1.0)
    plain_g, spec_g, _ = run(0.0005)          # 16 ms of garbage per 24 ms speculative step
    assert plain_g == pytest.approx(plain, rel=1e-6)          # plain learns from clean steps only
    assert spec_g > spec + 0.15                               # the speculative step pays it
    assert other_band == pytest.approx(1.0)                   # another batch band: untouched


def test_chain_acceptance_learns_per_depth_and_scores_previews_to_their_full_depth():
    chains = ChainAcceptance(max_k=4)
    s = seq(0)
    assert chains.curve(s).tolist() == pytest.approx([1, 1.5, 1.75, 1.875, 1.9375])   # prior 0.5
    for _ in range(50):
        chains.set_previews([s], [[7, 8, 9, 10]])
        chains.observe(s, 0, 0, [7, 8])       # a plain step emitted 7: the tracker goes on
        chains.set_previews([s], [None])
        chains.observe(s, 0, 0, [9, 99])      # ...and stops at depth 4: 3 accepted of 4
    a = chains.alphas(s)
    assert a[0] > 0.9 and a[2] > 0.9 and a[3] < 0.1
    chains.forget(s)
    assert chains.alphas(s)[0] == pytest.approx(chains.prior(DrafterKind.PROMPT_LOOKUP)[0])


def test_tree_yields_bound_untried_sizes_and_fresh_requests_by_first_trees():
    trees = TreeYields()
    for _ in range(20):
        trees._arm(DrafterKind.EAGLE, 4).update(1.2)
    assert trees.pooled(DrafterKind.EAGLE, 16) == pytest.approx(1.25 * trees._arm(DrafterKind.EAGLE, 4).mean + 0.1)
    s = seq(0, DrafterKind.EAGLE)
    for i in range(5):                        # first trees of five requests yield nothing
        r = seq(10 + i, DrafterKind.EAGLE)
        trees.observe(r, 4, 0, now=i)
        trees.forget(r)
    assert trees.fresh_ratio(DrafterKind.EAGLE, 5) < 0.2
    assert trees.expected(s, 4, 5) < trees.pooled(DrafterKind.EAGLE, 4)


def test_catch_up_pads_rows_to_the_longest_backlog_and_spreads_it_over_measured_runs():
    cu = CatchUp(FLAT, {DrafterKind.EAGLE: EAGLE, DrafterKind.PROMPT_LOOKUP: DrafterTraits(False, 8, 0, "prompt-lookup")})
    a, b, lk = seq(0, DrafterKind.EAGLE), seq(1, DrafterKind.EAGLE), seq(2)
    assert cu.cost_of([a, b, lk], [100, 3, 50]) == pytest.approx(1e-4 * 2 * 100)
    assert cu.cost_of([a], [100], amortised=True) == pytest.approx(1e-4 * 100 / RUN_PRIOR)
    for _ in range(10):                       # runs of 40 drafting steps
        for _ in range(40):
            cu.track(a, True)
        cu.track(a, False)
    assert cu.run_mean(DrafterKind.EAGLE) > 30
    short = seq(3, DrafterKind.EAGLE, max_tokens=3)       # 2 tokens left: spread over 2 at most
    assert cu.cost_of([short], [100], amortised=True) == pytest.approx(1e-4 * 100 / 2)
