"""The adaptive speculation controller on synthetic cost models and acceptance rates."""
import numpy as np

from backend.config import DrafterKind, SamplingParams
from backend.controller import AdaptiveController, CostModel as _CostModel
from backend.drafters.base import DrafterTraits
from backend.runtime.toy import ToyTokenizer
from backend.sampling import PositionNoise
from backend.sequence import Request, SequenceState, TextState

GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256]
TRAITS = {DrafterKind.PROMPT_LOOKUP: DrafterTraits(False, 8, 0, "prompt-lookup"),
          DrafterKind.EAGLE: DrafterTraits(True, 16, 5, "eagle", catches_up=True, needs_hidden=True)}


def CostModel(tokens, seconds, per_seq_s=0.0, catch_up_s=None):
    """A synthetic cost model pricing the drafters of TRAITS (their draft forwards free)."""
    return _CostModel(tokens, seconds, per_seq_s, {"prompt-lookup": 0.0, "eagle": 0.0},
                      catch_up_s or {"eagle": 0.0})


def seq(i: int, kind=DrafterKind.PROMPT_LOOKUP) -> SequenceState:
    s = SequenceState(i, Request((1, 2, 3), SamplingParams(max_tokens=1000), kind), kind,
                      PositionNoise(0, 50), frozenset(), TextState(ToyTokenizer(), ()), 4096)
    s.output_ids.append(5)
    return s


def controller(cost: CostModel, alpha: float, n: int, kind=DrafterKind.PROMPT_LOOKUP):
    c = AdaptiveController(TRAITS, cost)
    seqs = [seq(i, kind) for i in range(n)]

    class D:                      # a chain draft of depth 8, accepted with rate alpha per depth
        class tree:
            max_depth = 8
        num_draft_tokens = 8

    class V:
        num_accepted = 0
        output_ids = ()
    rng = np.random.default_rng(1)
    for _ in range(200):
        for s in seqs:
            k = 0
            while k < 8 and rng.random() < alpha:
                k += 1
            V.num_accepted = k
            c.observe(s, D, V)
    return c, seqs


MEMORY_BOUND = CostModel(GRID, [0.030 + 0.0005 * m for m in GRID])       # flat until compute
COMPUTE_BOUND = CostModel(GRID, [0.030 * m for m in GRID])                # every token costs


def test_large_k_when_acceptance_high_and_batch_small():
    c, seqs = controller(MEMORY_BOUND, alpha=0.85, n=1)
    assert c.budgets(seqs)[0] >= 6


def test_zero_when_verification_is_compute_bound():
    c, seqs = controller(COMPUTE_BOUND, alpha=0.6, n=1)
    assert c.budgets(seqs)[0] == 0


def test_zero_when_acceptance_is_low():
    cost = CostModel(GRID, [0.030 + 0.003 * m for m in GRID])          # each token +10%
    c, seqs = controller(cost, alpha=0.05, n=1)
    assert c.budgets(seqs)[0] == 0


def test_k_shrinks_smoothly_with_load():
    """A realistic cost curve: K falls as the batch grows, one step at a time (no cliff)."""
    cost = CostModel(GRID, [0.030 + 0.0025 * m for m in GRID], per_seq_s=0.001)
    ks = []
    for n in range(1, 33):
        c, seqs = controller(cost, alpha=0.7, n=n)
        ks.append(c.budgets(seqs)[0])
    assert ks[0] >= 4 and ks[-1] <= 1, ks
    assert all(b <= a for a, b in zip(ks, ks[1:])), ks            # monotone in load
    assert all(a - b <= 2 for a, b in zip(ks, ks[1:])), ks         # no cliff


def test_request_override_and_plain_rows():
    c, seqs = controller(MEMORY_BOUND, alpha=0.85, n=2)
    seqs[0] = SequenceState(9, Request((1,), SamplingParams(), DrafterKind.PROMPT_LOOKUP, num_draft_tokens=2),
                            DrafterKind.PROMPT_LOOKUP, PositionNoise(0, 50), frozenset(),
                            TextState(ToyTokenizer(), ()), 4096)
    seqs[0].output_ids.append(3)
    plain = seq(7, DrafterKind.NONE)
    b = c.budgets(seqs + [plain])
    assert b[0] == 2 and b[1] >= 4 and b[2] == 0


