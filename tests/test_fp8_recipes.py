"""FP8 recipes (runtime/fp8.py; issue 30): quantize/dequantize round trips and scale shapes,
per-token and per-group input scales (rows independent: batch invariance), block scales that
confine an outlier, power-of-two MX scales; torch._scaled_mm's path equal to the emulation (this
CPU's torch has the row-wise form); the build's choice (order, weight-only fallback, report in
the manifest, old manifests and engine files still load); and the torch runtime and the engine
graph holding the same FP8 bits and scales for the same recipe."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backend.runtime import fp8  # noqa: E402
from conftest import chain, device_env, make_tiny_checkpoint  # noqa: E402


@pytest.mark.parametrize("rec", fp8.RECIPES, ids=lambda r: r.name)
def test_round_trip_scale_shapes_and_idempotence(rec):
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, s = fp8.quantize_weight(w, rec)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == fp8.scale_shape((300, 200), rec.weight_block)
    d = fp8.dequantize_weight(q, s, rec)
    assert float((d - w).norm() / w.norm()) < 0.04
    q2, s2 = fp8.quantize_weight(d, rec)            # dequantized weights quantize to the same values
    assert torch.equal(fp8.dequantize_weight(q2, s2, rec), d)
    if not rec.pow2:                                # (a power-of-two scale may halve: 2q, s / 2)
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    assert fp8.Recipe.from_json(json.loads(json.dumps(rec.with_weight_only(["layers.1.o"]).to_json()))) == \
        rec.with_weight_only(["layers.1.o"])


def test_dynamic_input_scales_are_per_row_and_per_group():
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 9, 5)[:, None]
    tok, grp, mx = fp8.recipe("channel-token"), fp8.recipe("block128"), fp8.recipe("mx32")
    q, s = fp8.quantize_input(x, tok)
    assert s.shape == (5, 1) and torch.equal(q.float().abs().amax(1), torch.full((5,), 448.0))
    q, s = fp8.quantize_input(x, grp)
    assert s.shape == (5, 2)                           # 200 columns: a group of 128 and a ragged 72
    assert torch.allclose(s[:, 1], x[:, 128:].abs().amax(1) / 448)
    _, s = fp8.quantize_input(x, mx)
    assert s.shape == (5, 7) and torch.equal(torch.exp2(torch.log2(s).round()), s)      # powers of two
    for rec in (tok, grp, mx):                         # a row's result does not depend on the batch
        full = fp8.fake_quant_input(x, rec)
        assert all(torch.equal(fp8.fake_quant_input(x[i:i + 1], rec), full[i:i + 1]) for i in range(5))
    amax = float(x.abs().max())
    static = fp8.fake_quant_input(x, fp8.recipe("channel-tensor"), amax / 448)   # the calibrated scale
    assert float((static - x).abs().max()) <= amax / 16 and float(static.abs().max()) == pytest.approx(amax)
    clipped = fp8.fake_quant_input(x, fp8.recipe("channel-tensor"), amax / 896)
    assert float(clipped.abs().max()) == pytest.approx(amax / 2)           # beyond 448 s: saturated


def test_block_scales_confine_an_outlier():
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(2)) * 0.01
    spiky = w.clone()
    spiky[5, 7] = 5000.0             # its block's scale puts the others among E4M3's subnormals
    rec = fp8.recipe("block128")
    err = lambda m: (fp8.dequantize_weight(*fp8.quantize_weight(m, rec), rec) - m).abs()
    clean, hit = err(w), err(spiky)
    assert torch.equal(hit[128:], clean[128:]) and torch.equal(hit[:, 128:], clean[:, 128:])
    assert float(hit[:128, :128].mean()) > 5 * float(clean[:128, :128].mean())
    per_channel = (fp8.dequantize_weight(*fp8.quantize_weight(spiky, fp8.LEGACY), fp8.LEGACY) - spiky).abs()
    assert float(per_channel[5, 128:].mean()) > 5 * float(hit[5, 128:].mean())    # the whole row pays


def _gptq_reference(w, h, rec):
    """GPTQ as the paper writes it, one column at a time in float64 (no lazy blocks), act order,
    the recipe's scales from the unrounded weights: the E4M3 values it picks, [N, K]."""
    w, h = w.double().clone(), h.double().clone()
    k = w.shape[1]
    full = fp8._expand(fp8._scale(fp8._amax_blocks(w.float(), rec.weight_block), rec.pow2), tuple(w.shape),
                       rec.weight_block).double()
    order = torch.argsort(torch.diagonal(h), descending=True)
    w, h, full = w[:, order], h[order][:, order], full[:, order]
    h += 0.01 * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    q = torch.empty_like(w)
    for j in range(k):
        s = full[:, j]
        q[:, j] = (w[:, j] / s).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * s
        err = (w[:, j] - q[:, j]) / u[j, j]
        w[:, j:] -= err[:, None] * u[j, j:][None]
    return q[:, torch.argsort(order)]


