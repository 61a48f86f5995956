"""EAGLE draft head: its ONNX export equals the torch model; dynamic trees are valid; greedy
EAGLE speculation is token-identical to plain decoding; verification of the head's trees keeps
the target distribution."""
import numpy as np
import pytest

from backend.builder.pipeline import BuildConfig, build
from backend.manifest import WeightFormat
from conftest import chain, eagle_head_reference, make_tiny_checkpoint, random_head

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    ckpt = make_tiny_checkpoint(d / "ckpt")
    onnx = (WeightFormat.FP32, WeightFormat.Q4)      # the ONNX head export (the native one: test_native)
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", quiet=True, measure_costs=False, weights=onnx))
    head = random_head(m, d / "head", vocab_size=128)
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", quiet=True, measure_costs=False, weights=onnx,
                          drafts=(f"eagle:{head}",)))
    return m, head


def test_head_onnx_equals_torch(tiny):
    from backend.runtime.ort import OrtRuntime

    m, head_dir = tiny
    t = 13
    hck, feats, toks, f_ref, l_ref = eagle_head_reference(m, head_dir, t)
    d = m.drafts["eagle"]
    rt = OrtRuntime(m.resolve(d.path), hck.config, 1, m.max_seq_len)
    rt.alloc(0)
    out = rt.forward([0], toks, chain(t), np.arange(t)[None], {"features": feats})
    np.testing.assert_allclose(out.hidden[0], f_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.logits[0], l_ref, rtol=1e-4, atol=1e-4)


def test_dynamic_trees_are_valid_and_greedy_is_identical(tiny):
    from backend.config import DrafterKind, SamplingParams, ServeConfig, SpecConfig
    from backend.engine import make_decoder
    from backend.sequence import Request

    m, _ = tiny
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), spec=SpecConfig(
        num_draft_tokens=6, max_tree_nodes=6, eagle_depth=3, eagle_topk=3)))
    seen = []
    orig = dec.drafters[DrafterKind.EAGLE].propose

    def spy(seqs, budgets):
        drafts = orig(seqs, budgets)
        for d, b in zip(drafts, budgets):
            seen.append((d, b))
        return drafts

    dec.drafters[DrafterKind.EAGLE].propose = spy
    prompt = tuple(np.random.default_rng(1).integers(3, m.model.vocab_size, 20).tolist())
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [t for o in dec.generate(Request(prompt, params, DrafterKind.NONE)) for t in o.new_ids]
    spec = [t for o in dec.generate(Request(prompt, params, DrafterKind.EAGLE)) for t in o.new_ids]
    assert spec == plain
    hybrid = [t for o in dec.generate(Request(prompt + prompt, params, DrafterKind.LOOKUP_EAGLE)) for t in o.new_ids]
    plain2 = [t for o in dec.generate(Request(prompt + prompt, params, DrafterKind.NONE)) for t in o.new_ids]
    assert hybrid == plain2
    assert seen and any(d.num_draft_tokens > 0 for d, _ in seen)
    for d, budget in seen:
        p = d.tree.parents
        assert p[0] == -1 and all(0 <= p[i] < i for i in range(1, p.size))
        assert d.num_draft_tokens <= budget and d.tree.max_depth <= 3


def test_eagle_state_survives_speculation_off_and_on(tiny):
    """Budgets 6, 0, 0, 6, ...: the head's KV and pending features stay in sync (the catch-up
    asserts it every step; acceptance not collapsing is checked with the trained head in
    test_spec_engine.py)."""
    from backend.config import DrafterKind, SamplingParams, ServeConfig, SpecConfig
    from backend.engine import make_decoder
    from backend.sequence import Request

    m, _ = tiny
    spec = SpecConfig(num_draft_tokens=6, max_tree_nodes=6, eagle_depth=3, eagle_topk=3)
    prompt = tuple(np.random.default_rng(2).integers(3, m.model.vocab_size, 16).tolist())
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), spec=spec))
    plain = [t for o in dec.generate(Request(prompt, params, DrafterKind.NONE)) for t in o.new_ids]
    budgets = iter([6, 0, 0, 6, 0, 6, 6, 0] * 20)
    dec.controller.budgets = lambda seqs, previews=None, backlogs=None: [min(next(budgets), s.draft_room()) for s in seqs]
    toggled = list(dec.generate(Request(prompt, params, DrafterKind.EAGLE)))
    assert [t for o in toggled for t in o.new_ids] == plain
    assert toggled[-1].stats.num_steps < 48 and toggled[-1].stats.num_draft_tokens > 0