def test_tree_drafter_picks_a_size_by_measured_yield():
    c = AdaptiveController(TRAITS, MEMORY_BOUND)
    s = seq(0, DrafterKind.EAGLE)
    for size, emitted in ((4, 1.2), (8, 1.3), (12, 1.3), (16, 1.3)):   # trees barely help
        for _ in range(100):
            c.trees._arm(DrafterKind.EAGLE, size).update(emitted)
    assert c.budgets([s])[0] == 0 or c.expected_tokens(s, 4) < 1.3
    for size, emitted in ((4, 2.0), (8, 3.0), (12, 3.6), (16, 3.8)):
        for _ in range(300):
            c.trees._arm(DrafterKind.EAGLE, size).update(emitted)
    assert c.budgets([s])[0] in (12, 16)


def test_untried_larger_trees_are_not_probed_after_a_poor_small_tree():
    """Optimism for untried sizes is bounded by what the next smaller size measured."""
    cost = CostModel(GRID, [0.030 + 0.004 * m for m in GRID])   # a 17-node verify costs ~3 steps
    c = AdaptiveController(TRAITS, cost)
    s = seq(0, DrafterKind.EAGLE)
    assert c.budgets([s])[0] > 0                 # untried: optimistic, so it explores
    for _ in range(100):
        c.trees._arm(DrafterKind.EAGLE, 4).update(1.1)       # the smallest tree barely helps
    small = c.trees._arm(DrafterKind.EAGLE, 4).mean
    assert c.trees._arm(DrafterKind.EAGLE, 16).mean > 3.0    # the unbounded prior would still probe 16
    assert c.expected_tokens(s, 16) <= 1.25 * small + 0.1
    assert c.budgets([s])[0] == 0


def test_measured_verify_times_correct_the_build_time_cost_model():
    """The build measured one context; if wide verifies turn out dearer (or cheaper) on the live
    server, the controller learns it from the decoder's step timings, per width band."""
    c, seqs = controller(MEMORY_BOUND, alpha=0.6, n=1)
    assert c.budgets(seqs)[0] >= 3                 # the model says: wide verify is nearly free
    for _ in range(50):                                  # measured: every wide verify costs 3 steps
        for width in (3, 7):                             # (one per band the chain can use)
            c.observe_step(1, width, 0.0, 3 * MEMORY_BOUND.verify(1, 1))
        c.observe_step(1, 1, 0.0, MEMORY_BOUND.verify(1, 1))
    assert c.budgets(seqs)[0] == 0
    corr = c.corrections()                               # what the metrics gauges show
    assert corr["verify_t2-5_b1"] > 2.0 and corr["verify_t6-9_b1"] > 2.0 and abs(corr["verify_t1_b1"] - 1) < 0.01
    assert len(corr) == 6 * 6 + 1 and "draft_b32+" in corr and "verify_t14+_b16-31" in corr
    assert corr["fresh_yield_eagle"] == 1.0                 # no first tree measured yet
    for _ in range(1500):                                # plain steps only: the stale speculative
        c.observe_step(1, 1, 0.0, MEMORY_BOUND.verify(1, 1))   # correction fades back to the model
    assert c.budgets(seqs)[0] >= 3

    c, seqs = controller(COMPUTE_BOUND, alpha=0.6, n=1)
    assert c.budgets(seqs)[0] == 0
    for _ in range(50):                                  # measured: wide verifies cost ~ one step
        c.observe_step(1, 1, 0.0, COMPUTE_BOUND.verify(1, 1))
        c.observe_step(1, 4, 0.0, 1.1 * COMPUTE_BOUND.verify(1, 1))
    assert c.budgets(seqs)[0] > 0