@pytest.mark.parametrize("name", ["channel-token", "block128", "g32-token"])
def test_gptq_rounding_keeps_the_format_and_lowers_the_output_error(name):
    """The same E4M3 codes' layout and scales as rounding to nearest; the textbook algorithm's
    values (one column at a time, float64) but for float rounding at a few ties; and a smaller
    output error on the inputs its Hessian came from, and on fresh inputs of the same law."""
    from backend.buildlib import fp8_gptq

    rec = fp8.recipe(name + "+gptq")
    assert rec.gptq and rec.label == f"{name}+gptq" and fp8.Recipe.from_json(rec.to_json()) == rec
    g = torch.Generator().manual_seed(5)
    mix = torch.randn(160, 160, generator=g) / 160 ** 0.5 + torch.eye(160)    # correlated inputs
    x = (torch.randn(2000, 160, generator=g) * torch.linspace(0.2, 3, 160)) @ mix
    fresh = (torch.randn(2000, 160, generator=g) * torch.linspace(0.2, 3, 160)) @ mix
    w = torch.randn(200, 160, generator=g)
    h = x.T @ x
    q, s = fp8_gptq.quantize_weight(w, rec, h)
    q0, s0 = fp8.quantize_weight(w, rec)
    assert q.dtype == torch.float8_e4m3fn and q.shape == q0.shape and torch.equal(s, s0)
    d, d0 = fp8.dequantize_weight(q, s, rec), fp8.dequantize_weight(q0, s0, rec)
    ref = _gptq_reference(w, h, rec)
    assert float(torch.isclose(d.double(), ref, rtol=1e-5, atol=0).float().mean()) > 0.99
    err = lambda m, inp: float(((inp @ (m - w).T) ** 2).sum() / ((inp @ w.T) ** 2).sum()) ** 0.5
    assert err(d, x) < 0.7 * err(d0, x) and err(d, fresh) < 0.8 * err(d0, fresh)
    assert float((d - w).norm() / w.norm()) < 0.08          # still close to the weights themselves
    dead = h.clone()
    dead[:, 7] = dead[7, :] = 0                             # an input never seen: its weights go to 0
    qd, _ = fp8_gptq.quantize_weight(w, rec, dead)
    assert not torch.any(qd.float()[:, 7])
    with pytest.raises(ValueError, match="gptq"):
        fp8.recipe("block128+awq")


@pytest.mark.parametrize("name", ["channel-tensor", "channel-token"])
def test_the_scaled_mm_path_equals_the_emulation(name):
    """Linear's torch._scaled_mm path (row-wise scales, also on this CPU's torch) against the
    emulation the quality is measured with."""
    from backend.runtime.torch_model import Linear, probe_scaled_mm

    rec = fp8.recipe(name)
    assert probe_scaled_mm(torch.device("cpu"), rec)
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(3))
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(4))
    hw = Linear(*fp8.quantize_weight(w, rec), None, torch.bfloat16, rec, act_scale=0.02, hw=True)
    emu = Linear(*fp8.quantize_weight(w, rec), None, torch.float32, rec, act_scale=0.02, hw=False)
    assert hw.hw == "rowwise" and emu.hw is None
    xb = x.to(torch.bfloat16)                        # the same input: bf16 decides FP8 roundings too
    ref = emu(xb.float())
    assert float((hw(xb).float() - ref).norm() / ref.norm()) < 1e-2


