"""Wide activations on the native kernel (kernels.h act_q.wide; devices/native/wide.py): the build's
choice by measured agreement, what it writes into the manifest, and that an engine with wide
matrices is the same exact, batch-invariant engine to every drafter. The kernel's arithmetic
against GGUF's dequantization is in test_native_blocks.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backend.builder.pipeline import BuildConfig, build
from backend.devices.native import NativeOptions, NativeRecord, wide as wide_choice
from backend.errors import UserError
from backend.manifest import WeightFormat
from conftest import assert_greedy_identity, make_tiny_checkpoint, spec_decoder
from test_cli_errors import assert_one_line, specdec

native = pytest.importorskip("backend.runtime.native")
if not native.compiled():
    pytest.skip("the native kernel is not compiled", allow_module_level=True)


class _PlantedEngine:
    """A stand-in runtime whose top-1 tokens leave the all-wide reference's at a planted share of
    positions per narrow family (the shares add up, as they need not in a real model)."""

    def __init__(self, loss: dict[str, float], cfg):
        self.loss, self.config, self.forwards = loss, cfg, 0
        self.model = SimpleNamespace(wide=(), set_wide=lambda w: setattr(self.model, "wide", tuple(w)))

    def alloc(self, s):
        pass

    def free(self, s):
        pass

    def forward(self, seqs, ids, parents, index):
        self.forwards += 1
        n = ids.shape[1]
        off = round(n * sum(v for f, v in self.loss.items() if f not in self.model.wide))
        logits = np.zeros((1, n, 4), np.float32)
        logits[0, np.arange(n), (np.arange(n) < off).astype(int)] = 1.0
        return SimpleNamespace(logits=logits)


def _cfg(vocab):
    return SimpleNamespace(hidden_size=64, num_layers=2, head_dim=16, num_heads=4, num_kv_heads=2,
                           intermediate_size=256, vocab_size=vocab)


def test_a_large_engine_probes_a_sample_of_the_positions():
    n = wide_choice.PROBE_TOKENS
    prompts = [list(range(n + 50))] * wide_choice.PROBE_PROMPTS
    assert wide_choice.probe_positions(None) is None and wide_choice.probe_positions(wide_choice.SAMPLE_BYTES) is None
    at_8b = wide_choice.probe_positions(4_900_000_000)              # an 8B's Q4_K_M
    assert wide_choice.MIN_POSITIONS < at_8b < wide_choice.PROBE_PROMPTS * n
    assert wide_choice.probe_positions(10 ** 12) == wide_choice.MIN_POSITIONS
    rt = _PlantedEngine({"qkv": 1 / n}, _cfg(4096))
    _, report = wide_choice.choose(rt, prompts, lambda *a: None, positions=at_8b)
    assert report["positions"] == at_8b and report["prompts"] == -(-at_8b // n)


def test_the_search_keeps_narrow_every_family_the_bar_allows_largest_first():
    n = wide_choice.PROBE_TOKENS
    prompts = [list(range(n + 50))] * 2                                      # cut to PROBE_TOKENS each
    # none fails (1 - 10/n); from all wide, lm_head (the largest here) goes narrow (1 - 1/n >= the
    # bar), gate_up cannot join it (1 - 2/n), down and o can (1 - 1/n), qkv cannot (1 - 9/n)
    lose = {"qkv": 8 / n, "lm_head": 1 / n, "gate_up": 1 / n, "down": 0.0, "o": 0.0}
    assert 1 - 2 / n < wide_choice.BAR <= 1 - 1 / n
    rt = _PlantedEngine(lose, _cfg(4096))
    wide, report = wide_choice.choose(rt, prompts, lambda *a: None)
    assert wide == ("qkv", "gate_up") and report["meets_bar"] and report["wide"] == ["qkv", "gate_up"]
    tried = [tuple(m["wide"]) for m in report["measured"]]
    assert tried[:3] == [(), ("qkv", "o", "gate_up", "down"), ("qkv", "o", "down")]   # largest first
    assert report["positions"] == 2 * n and rt.model.wide == ()             # left with none wide
    # int8 alone meets the bar: nothing wide, one candidate measured besides the reference
    rt = _PlantedEngine({"qkv": 1 / n}, _cfg(4096))
    wide, report = wide_choice.choose(rt, prompts, lambda *a: None)
    assert wide == () and [m["wide"] for m in report["measured"]] == [[]] and rt.forwards == 4


def test_the_default_keeps_int8_where_the_fidelity_choice_costs_more_than_3_percent(monkeypatch):
    n = wide_choice.PROBE_TOKENS
    prompts = [list(range(n + 50))] * 2
    lose = {"qkv": 8 / n, "lm_head": 1 / n, "gate_up": 1 / n, "down": 0.0, "o": 0.0}
    # the cheapest family alone ("o": the fewest dot products of _cfg's) is priced first; the
    # fidelity choice where that one is affordable
    for costs, expect in (((0.0, 0.031), ()), ((0.03, 0.03), ("qkv", "gate_up")), ((-0.01, -0.01), ("qkv", "gate_up"))):
        seen = []
        monkeypatch.setattr(wide_choice, "price", lambda rt, wide, prompt, log: seen.append(wide) or
                            {"path": "test", "worst": "prefill", "cost": costs[len(seen) - 1],
                             "max_cost": wide_choice.MAX_COST})
        rt = _PlantedEngine(lose, _cfg(4096))
        wide, report = wide_choice.decide(rt, prompts, lambda *a: None)
        assert seen == [("o",), ("qkv", "gate_up")] and wide == expect and report["wide"] == list(expect), costs
        assert report["price"]["cost"] == costs[1]
        if not expect:
            assert report["by_fidelity"] == ["qkv", "gate_up"] and report["chosen_by"] == "measured, priced"
    # the cheapest family alone priced out: int8 without the search (reference and int8: 4 forwards)
    seen.clear()
    costs = (0.031,)
    rt = _PlantedEngine(lose, _cfg(4096))
    wide, report = wide_choice.decide(rt, prompts, lambda *a: None)
    assert seen == [("o",)] and wide == () and rt.forwards == 4 and report["searched"] is False
    assert report["price"]["cost"] == 0.031 and report["chosen_by"] == "measured, priced" and not report["meets_bar"]
    # nothing wide by fidelity: nothing to price
    seen.clear()
    wide, report = wide_choice.decide(_PlantedEngine({"qkv": 1 / n}, _cfg(4096)), prompts, lambda *a: None)
    assert wide == () and seen == [] and "price" not in report


def test_the_flag_s_forms_and_a_bad_one_refused_before_anything_is_read(tmp_path):
    assert wide_choice.parse("auto") is None and wide_choice.parse("none") == ()
    assert wide_choice.parse("all") == tuple(native.WIDE_FAMILIES)
    assert wide_choice.parse("lm_head, qkv") == ("lm_head", "qkv")
    with pytest.raises(UserError, match="--wide-activations.*'mlp'"):      # the option refuses it when made
        NativeOptions("qkv,mlp")
    r = specdec("build", "--wide-activations", "mlp", "--output", str(tmp_path / "r"), cwd=tmp_path)
    assert_one_line(r, "build", "--wide-activations", "mlp", "lm_head")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=4)
    named = build(BuildConfig(target=str(ckpt), output=d / "named", quiet=True, weights=(WeightFormat.GGUF,),
                              drafts=("self:1",), measure_costs=False, options=(NativeOptions("qkv,lm_head"),)))
    measured = build(BuildConfig(target=str(ckpt), output=d / "auto", quiet=True, weights=(WeightFormat.GGUF,),
                                 measure_costs=False, check_invariance=False))
    return named, measured


def test_the_manifest_records_the_choice_and_the_runtime_runs_it(tiny):
    from backend.devices import load_runtime

    named, measured = tiny
    ef = NativeRecord.of(named.engine("gguf"))
    assert ef.wide_activations == ("qkv", "lm_head") and ef.activations["chosen_by"] == "--wide-activations"
    rt = load_runtime(named)
    assert rt.model.struct.wide == native.WIDE_FAMILIES["qkv"] | native.WIDE_FAMILIES["lm_head"]
    rt.close()
    auto = NativeRecord.of(measured.engine("gguf")).activations
    assert auto["chosen_by"] in ("measured", "measured, priced") and auto["meets_bar"] and auto["bar"] == wide_choice.BAR
    if "price" in auto:                                     # the fidelity choice was priced on this machine
        price = auto["price"]
        assert price["path"] == native.isa() and set(price["shapes"]) == {"step", "verify", "prefill"}
        assert price["cost"] == max(s["cost"] for s in price["shapes"].values())
        assert (price["cost"] > wide_choice.MAX_COST) == (auto["chosen_by"] == "measured, priced")
    assert list(NativeRecord.of(measured.engine("gguf")).wide_activations) == auto["wide"]
    assert auto["measured"][0]["wide"] == [] and auto["positions"] > 0


def test_the_price_reads_a_step_a_verify_and_a_prefill_at_the_serving_thread_count(tiny, monkeypatch):
    """Each shape at the engine's own thread count by the wall clock where other processes left
    the cores idle (planted: none busy); where they did not (planted: a core held throughout), on
    one engine thread by its CPU time. The runtime keeps its governor, none wide."""
    from backend.devices import load_runtime
    from backend.devices.native import price as reading
    from backend.runtime import cores

    named, _ = tiny
    monkeypatch.setattr(reading, "MAX_PAIRS", reading.MIN_PAIRS)     # the fewest pairs: the clocks are the question
    rt = load_runtime(named)
    governor, prompt = rt.governor, list(range(3, 40))
    serving = (reading.CLOCK_SERVING, rt.threads) if rt.threads > 1 else (reading.CLOCK_ONE, 1)
    for busy, clock in ((0.0, serving), (1.0, (reading.CLOCK_ONE, 1))):
        monkeypatch.setattr(cores.OtherLoad, "cores", lambda self: busy)
        out = wide_choice.price(rt, ("qkv",), prompt, lambda *a: None)
        shapes = out["shapes"]
        assert [(k, v["rows"]) for k, v in shapes.items()] == [("step", 1), ("verify", 8), ("prefill", 18)]
        assert out["threads"] == rt.threads and out["cost"] == shapes[out["worst"]]["cost"] == max(v["cost"] for v in shapes.values())
        assert all((v["clock"], v["threads"]) == clock and v["ms_int8"] > 0 and v["ms_wide"] > 0
                   and v["pairs"] >= reading.MIN_PAIRS for v in shapes.values()), (busy, shapes)
    assert rt.governor is governor and rt.model.struct.wide == 0
    rt.close()


def test_an_engine_with_wide_matrices_is_exact_and_batch_invariant(tiny):
    named, _ = tiny
    assert named.engine("gguf").batch_invariant            # the build's verify-vs-single-steps check
    plain = None
    for kind in ("prompt-lookup", "draft-model"):           # draft-model: the self:1 draft
        plain = assert_greedy_identity(spec_decoder(named, "gguf", num_draft_tokens=4), kind, plain)