def test_tree_yield_is_per_request_with_the_pool_as_prior():
    """One head, two kinds of request: an edit request that the head predicts well must not make
    a chat request speculate once the chat request has shown its own low yield."""
    cost = CostModel(GRID, [0.030 + 0.004 * m for m in GRID])
    c = AdaptiveController(TRAITS, cost)
    edit, chat, fresh = seq(0, DrafterKind.EAGLE), seq(1, DrafterKind.EAGLE), seq(2, DrafterKind.EAGLE)

    class D:
        class tree:
            max_depth = 3
        num_draft_tokens = 4

    class V:
        num_accepted = 0
    for _ in range(40):
        V.num_accepted = 3
        c.observe(edit, D, V)          # the edit request: 4 tokens per step
        V.num_accepted = 0
        c.observe(chat, D, V)          # the chat request: 1 token per step
    assert c.budgets([edit])[0] > 0
    assert c.budgets([chat])[0] == 0
    pooled = 1 + c.trees.fresh_ratio(DrafterKind.EAGLE, c._now) * (c.trees.pooled(DrafterKind.EAGLE, 4) - 1)
    assert c.expected_tokens(fresh, 4) == pooled                  # the pool, as first trees bore it out
    c.forget(chat)
    assert c.expected_tokens(chat, 4) == pooled


class _Tree4:                     # an EAGLE tree of 4 nodes, depth 3
    class tree:
        max_depth = 3
    num_draft_tokens = 4


def test_fresh_requests_trust_the_pool_only_as_far_as_first_trees_bore_it_out():
    """The pool learns mostly from requests that kept drafting because they drafted well; when
    first trees keep falling short of it, a request that has not drafted yet does not draft on
    its word (a request with its own good record still does), and the evidence fades with time,
    so fresh requests are tried again later."""
    cost = CostModel(GRID, [0.030 + 0.008 * m for m in GRID])    # a 5-wide verify: 1.8 steps
    c = AdaptiveController(TRAITS, cost)

    class V:
        num_accepted = 3
    edit = seq(0, DrafterKind.EAGLE)
    for _ in range(40):
        c.observe(edit, _Tree4, V)                 # 4 tokens per tree
    assert c.budgets([seq(99, DrafterKind.EAGLE)])[0] > 0
    V.num_accepted = 0
    for i in range(10):                                         # ten chat requests: first tree, 1 token
        chat = seq(1 + i, DrafterKind.EAGLE)
        c.observe(chat, _Tree4, V)
        c.forget(chat)
    assert c.trees.fresh_ratio(DrafterKind.EAGLE, c._now) < 0.35
    assert c.budgets([seq(99, DrafterKind.EAGLE)])[0] == 0
    assert c.budgets([edit])[0] > 0
    for _ in range(6000):                                       # plain steps: the evidence fades
        c.observe_step(1, 1, 0.0, cost.verify(1, 1))
    assert c.trees.fresh_ratio(DrafterKind.EAGLE, c._now) > 0.6
    assert c.budgets([seq(99, DrafterKind.EAGLE)])[0] > 0


def test_catch_up_is_priced_and_spread_over_the_measured_drafting_runs():
    """A drafter with a model must first feed it what it has not seen (the whole prompt, the
    first time). That one-off cost is spread over the drafting run it buys: with short runs a
    long backlog keeps a request plain, with long runs the same backlog is worth paying."""
    cost = CostModel(GRID, [0.030 + 0.003 * m for m in GRID], catch_up_s={"eagle": 0.0005})
    c = AdaptiveController(TRAITS, cost)
    for size, tokens in ((4, 2.0), (8, 2.6), (12, 3.0), (16, 3.2)):
        for _ in range(100):
            c.trees._arm(DrafterKind.EAGLE, size).update(tokens)
    s = seq(0, DrafterKind.EAGLE)
    assert c.budgets([s], None, [2])[0] > 0           # caught up: drafting pays
    assert c.budgets([s], None, [250])[0] == 0        # 125 ms over a run of ~4 steps: not
    assert c.budgets([s])[0] > 0                      # (nothing to catch up on: drafts)

    class V:
        num_accepted = 1                                    # 2 tokens: as the pool says
    for i in range(8):                                      # requests that draft 60 steps in a row
        r = seq(10 + i, DrafterKind.EAGLE)
        for _ in range(60):
            c.observe(r, _Tree4, V)
        c.observe(r, _Plain, V)
        c.forget(r)
    assert c.catch_up.run_mean(DrafterKind.EAGLE) > 30
    assert c.budgets([s], None, [250])[0] > 0         # the same catch-up, spread over ~50 steps
    assert cost.catch_up("eagle", 2, 100) == 0.0005 * 200        # rows padded to the longest
    assert c.catch_up.cost_of([s, seq(1, DrafterKind.EAGLE)], [100, 3]) == cost.catch_up("eagle", 2, 100)


