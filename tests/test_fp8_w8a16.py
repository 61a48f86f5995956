"""FP8 weight-only (W8A16) by default at decode and verify widths (issue 41, point 5), in Triton's
interpreter: kernels.linear_w8 reads the E4M3 codes and block scales inside the GEMM (a row's bits
the same at M = 1, 16 and 64, for every block shape a recipe uses; agreement with a float
reference), and the torch runtime's invariant mode runs every FP8 linear through it at decode
and verify widths, input-quantizing recipes included (no input-quantization op, the bits of the
same engine built weight-only), keeping the hardware W8A8 GEMM for prefill-sized forwards
(TorchModel.w8a8_from). The 128 x 128 blocks' invariance at split-K: tests/test_splitk.py.
What no CPU shows: the speed (the GPU check's fp8_decode step, its w8a16 row)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from backend.buildlib.fp8 import FUSED  # noqa: E402
from backend.runtime import fp8  # noqa: E402
from backend.runtime import torch_model as TM  # noqa: E402
from plugins import kernels as K  # noqa: E402
from test_kernels import _runtime_on_random_weights  # noqa: E402


@pytest.mark.parametrize("block", [(1, 0), (1, 32), (128, 128)], ids=["channel", "1x32", "128x128"])
def test_w8a16_rows_are_the_same_bits_at_m1_m16_m64_and_near_the_float_reference(block):
    g = torch.Generator().manual_seed(3)
    n, k = 96, 256
    w = torch.randn(n, k, generator=g) * torch.linspace(0.1, 4, k)
    rec = fp8.Recipe("w8", block, "token")
    q, s = fp8.quantize_weight(w, rec)
    x = torch.randn(64, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    y64 = K.linear_w8(x, q, s, block, bias)
    y16 = K.linear_w8(x[:16], q, s, block, bias)
    assert torch.equal(y16, y64[:16])
    for j in (0, 7, 15, 40, 63):
        assert torch.equal(K.linear_w8(x[j:j + 1], q, s, block, bias), y64[j:j + 1]), j
    deq = fp8.dequantize_weight(q, s, rec).double()
    ref = x.double() @ deq.T + bias.double()
    assert (y64.double() - ref).abs().max() / ref.abs().max() < 1e-2          # bf16 rounding of the output
    full = x.double() @ w.double().T + bias.double()                          # and E4M3's of the weights
    assert (y64.double() - full).abs().max() / full.abs().max() < 6e-2


def _no_input_quantization(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("an input-quantization op at a decode / verify width")
    monkeypatch.setattr(fp8, "quantize_input", refuse)
    monkeypatch.setattr(fp8, "fake_quant_input", refuse)


def _decode_and_verify(rt) -> np.ndarray:
    """Logits of a 6-token prompt's forward, then of a 4-node tree after it (both narrower
    than w8a8_from; an 11-token prompt took no other path and cost the interpreter more rows)."""
    rng = np.random.default_rng(4)
    rt.alloc(0)
    a = np.asarray(rt.forward([0], rng.integers(3, 128, (1, 6)), np.arange(-1, 5, dtype=np.int32)[None],
                              np.arange(6)[None]).logits).copy()
    rt.commit([0], [np.arange(6)])
    b = rt.forward([0], rng.integers(3, 128, (1, 4)), np.array([[-1, 0, 0, 1]], np.int32), np.arange(4)[None])
    return np.concatenate([a[0], np.asarray(b.logits)[0]])


@pytest.mark.parametrize("name", ["channel-token", "g32-token"])
def test_input_quantizing_recipes_decode_and_verify_as_w8a16(name, monkeypatch):
    """An engine built with W8A8 linears, in the invariant mode at decode / verify widths: every
    linear reads its codes through linear_w8 with its input unquantized (no quantization op, no
    bf16 copy of the weights), so the logits are, bit for bit, those of the same codes built
    weight-only (the build's W8A16)."""
    rec = fp8.recipe(name)
    w8a8 = _runtime_on_random_weights(torch.bfloat16, invariant=True, recipe=rec)
    assert all(lin.qin for lin in w8a8.model.linears().values())
    with monkeypatch.context() as m:
        _no_input_quantization(m)
        got = _decode_and_verify(w8a8)
    assert all(lin.w8a16(False) and lin._w is None for lin in w8a8.model.linears().values())
    every = [f"layers.{i}.{k}" for i in range(2) for k in FUSED]
    w8a16 = _runtime_on_random_weights(torch.bfloat16, invariant=True, recipe=rec.with_weight_only(every))
    assert np.array_equal(got, _decode_and_verify(w8a16))


def test_a_prefill_sized_forward_runs_the_hardware_w8a8_gemm_and_decode_does_not(monkeypatch):
    """Where the GPU runs the recipe's scaled GEMM (forced here: hardware_fp8 true, _scaled_mm
    counted and emulated), a forward of w8a8_from nodes per row or more runs it for every layer
    linear; narrower forwards (decode, verify) run linear_w8; w8a8_from None: never W8A8."""
    monkeypatch.setattr(TM, "hardware_fp8", lambda device, rec=None: True)
    calls = []

    def scaled_mm(lin, x):
        calls.append(x.shape[0])
        xq = fp8.fake_quant_input(x.float(), lin.recipe, lin.act_scale)
        return TM.linear_rows(xq, fp8.dequantize_weight(*lin.wq, lin.recipe), None, False).to(x.dtype)

    monkeypatch.setattr(TM.Linear, "_scaled_mm", scaled_mm)
    rt = _runtime_on_random_weights(torch.bfloat16, invariant=True, recipe=fp8.recipe("channel-token"))
    assert all(lin.hw == "rowwise" and lin.kernel for lin in rt.model.linears().values())
    rt.model.w8a8_from = 8
    rng = np.random.default_rng(5)
    rt.alloc(0)
    rt.forward([0], rng.integers(3, 128, (1, 9)), np.arange(-1, 8, dtype=np.int32)[None], np.array([[8]]))
    assert calls == [9] * 8                          # 2 layers x qkv, o, gate_up, down
    rt.commit([0], [np.arange(9)])
    calls.clear()
    rt.forward([0], rng.integers(3, 128, (1, 4)), np.array([[-1, 0, 0, 1]], np.int32), np.arange(4)[None])
    assert calls == []
    rt.commit([0], [np.array([0])])
    rt.model.w8a8_from = None
    rt.forward([0], rng.integers(3, 128, (1, 12)), np.arange(-1, 11, dtype=np.int32)[None], np.array([[11]]))
    assert calls == []


def _forced_hardware(monkeypatch) -> list[int]:
    """hardware_fp8 true and torch._scaled_mm emulated (its calls' widths recorded)."""
    monkeypatch.setattr(TM, "hardware_fp8", lambda device, rec=None: True)
    calls: list[int] = []

    def scaled_mm(lin, x):
        calls.append(x.shape[0])
        xq = fp8.fake_quant_input(x.float(), lin.recipe, lin.act_scale)
        return TM.linear_rows(xq, fp8.dequantize_weight(*lin.wq, lin.recipe), None, False).to(x.dtype)

    monkeypatch.setattr(TM.Linear, "_scaled_mm", scaled_mm)
    return calls


def test_the_w8a8_width_is_the_smallest_from_which_it_is_faster_by_the_margin_at_every_larger():
    from backend.devices.cuda import w8a8

    row = lambda w, a, b: {"width": w, "w8a8_ms": a, "w8a16_ms": b}
    assert w8a8.threshold([row(33, 2, 1), row(64, 3, 4), row(128, 5, 9)]) == 64
    assert w8a8.threshold([row(33, 0.5, 1), row(64, 3, 2), row(128, 5, 9)]) == 128    # not at 64: not from 33
    assert w8a8.threshold([row(33, 0.5, 1), row(64, 0.99, 1)]) is None                # within the margin
    assert w8a8.threshold([]) is None
    assert w8a8.FLOOR == 33 and min(w8a8.WIDTHS) == w8a8.FLOOR


def test_the_build_measures_w8a8_against_w8a16_by_width_on_the_linears_the_gpu_runs(monkeypatch):
    """w8a8.measure times every hardware linear both ways at each width from FLOOR (a fake timer
    that runs the call and prices what ran: W8A8 cheaper from 512 rows), so W8A8 runs from 512;
    below FLOOR nothing is measured; a weight-only engine has nothing to measure; the model's
    mode is restored. The W8A16 calls are recorded, not computed (kernels.linear_w8 at up to 2048
    rows in the interpreter cost ~85 s of CPU here; its bits: the tests above and
    test_the_real_timer_runs_both_kernels_at_each_width, which runs it inside measure)."""
    from backend.devices.cuda import w8a8

    calls = _forced_hardware(monkeypatch)
    rt = _runtime_on_random_weights(torch.bfloat16, invariant=False, recipe=fp8.recipe("channel-token"))
    w8 = []
    monkeypatch.setattr(K, "linear_w8", lambda x, q, *a, **k: w8.append(x.shape[0]) or x.new_zeros(x.shape[0], q.shape[0]))
    seen = []

    def timer(fn, reps, device):
        calls.clear()
        w8.clear()
        fn()
        assert not (calls and w8), "one way per call"
        if calls:                                  # W8A8: every linear through the scaled GEMM
            assert len(calls) == 8 and len(set(calls)) == 1
            seen.append(("w8a8", calls[0]))
            return 10 + 0.01 * calls[0]
        assert len(w8) == 8 and len(set(w8)) == 1  # W8A16: every linear through kernels.linear_w8
        seen.append(("w8a16", w8[0]))
        return 5 + 0.03 * w8[0]

    r = w8a8.measure(rt.model, 2048, timer=timer)
    assert [m["width"] for m in r["measured"]] == list(w8a8.WIDTHS)
    assert seen == [(k, w) for w in w8a8.WIDTHS for k in ("w8a8", "w8a16")]
    assert r["w8a8_from"] == 512 and r["linears"] == 8
    assert rt.model.invariant is False
    assert w8a8.measure(rt.model, 300, timer=timer)["w8a8_from"] is None
    assert w8a8.measure(rt.model, 32, timer=timer)["reason"].startswith("max_seq_len 32")
    every = [f"layers.{i}.{k}" for i in range(2) for k in FUSED]
    weight_only = _runtime_on_random_weights(torch.bfloat16, invariant=False,
                                             recipe=fp8.recipe("channel-token").with_weight_only(every))
    assert "no linear" in w8a8.measure(weight_only.model, 2048, timer=timer)["reason"]


def test_the_real_timer_runs_both_kernels_at_each_width(monkeypatch):
    """The build's timer on this CPU (the host clock; the scaled GEMM emulated): every width
    measured both ways with positive times, and the W8A16 row really through kernels.linear_w8."""
    from backend.devices.cuda import w8a8

    calls = _forced_hardware(monkeypatch)
    rt = _runtime_on_random_weights(torch.bfloat16, invariant=True, recipe=fp8.recipe("channel-token"))
    w8 = []
    real = K.linear_w8
    monkeypatch.setattr(K, "linear_w8", lambda x, *a, **k: w8.append(x.shape[0]) or real(x, *a, **k))
    r = w8a8.measure(rt.model, 40, reps=1)               # the interpreter is slow: one width
    assert [m["width"] for m in r["measured"]] == [33]
    assert all(m["w8a8_ms"] > 0 and m["w8a16_ms"] > 0 for m in r["measured"])
    assert set(calls) == {33} and set(w8) == {33} and len(calls) == len(w8) == 2 * 8     # warm-up + 1 rep
    assert r["w8a8_from"] in (None, 33) and rt.model.invariant is True