def test_the_choice_takes_the_fastest_recipe_that_meets_the_bar(monkeypatch):
    """Recipes in order, then the best two with their worst linears weight-only (an eighth, a
    quarter, all); missing the bar, the best measured, and the report says so; GPTQ rounding
    where the calibration holds Hessians."""
    from types import SimpleNamespace

    from backend.devices.cuda import fp8_choice

    ck = SimpleNamespace(config=SimpleNamespace(num_layers=8))
    linears = [f"layers.{i}.{k}" for i in range(8) for k in ("qkv", "o", "gate_up", "down")]
    monkeypatch.setattr(fp8_choice, "reference", lambda *a: fp8_choice.Probe([(np.zeros(3), 1)], [np.zeros((1, 4))]))
    monkeypatch.setattr(fp8_choice, "linear_errors", lambda ck, probe, rec, *a: {n: i for i, n in enumerate(linears)})

    def fake(pass_when):
        return lambda ck, probe, rec, *a: ({"top1_agreement": 0.99, "kl_mean": 0.001} if pass_when(rec)
                                           else {"top1_agreement": 0.95, "kl_mean": 0.03})
    monkeypatch.setattr(fp8_choice, "measure", fake(lambda r: r.name == "block128"))
    rec, report = fp8_choice.choose(ck, [[1]], 64, {}, lambda *a: None)
    assert rec == fp8.recipe("block128") and report["meets_bar"]
    assert [t["recipe"] for t in report["measured"]] == ["channel-tensor", "channel-token", "block128"]
    monkeypatch.setattr(fp8_choice, "measure", fake(lambda r: r.name == "channel-token" and len(r.weight_only) >= 4))
    rec, report = fp8_choice.choose(ck, [[1]], 64, {}, lambda *a: None)
    assert rec.label == "channel-token+wo4" and set(rec.weight_only) == set(linears[-4:])   # the worst 4
    fallbacks = [t["recipe"] for t in report["measured"]][len(fp8.RECIPES):]
    assert fallbacks == ["channel-tensor+wo4", "channel-tensor+wo8", "channel-tensor+wo32", "channel-token+wo4"]
    monkeypatch.setattr(fp8_choice, "measure", fake(lambda r: False))
    rec, report = fp8_choice.choose(ck, [[1]], 64, {}, lambda *a: None)
    assert not report["meets_bar"] and rec.name == "channel-tensor"        # the best measured, first of ties
    kl = {"block128": 0.02, "g32-token": 0.021}                              # ranked by KL, the less noisy
    monkeypatch.setattr(fp8_choice, "measure", lambda ck, probe, rec, *a: {"top1_agreement": 0.96,
                                                                           "kl_mean": kl.get(rec.name, 0.03)})
    rec, report = fp8_choice.choose(ck, [[1]], 64, {}, lambda *a: None)
    fallbacks = [t["recipe"] for t in report["measured"]][len(fp8.RECIPES):]
    assert fallbacks == ["block128+wo4", "block128+wo8", "block128+wo32", "g32-token+wo4", "g32-token+wo8",
                         "g32-token+wo32"] and rec.label == "block128"
    # a calibration with the linears' Hessians: every candidate's weights rounded by GPTQ
    monkeypatch.setattr(fp8_choice, "measure", fake(lambda r: r.name == "channel-token" and r.gptq))
    rec, report = fp8_choice.choose(ck, [[1]], 64, {"layers.0.qkv.hessian": None}, lambda *a: None)
    assert rec == fp8.recipe("channel-token+gptq") and report["meets_bar"]
    assert [t["recipe"] for t in report["measured"]] == ["channel-tensor+gptq", "channel-token+gptq"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny target with FP8 chosen by the build (cuda), and block128+gptq forced on both devices."""
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices.cuda import Fp8Options
    from backend.manifest import Device, WeightFormat

    d = tmp_path_factory.mktemp("fp8")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=3)
    kw = dict(target=str(ckpt), quiet=True, weights=(WeightFormat.FP32, WeightFormat.FP8), measure_costs=False,
              check_invariance=False)
    auto = build(BuildConfig(output=d / "auto", device=Device.CUDA, **kw))
    cuda = build(BuildConfig(output=d / "cuda", device=Device.CUDA, options=(Fp8Options("block128+gptq"),), **kw))
    env = device_env("tensorrt")
    try:
        trt = build(BuildConfig(output=d / "trt", device=Device.TENSORRT, options=(Fp8Options("block128+gptq"),), **kw))
    finally:
        env.undo()
    return auto, cuda, trt


def test_the_build_records_its_choice_and_the_runtime_reads_it(built, tmp_path):
    from safetensors import safe_open

    from backend.devices import load_runtime
    from backend.devices.cuda import Fp8Record
    from backend.manifest import EngineManifest

    auto = built[0]
    record = Fp8Record.of(auto.engines["fp8"])
    chosen, report = fp8.Recipe.from_json(record.recipe), record.choice
    assert report["chosen_by"] == "measured" and report["positions"] > 0 and report["measured"]
    mine = next(t for t in report["measured"] if t["recipe"] == chosen.label)       # its numbers are there
    assert report["meets_bar"] == mine["meets_bar"] and mine["top1_agreement"] > 0
    assert auto.engines["fp32"].record is None and Fp8Record.of(auto.engines["fp32"]) == Fp8Record()
    with safe_open(str(auto.resolve(auto.engine("fp8").path)), "pt") as f:
        assert fp8.Recipe.from_json(json.loads(f.metadata()["fp8_recipe"])) == chosen
    rt = load_runtime(auto, "fp8")
    assert rt.model.fp8_recipe == chosen
    rt.close()
    old = json.loads((auto.root / "manifest.json").read_text())          # version 3, written before recipes
    old["version"] = 3
    for e in old["engines"].values():
        e.pop("record")
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    assert Fp8Record.of(EngineManifest.load(tmp_path).engines["fp8"]) == Fp8Record()


def test_an_engine_file_of_before_recipes_still_loads(built, tmp_path):
    """Per-part `<name>.scale` [N] weight scales, a static input scale, no metadata: the legacy
    recipe, the same logits as the file written today with that recipe."""
    from safetensors.torch import load_file, save_file

    from backend.buildlib import calibration, fp8 as fp8_math
    from backend.devices.cuda import export as torch_engine
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.manifest import WeightFormat
    from backend.runtime.torch_rt import TorchRuntime

    m = built[0]
    ck = load_checkpoint(m.source)
    act = calibration.calibrate(ck, [list(range(3, 40))], 64)
    new = torch_engine.export(ck, WeightFormat.FP8, 2, tmp_path, "new", act, fp8.LEGACY)
    t = load_file(str(tmp_path / new.path))
    legacy = {k: v for k, v in t.items() if not k.endswith(".w_scale")}
    for i in range(2):
        for key, names in fp8_math.FUSED.items():
            rows = [t[f"layers.{i}.{n}"].shape[0] for n in names]
            legacy.update({f"layers.{i}.{n}.scale": s.reshape(-1) for n, s in
                           zip(names, t[f"layers.{i}.{key}.w_scale"].split(rows))})
    save_file(legacy, str(tmp_path / "old.safetensors"))
    ids = np.arange(3, 30)
    out = []
    for name in ("new", "old"):
        rt = TorchRuntime(tmp_path / f"{name}.safetensors", ck.config, 2, 64, device="cpu")
        rt.alloc(0)
        out.append(rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None]).logits)
    assert np.array_equal(out[0], out[1])


def test_the_torch_runtime_and_the_engine_graph_hold_the_same_fp8(built):
    """block128 with GPTQ rounding on both devices: the same float8 bits (not nearest rounding's) and scales (q's multiplier folded into the
    graph's scales), blocked DequantizeLinear, per-group input quantization in the graph, and
    logits that agree (the graph keeps embedding, norms and LM head in float32, the torch file
    in bf16)."""
    import onnx
    from onnx import numpy_helper
    from safetensors.torch import load_file

    from backend.buildlib.checkpoint import load_checkpoint
    from backend.buildlib.fp8 import FUSED
    from backend.devices import load_runtime

    from backend.devices.cuda import Fp8Record

    _, cuda, trt = built
    assert Fp8Record.of(cuda.engines["fp8"]).recipe == Fp8Record.of(trt.engines["fp8"]).recipe == \
        fp8.recipe("block128+gptq").to_json()
    t = load_file(str(cuda.resolve(cuda.engine("fp8").path)))
    g = onnx.load(str(trt.resolve(trt.engine("fp8").path)))
    init = {i.name: i for i in g.graph.initializer}
    cfg = cuda.model
    nq = cfg.num_heads * cfg.head_dim
    ck = load_checkpoint(cuda.source)
    moved = 0
    for i in range(cfg.num_layers):
        for key, parts in FUSED.items():
            w8 = torch.cat([t[f"layers.{i}.{n}"] for n in parts]).view(torch.uint8).numpy()
            w = torch.cat([torch.from_numpy(np.array(ck.tensors[f"layers.{i}.{n}"].float32())) for n in parts])
            moved += int((fp8.quantize_weight(w, fp8.recipe("block128"))[0].view(torch.uint8).numpy() != w8).sum())
            raw = init[f"l{i}.{key}.wT_fp8"]
            assert np.array_equal(np.frombuffer(raw.raw_data, np.uint8).reshape(raw.dims).T, w8), (i, key)
            s = numpy_helper.to_array(init[f"l{i}.{key}.w_scale"])              # [ceil(K/128), N]
            want = t[f"layers.{i}.{key}.w_scale"].repeat_interleave(128, 0)[: w8.shape[0]].T.numpy().copy()
            if key == "qkv":
                want[:, :nq] *= cfg.scale
            assert np.allclose(s, want, rtol=1e-7, atol=0), (i, key)
    assert moved > 0                              # GPTQ's codes, not rounding to nearest's
    ops = [n.op_type for n in g.graph.node]
    blocked = [n for n in g.graph.node if n.op_type == "DequantizeLinear" and
               any(a.name == "block_size" and a.i == 128 for a in n.attribute)]
    assert len(blocked) == 4 * cfg.num_layers and "QuantizeLinear" not in ops
    casts = [n for n in g.graph.node if n.op_type == "Cast" and
             any(a.name == "to" and a.i == onnx.TensorProto.FLOAT8E4M3FN for a in n.attribute)]
    assert len(casts) == 4 * cfg.num_layers
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 29)
    logits = {}
    env = device_env("tensorrt")
    try:
        for name, m in (("cuda", cuda), ("trt", trt)):
            for fmt in ("fp32", "fp8"):
                rt = load_runtime(m, fmt)
                rt.alloc(0)
                logits[name, fmt] = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None]).logits[0]
                rt.close()
    finally:
        env.undo()
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
    assert rel(logits["cuda", "fp32"], logits["trt", "fp32"]) < 1e-4
    assert rel(logits["cuda", "fp8"], logits["trt", "fp8"]) < 0.05
    assert rel(logits["trt", "fp8"], logits["trt", "fp32"]) < 0.1


def test_calibration_prompts_of_a_base_model_are_plain_text():
    """A model without a chat template (Gemma-3-270M) is calibrated on the prompts' text with its
    special tokens, as its benchmark prompts are made (it used to fail the FP8 build)."""
    from backend.buildlib.calibration import calibration_prompts

    class Plain:
        chat_template = None

        def encode(self, text, add_special_tokens):
            return [2] * add_special_tokens + [ord(c) for c in text]

    prompts = calibration_prompts(Plain(), n=3, max_tokens=50)
    assert len(prompts) == 3 and all(p[0] == 2 and 1 < len(p) <= 50 for p in prompts)


def test_the_fp8_build_records_its_w8a8_width_and_the_runtime_reads_it(built, tmp_path, monkeypatch):
    """Built without a GPU: the width is not measured (null, and why) in the manifest and the
    file, and the runtime runs W8A16 at every width. Measured (here on the CPU, the scaled GEMM
    forced): the width the measurement chose goes into the file and the runtime uses it; a file
    naming a decode or verify width is refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from backend.buildlib.checkpoint import load_checkpoint
    from backend.devices import load_runtime
    from backend.devices.cuda import Fp8Record, export as torch_engine
    from backend.manifest import WeightFormat
    from backend.runtime import torch_model as TM
    from backend.runtime.torch_rt import TorchRuntime

    auto = built[0]
    w = Fp8Record.of(auto.engines["fp8"]).w8a8
    assert w["w8a8_from"] is None and "without a GPU" in w["reason"]
    with safe_open(str(auto.resolve(auto.engine("fp8").path)), "pt") as f:
        assert json.loads(f.metadata()["w8a8_from"]) is None
    rt = load_runtime(auto, "fp8")
    assert rt.model.w8a8_from is None
    rt.close()

    monkeypatch.setattr(TM, "hardware_fp8", lambda device, rec=None: True)
    monkeypatch.setattr(TM.Linear, "_scaled_mm", lambda lin, x: TM.linear_rows(
        fp8.fake_quant_input(x.float(), lin.recipe, lin.act_scale), fp8.dequantize_weight(*lin.wq, lin.recipe),
        None, False).to(x.dtype))
    ck = load_checkpoint(auto.source)
    rec = fp8.recipe("channel-token")
    measured = []

    def width(tensors):
        from backend.devices.cuda import w8a8
        measured.append(w8a8.for_build(ck, tensors, rec, 2, 64, lambda m: None, device="cpu"))
        return {**measured[-1], "w8a8_from": 64}          # whatever it measured, the file says 64
    ef = torch_engine.export(ck, WeightFormat.FP8, 2, tmp_path, "w", None, rec, width)
    assert [m["width"] for m in measured[0]["measured"]] == [33, 64]
    assert Fp8Record.of(ef).w8a8["w8a8_from"] == 64
    assert TorchRuntime(tmp_path / ef.path, ck.config, 2, 64, device="cpu").model.w8a8_from == 64
    t = load_file(str(tmp_path / ef.path))
    with safe_open(str(tmp_path / ef.path), "pt") as f:
        meta = f.metadata()
    save_file(t, str(tmp_path / "bad.safetensors"), metadata={**meta, "w8a8_from": "16"})
    with pytest.raises(ValueError, match="w8a8_from 16 is a decode or verify width"):
        TorchRuntime(tmp_path / "bad.safetensors", ck.config, 2, 64, device="cpu")