def test_speculative_cost_at_a_new_batch_size_leans_on_that_batch_sizes_plain_cost():
    """Wide verifies measured cheap at one stream say nothing about eight streams: if plain
    steps at B=8 run 2.5x the build model, an unobserved wide verify at B=8 is priced alike."""
    c, _ = controller(MEMORY_BOUND, alpha=0.6, n=1)
    for _ in range(200):
        c.observe_step(1, 5, 0.0, MEMORY_BOUND.verify(1, 5))          # n=1: the model holds
        c.observe_step(8, 1, 0.0, 2.5 * MEMORY_BOUND.verify(8, 1))    # n=8: plain is 2.5x dearer
    assert abs(c.verify_cost(1, 5) / MEMORY_BOUND.verify(1, 5) - 1) < 0.05
    assert c.verify_cost(8, 5) / MEMORY_BOUND.verify(8, 5) > 2.0
    assert c.verify_cost(8, 1) / MEMORY_BOUND.verify(8, 1) > 2.0


class _Plain:                     # a step without a draft
    class tree:
        max_depth = 0
    num_draft_tokens = 0


def test_free_drafter_rows_without_a_match_expect_one_token_and_do_not_widen_the_verify():
    """Prompt lookup shows its proposal before the choice: no match anywhere means plain
    decoding, a 2-token match caps k at 2, and at a batch where only one row of 16 has a match
    the gain of that row alone must pay for the wider verify of all 16."""
    c, seqs = controller(MEMORY_BOUND, alpha=0.9, n=16)
    assert c.budgets(seqs, [[7] * 8] * 16)[0] >= 4
    assert c.budgets(seqs, [[]] * 16) == [0] * 16
    assert max(c.budgets(seqs, [[7, 8]] * 16)) == 2
    cost = CostModel(GRID, [0.030 + 0.003 * m for m in GRID])     # 16 x 9 nodes: ~2.5 steps
    c, seqs = controller(cost, alpha=0.9, n=16)
    assert c.budgets(seqs, [[7] * 8] * 16)[0] > 0
    assert c.budgets(seqs, [[7] * 8] + [[]] * 15)[0] == 0


def test_shadow_drafts_let_a_locked_out_request_learn_its_text_turned_repetitive():
    """After a bad spell the request's acceptance is low and it decodes plainly; the free
    drafter's proposals are scored against what the plain steps emit, so once the text starts
    repeating the estimate recovers and speculation resumes (with no draft it never would)."""
    cost = CostModel(GRID, [0.030 + 0.003 * m for m in GRID])     # a 2-wide verify: 1.1 steps
    c, seqs = controller(cost, alpha=0.02, n=1)
    s = seqs[0]
    chain = [11, 12, 13, 14, 15, 16, 17, 18]
    assert c.budgets([s], [chain]) == [0]
    locked = c.chains.alphas(s)[0]

    class V:
        num_accepted = 0
        output_ids = None
    def preview(j):               # the text cycles through `chain`: what lookup proposes at j
        return [chain[(j + i) % len(chain)] for i in range(len(chain))]
    steps = 0
    while c.budgets([s], [preview(steps)]) == [0] and steps < 200:
        V.output_ids = [chain[steps % len(chain)]]                 # every preview comes true
        c.observe(s, _Plain, V)
        steps += 1
    assert steps < 40, steps
    assert c.budgets([s], [preview(steps)])[0] > 0
    assert c.chains.alphas(s)[0] > locked

    c, seqs = controller(cost, alpha=0.02, n=1)              # a shadow that misses at once
    s = seqs[0]
    before = c.chains.alphas(s)[0]
    for _ in range(5):
        c.budgets([s], [chain])
        V.output_ids = [99]
        c.observe(s, _Plain, V)
    assert c.chains.alphas(s)[0] <= before and c.budgets([s], [chain]) == [0]