def test_catch_up_backlog_reaches_the_controller_and_the_build_prices_it(tiny):
    """The head reports its backlog (the prompt, then one feature per step it did not draft,
    then what the last verify kept); the decoder hands it to an adaptive controller; the build
    times the head as it drafts and prices each catch-up token."""
    from backend.builder.costs import measure_cost_model
    from backend.builder.pipeline import check_priced
    from backend.config import DrafterKind, SamplingParams, ServeConfig, SpecConfig
    from backend.controller import AdaptiveController, CostModel
    from backend.engine import make_decoder
    from backend.sequence import Request

    m, _ = tiny
    cm = measure_cost_model(m, context=32, reps=2)
    assert cm["draft_step_s"]["eagle"] > 0
    assert cm["catch_up_s"]["eagle"] >= 0
    assert CostModel.from_json(cm).catch_up_s == cm["catch_up_s"]
    check_priced(m.with_updates(cost_model=cm))       # every drafter the build serves is priced

    spec = SpecConfig(max_tree_nodes=6, eagle_depth=3, eagle_topk=3)
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), spec=spec))
    dec.controller = AdaptiveController({k: d.traits for k, d in dec.drafters.items()}, CostModel.from_json(cm))
    head = dec.drafters[DrafterKind.EAGLE]
    prompt = tuple(np.random.default_rng(3).integers(3, m.model.vocab_size, 20).tolist())
    s = dec.start(Request(prompt, SamplingParams(max_tokens=16, ignore_eos=True), DrafterKind.EAGLE))
    while dec.prefill(s) is None:
        pass
    assert head.backlog(s) == len(prompt)
    seen, budget = [], [0]
    dec.controller.budgets = lambda seqs, previews=None, backlogs=None: (
        seen.append(backlogs) or [budget[0]] * len(seqs))
    dec.step([s])
    assert seen == [[len(prompt)]] and head.backlog(s) == len(prompt) + 1
    budget[0] = 6
    out = dec.step([s])[0]
    assert seen[-1] == [len(prompt) + 1] and head.backlog(s) == out.step_accepted + 1
    dec.finish(s)


def test_a_drafter_without_a_cost_entry_fails_the_build_and_the_server(tiny):
    """The EAGLE head's forwards must be priced for `eagle` and `lookup+eagle` (which drafts with
    the head whenever lookup has no match); a cost model without them fails the build's check
    and refuses to make an adaptive controller, naming the drafter."""
    from backend.builder.pipeline import BuildError, check_priced
    from backend.config import ServeConfig, SpecConfig
    from backend.controller import UnpricedDrafter
    from backend.engine import make_decoder

    m, _ = tiny
    cm = {"tokens": [1, 64], "seconds": [0.02, 0.03], "per_seq_s": 0.0,
          "draft_step_s": {"prompt-lookup": 0.0, "draft-model": 0.001}, "catch_up_s": {"draft-model": 1e-4}}
    with pytest.raises(BuildError, match="drafter 'eagle' has no cost entry 'eagle'"):
        check_priced(m.with_updates(cost_model=cm))
    with pytest.raises(UnpricedDrafter, match="lookup\\+eagle|'eagle'"):
        make_decoder(ServeConfig(engine_dir=str(m.root), spec=SpecConfig()), m.with_updates(cost_model=cm))
    cm["draft_step_s"]["eagle"], cm["catch_up_s"]["eagle"] = 0.002, 1e-4
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), spec=SpecConfig()), m.with_updates(cost_model=cm))
    from backend.config import DrafterKind
    hybrid = dec.drafters[DrafterKind.LOOKUP_EAGLE].traits
    assert hybrid.cost_key == "eagle" and dec.controller._draft_cost({DrafterKind.LOOKUP_EAGLE}, 1, 8) > 0