def test_previews_are_scored_to_their_full_depth_whatever_was_drafted():
    """3 drafted and all accepted: the bonus token is the target's own next token, so it tells
    whether depth 4 would have been accepted too, and the next steps' tokens tell about the
    rest of the preview; depths beyond the drafted k are learned without ever drafting them."""
    c = AdaptiveController(TRAITS, MEMORY_BOUND)
    s = seq(0)
    chain = [11, 12, 13, 14, 15, 16, 17, 18]

    class D:
        class tree:
            max_depth = 3
        num_draft_tokens = 3

    class V:
        num_accepted = 3
        output_ids = [11, 12, 13, 14]             # three accepted, the bonus matches depth 4
    deep = c.chains.alphas(s)[3]
    for _ in range(5):
        c.budgets([s], [chain])
        c.observe(s, D, V)
    assert c.chains.alphas(s)[3] > deep
    V.output_ids = [11, 12, 13, 99]               # the bonus differs: depth 4 is a rejection
    for _ in range(20):
        c.budgets([s], [chain])
        c.observe(s, D, V)
    assert c.chains.alphas(s)[3] < deep


def test_a_ragged_engine_prices_each_rows_own_nodes():
    """On an engine that computes only each row's real nodes (the native CPU engine), one row
    of 16 with a match pays for its own nodes only, not for 16 rows padded to its width: it
    drafts where a padded engine stays plain; with no match anywhere both stay plain."""
    seconds = [0.030 + 0.003 * m for m in GRID]
    padded, ragged = CostModel(GRID, seconds), CostModel(GRID, seconds)
    ragged.ragged = True
    previews = [[7] * 8] + [[]] * 15
    for cost, drafts in ((padded, False), (ragged, True)):
        c, seqs = controller(cost, alpha=0.9, n=16)
        assert (c.budgets(seqs, previews)[0] > 0) is drafts
        assert c.budgets(seqs, [[]] * 16) == [0] * 16
    assert ragged.verify(16, 9, nodes=24) < padded.verify(16, 9)
    assert ragged.verify(16, 9) == padded.verify(16, 9)          # without a node count: padded


def test_a_plain_choice_is_held_only_while_nothing_it_was_made_from_moves():
    """An idle tree drafter's rows learn nothing from a plain step, so the choice of plain
    decoding is kept for a few steps instead of being recomputed every step (it cost 1.5% of a
    native step at 4 rows); a new row, a verified draft, a shorter backlog or HOLD_STEPS steps
    make it choose again, and the new evidence can turn speculation on at once."""
    from backend.controller.adaptive import HOLD_STEPS

    cost = CostModel(GRID, [0.030 + 0.003 * m for m in GRID])
    c = AdaptiveController(TRAITS, cost)
    for size in (4, 8, 12, 16):
        for _ in range(100):
            c.trees._arm(DrafterKind.EAGLE, size).update(1.0)      # trees yield nothing here
    calls = []
    choose = c.choose_k
    c.choose_k = lambda *a, **k: calls.append(1) or choose(*a, **k)
    rows = [seq(0, DrafterKind.EAGLE), seq(1, DrafterKind.EAGLE)]

    def plain_steps(n, backlog=50):
        for _ in range(n):
            assert c.budgets(rows, None, [backlog] * len(rows)) == [0] * len(rows)
            c.observe_step(len(rows), 1, 0.0, cost.verify(len(rows), 1))
            for s in rows:
                c.observe(s, _Plain, None)
    plain_steps(2 * HOLD_STEPS)
    assert len(calls) == 2                                  # once per HOLD_STEPS steps
    rows.append(seq(2, DrafterKind.EAGLE))                  # a row joins: chosen again at once
    plain_steps(1)
    assert len(calls) == 3
    plain_steps(1, backlog=10)                              # a shorter backlog: again
    assert len(calls) == 4

    class V:
        num_accepted = 3
    for size in (4, 8, 12, 16):                             # the pool now says trees pay ...
        for _ in range(100):
            c.trees._arm(DrafterKind.EAGLE, size).update(4.0)
    assert c.budgets(rows, None, [10] * 3) == [0] * 3       # ... but the held choice has not seen it
    c.observe(rows[0], _Tree4, V)                           # a verified tree: evidence
    assert c.budgets(rows, None, [10] * 3)[0] > 0
    assert len(calls) == 5