def test_a_remote_head_drafts_through_a_draft_node_losslessly(tiny):
    """The EAGLE head on a draft node (in process, JSON over the wire): the target's features
    travel with the tokens, greedy output equals plain decoding, and the head is accepted."""
    import json

    from backend.config import DrafterKind, SamplingParams, ServeConfig, SpecConfig
    from backend.draft_node import DraftNode
    from backend.draft_kinds import eagle_drafter
    from backend.drafters.remote import RemoteDrafter
    from backend.engine import make_decoder
    from backend.sequence import Request

    m, _ = tiny
    spec = SpecConfig(num_draft_tokens=6, max_tree_nodes=6, eagle_depth=3, eagle_topk=3)
    node = DraftNode(eagle_drafter(m, spec), m.model.vocab_size)
    wire = lambda req, feats: json.loads(json.dumps(node.handle(json.loads(json.dumps(req)), feats)))
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), spec=spec))
    local = dec.drafters[DrafterKind.EAGLE]
    dec.drafters[DrafterKind.EAGLE] = RemoteDrafter("eagle", local.traits, wire, dec.drafters[DrafterKind.PROMPT_LOOKUP])
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = tuple(np.random.default_rng(5).integers(3, m.model.vocab_size, 17).tolist())
    plain = [t for o in dec.generate(Request(prompt, params, DrafterKind.NONE)) for t in o.new_ids]
    outs = list(dec.generate(Request(prompt, params, DrafterKind.EAGLE)))
    assert [t for o in outs for t in o.new_ids] == plain
    assert outs[-1].stats.num_draft_tokens > 0


def test_confidence_gating_stops_growing_where_the_head_is_unsure(tiny):
    """level_gate: another tree level only while the best frontier path is at least that
    probable. A gate of 1 grows no level past the first (one head forward for the catch-up, none
    for expansions), a gate of 0 grows depth - 1 levels; both drafts are valid and greedy
    speculation stays identical. The gate from a cost model is head forward / plain step."""
    from backend.config import DrafterKind, SamplingParams, ServeConfig, SpecConfig
    from backend.drafters.eagle import level_gate
    from backend.engine import make_decoder
    from backend.sequence import Request

    m, _ = tiny
    assert level_gate(None) == 0.0
    assert level_gate({"tokens": [1, 4], "seconds": [0.02, 0.03], "draft_step_s": {"eagle": 0.004}}) == pytest.approx(0.2)
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), spec=SpecConfig(num_draft_tokens=6, eagle_depth=4)))
    eagle = dec.drafters[DrafterKind.EAGLE]
    calls, per_propose = [], []
    forward, propose = eagle.rt.forward, eagle.propose
    eagle.rt.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)

    def counted(seqs, budgets):
        calls.clear()
        out = propose(seqs, budgets)
        if any(b > 0 for b in budgets):
            per_propose.append(len(calls) - 1)                  # minus the catch-up forward
        return out

    eagle.propose = counted
    prompt = tuple(np.random.default_rng(2).integers(3, m.model.vocab_size, 20).tolist())
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = [t for o in dec.generate(Request(prompt, params, DrafterKind.NONE)) for t in o.new_ids]
    per_step = {}
    for gate in (1.0, 0.0):
        eagle.level_gate = gate
        per_propose.clear()
        spec = [t for o in dec.generate(Request(prompt, params, DrafterKind.EAGLE)) for t in o.new_ids]
        assert spec == plain and per_propose
        per_step[gate] = set(per_propose)
    assert per_step[1.0] == {0} and max(per_step[0.0]) == 3          # fewer near the end: small budgets


def test_top_logprobs_are_the_k_best_of_the_log_softmax():
    """The drafter's top-k (k argmax passes, log-softmax of the k entries only) against the full
    log-softmax sorted; ties go to the lower index."""
    from backend.drafters.eagle import _top_logprobs

    x = np.random.default_rng(3).standard_normal((2, 3, 500)).astype(np.float32) * 4
    x[1, 2, 10] = x[1, 2, 20] = x[1, 2].max() + 1.0               # a tie for first place
    idx, lp = _top_logprobs(x, 4)
    full = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    want = np.argsort(-full, -1, kind="stable")[..., :4]
    assert np.array_equal(idx, want) and idx[1, 2, 0] == 10 and idx[1, 2, 1] == 20
    np.testing.assert_allclose(lp, np.take_along_axis(full, want, -1), atol=1e-5)
