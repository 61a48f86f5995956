"""The TensorRT path on a CPU (issue 13): `--device tensorrt` builds the engine graph (attention
and verification as specdec:: plugin nodes; FP8 as float8 Q/DQ) for the target and every draft
and, without TensorRT and a GPU, stops at the engine-ready ONNX and says what is missing; the
engine runtime (one execution per step, verification inside the graph) runs it on ONNX
Runtime's CPU provider with the plugins' references and passes the losslessness tests of the
other runtimes; a repository not built for this GPU and TensorRT refuses to load naming the
rebuild command; the plugins register with TensorRT's own plugin API, and their AOT
implementation returns the kernels' PTX."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime_extensions")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from backend.devices.cuda import Fp8Options, Fp8Record  # noqa: E402
from backend.builder.pipeline import BuildConfig, build  # noqa: E402
from backend.manifest import Device, EngineManifest, WeightFormat  # noqa: E402
from conftest import (assert_seeded_sampling_matches_plain, assert_serves_like_offline,  # noqa: E402
                      assert_spec_is_plain, chain, device_env, make_tiny_checkpoint,
                      spec_decoder, tiny_with_head)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    mp = device_env("tensorrt")                        # the engine graph on ONNX Runtime (references)
    yield tiny_with_head(tmp_path_factory.mktemp("tiny_trt"), Device.TENSORRT, (WeightFormat.FP32, WeightFormat.FP8))
    mp.undo()


def test_without_tensorrt_the_build_writes_engine_ready_onnx_and_says_what_is_missing(tmp_path, capsys):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=1)
    m = build(BuildConfig(target=str(ckpt), output=tmp_path / "repo", device=Device.TENSORRT,
                          weights=(WeightFormat.FP8,), drafts=("self:1",), options=(Fp8Options("channel-tensor"),)))
    err = capsys.readouterr().err
    missing = [line for line in err.splitlines() if "no TensorRT engine built" in line]
    assert len(missing) == 1 and ("not installed" in missing[0] or "without the builder" in missing[0]), err
    assert m.device is Device.TENSORRT and m.gpu is None and m.cost_model is None
    assert not list(m.root.glob("*.plan")) and (m.root / "target_fp8.onnx").exists()
    draft = onnx.load(str(m.resolve(m.drafts["self1"].path)))           # FP8 like the target, no tail
    assert "rejection_sample" not in {n.op_type for n in draft.graph.node}
    assert sum(n.op_type == "QuantizeLinear" for n in draft.graph.node) == 4


def test_the_fp8_engine_graph_has_float8_qdq_and_plugin_nodes(tiny):
    m, _, _ = tiny
    model = onnx.load(str(m.resolve(m.engine("fp8").path)))
    assert {o.domain: o.version for o in model.opset_import}[""] >= 19
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    layers = m.model.num_layers
    assert ops.count(("specdec", "tree_attention")) == layers and ops.count(("specdec", "rejection_sample")) == 1
    recipe = Fp8Record.of(m.engines["fp8"]).recipe                    # the build's choice (runtime/fp8.py)
    quantized = 4 * layers - len(recipe["weight_only"])                # qkv, o, gate_up, down inputs
    if recipe["inputs"] == "tensor":
        assert ops.count(("", "QuantizeLinear")) == quantized
    else:
        to_fp8 = lambda n: any(a.name == "to" and a.i == onnx.TensorProto.FLOAT8E4M3FN for a in n.attribute)
        assert sum(n.op_type == "Cast" and to_fp8(n) for n in model.graph.node) == quantized
    fp8 = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN and i.dims]
    assert len(fp8) == 4 * layers
    scales = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    if recipe["weight_block"] == [1, 0]:
        assert scales["l0.qkv.w_scale"].shape == (scales["l0.qkv.w_scale"].size,)
    if recipe["inputs"] == "tensor":
        assert scales["l0.qkv.act_scale"].shape == ()
    attn = next(n for n in model.graph.node if n.op_type == "tree_attention")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in attn.attribute}["plugin_namespace"] == b"specdec"


def test_engine_runtime_logits_and_invariance(tiny):
    from backend.devices import load_runtime

    m, ckpt, _ = tiny
    assert m.engines["fp32"].batch_invariant and m.cost_model is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, m.model.vocab_size, 29)
    with torch.no_grad():
        ref = hf(torch.tensor([ids.tolist()])).logits[0].numpy()
    for fmt, tol in (("fp32", 1e-4), ("fp8", 0.15)):
        rt = load_runtime(m, fmt)
        rt.alloc(0)
        out = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None])
        assert np.abs(out.logits[0] - ref).max() / np.abs(ref).max() < tol, fmt
        rt.close()


def decoder(m, **spec):
    return spec_decoder(m, "fp32", **spec)


@pytest.mark.parametrize("kind", ["prompt-lookup", "draft-model", "eagle", "lookup+eagle"])
def test_greedy_speculation_is_identical_to_plain_with_verification_in_the_graph(tiny, kind, monkeypatch, plain_tokens):
    from backend.runtime import engine_rt

    monkeypatch.setattr(engine_rt, "verify_on_host", lambda *a: pytest.fail("verified on the host"))
    assert_spec_is_plain(plain_tokens, tiny[0], "fp32", kind, num_draft_tokens=4)


def test_seeded_sampling_equals_plain_sampling_in_a_batch(tiny):
    assert_seeded_sampling_matches_plain(decoder(tiny[0], num_draft_tokens=3))


def test_a_repository_not_built_for_this_gpu_and_tensorrt_refuses_to_load(tiny, tmp_path, monkeypatch, capsys):
    from backend.devices import load_runtime

    m, _, _ = tiny
    monkeypatch.setenv("SPECDEC_EXECUTOR", "auto")
    with pytest.raises(RuntimeError, match="engine-ready ONNX only .*build_engines.py --device tensorrt"):
        load_runtime(m)
    from backend.cli import main

    assert main(["serve", "--model-repository", str(m.root.parents[1])]) == 2      # before tritonserver starts
    assert "engine-ready ONNX only" in capsys.readouterr().out
    other = json.loads((m.root / "manifest.json").read_text())
    other["gpu"] = {"name": "NVIDIA H200", "compute_capability": "9.0", "tensorrt": "10.13.0"}
    (tmp_path / "manifest.json").write_text(json.dumps(other))
    with pytest.raises(RuntimeError, match="need TensorRT 10.13.0|no CUDA device|rebuild with"):
        load_runtime(EngineManifest.load(tmp_path))


def test_quality_of_the_fp8_engine_graph(tiny):
    from backend.bench import quality

    m, _, _ = tiny
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "the quick brown fox"}]}]
    r = quality.run(str(m.root), "fp8", "fp32", prompts, 12, None)
    assert 0.0 <= r["top1_agreement"] <= 1.0 and r["kl_mean"] > 0 and r["prompts"][0]["positions"] == 12


def _tensorrt_plugin_api() -> str | None:
    for mod in ("tensorrt", "tensorrt_lean"):
        try:
            __import__(mod)
            return mod
        except ImportError:
            continue
    return None


@pytest.mark.skipif(_tensorrt_plugin_api() is None,
                    reason="TensorRT's plugin API is not installed (tensorrt, or tensorrt-lean-cu12 of the dev extra)")
def test_the_plugins_register_with_tensorrt_and_return_ptx():
    """In a subprocess (tests/trt_lean.py may stand in for `tensorrt`): TensorRT validates both
    plugin definitions, lists their creators, creates AOT plugins and infers their output
    types; each aot_impl returns its kernel's PTX for sm_90 and three scalar arguments; the
    ONNX node's attributes are the creator's fields."""
    script = r'''
import json, os, sys
sys.path.insert(0, "tests")
import trt_lean
which = trt_lean.load()
import numpy as np
import tensorrt as trt
import tensorrt.plugin as trtp
from plugins import trt_plugins
reg = trt.get_plugin_registry()
keep = []
def fields(values):
    out = []
    for name, v in values:
        a = np.array([v], np.float64 if isinstance(v, float) else np.int64)
        keep.append(a)
        out.append(trt.PluginField(name, a, trt.PluginFieldType.FLOAT64 if isinstance(v, float) else trt.PluginFieldType.INT64))
    return trt.PluginFieldCollection(out)
F, I32, I64 = trt.DataType.FLOAT, trt.DataType.INT32, trt.DataType.INT64
res = {"which": which, "registered": trt_plugins.registered()}
ca = reg.get_creator("tree_attention", "1", "specdec")
res["fields"] = [f.name for f in ca.field_names]
pa = ca.create_plugin("tree_attention", "specdec", fields([("scale", 1.0), ("num_heads", 4), ("num_kv_heads", 2), ("head_dim", 16), ("window", 0), ("softcap", 0.0)]),
                      trt.TensorRTPhase.BUILD, trt.QuickPluginCreationRequest.STRICT_AOT)
res["attn"] = [type(pa).__name__, [str(x) for x in pa.get_output_data_types([F] * 5 + [I32] * 4, [4, 4, 4, 4, 4, 1, 1, 1, 3])]]
cv = reg.get_creator("rejection_sample", "1", "specdec")
pv = cv.create_plugin("rejection_sample", "specdec", fields([]), trt.TensorRTPhase.BUILD, trt.QuickPluginCreationRequest.STRICT_AOT)
res["verify"] = [type(pv).__name__, [str(x) for x in pv.get_output_data_types([F, I64, I32, F, I32, F, F, I64, I64], [3, 2, 2, 1, 1, 1, 1, 1, 1])]]
os.environ["SPECDEC_TRT_ARCH"] = "90"
d = lambda shape, dt: trtp.from_shape_expr(tuple(shape), dt)
B, T, HQ, HKV, D, S, L, P, V = 2, 5, 4, 2, 16, 3, 80, 5, 96
q = d((B, T, HQ, D), trt.float32)
ins = [q, d((B, T, HKV, D), trt.float32), d((B, T, HKV, D), trt.float32), d((S, HKV, L, D), trt.float32),
       d((S, HKV, L, D), trt.float32)] + [d((B,), trt.int32)] * 3 + [d((B, T, P), trt.int32)]
name, ptx, launch, extra = trt_plugins.tree_attention_aot(*ins, 1.0, HQ, HKV, D, 0, 0.0, (q,), 0)
res["attn_aot"] = [name, ".entry " + name in ptx, ".target sm_90" in ptx, len(extra)]
vin = [d((B, T, V), trt.float32), d((B, T), trt.int64), d((B, T), trt.int32), d((B,), trt.float32), d((B,), trt.int32),
       d((B,), trt.float32), d((B,), trt.float32), d((B,), trt.int64), d((B,), trt.int64)]
name, ptx, launch, extra = trt_plugins.rejection_sample_aot(*vin, (vin[2], vin[1], vin[4]), 0)
res["verify_aot"] = [name, ".entry " + name in ptx, ".target sm_90" in ptx, len(extra)]
print("RESULT " + json.dumps(res))
'''
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(line[7:])
    assert res["registered"] == [["rejection_sample", "1", "specdec"], ["tree_attention", "1", "specdec"]]
    assert res["attn"] == ["_TemplateAOTPlugin", ["DataType.FLOAT"]]
    assert res["verify"] == ["_TemplateAOTPlugin", ["DataType.INT32", "DataType.INT64", "DataType.INT32"]]
    assert res["attn_aot"] == ["tree_attention_plugin_kernel", True, True, 3]
    assert res["verify_aot"] == ["verify_plugin_kernel", True, True, 3]
    from backend.buildlib.engine_graph import PLUGIN_ATTRS
    from backend.buildlib.graph import GraphSpec, build_decoder
    from backend.bench import engine_check

    ck = engine_check.random_checkpoint()
    model = build_decoder(ck, GraphSpec(WeightFormat.FP32, ck.config.num_layers, 64, plugins=True))
    attn = next(n for n in model.graph.node if n.op_type == "tree_attention")
    assert {a.name for a in attn.attribute} - set(PLUGIN_ATTRS) == set(res["fields"])


@pytest.mark.slow
def test_the_tensorrt_repository_serves_on_tritonserver(tiny, tmp_path):
    """The same Triton models run the engine runtime (here on the reference executor): a stream
    through `specdec` and one through the ensemble equal offline decoding of the repository."""
    pytest.importorskip("tritonclient.grpc")
    m, _, repo = tiny
    assert_serves_like_offline(m, repo, tmp_path, env={"SPECDEC_EXECUTOR": "onnxruntime"})


def test_fp8_drafts_get_the_same_treatment(tiny, tmp_path):
    """In an FP8 build every draft engine has FP8 Q/DQ on its layer's linear inputs: the
    self-draft with the target's scales, the EAGLE head calibrated on the target's features."""
    m, ckpt, _ = tiny
    head = m.drafts["eagle"].source
    m8 = build(BuildConfig(target=str(ckpt), output=tmp_path / "repo", device=Device.TENSORRT, quiet=True,
                           weights=(WeightFormat.FP8,), drafts=("self:1", f"eagle:{head}"),
                           measure_costs=False, check_invariance=False, options=(Fp8Options("channel-tensor"),)))
    scales = {}
    for name in ("self1", "eagle"):
        model = onnx.load(str(m8.resolve(m8.drafts[name].path)))
        assert sum(n.op_type == "QuantizeLinear" for n in model.graph.node) == 4, name
        scales[name] = {i.name: float(onnx.numpy_helper.to_array(i)) for i in model.graph.initializer
                        if i.name.endswith(".act_scale")}
    target = onnx.load(str(m8.resolve(m8.engine("fp8").path)))
    target_scales = {i.name: float(onnx.numpy_helper.to_array(i)) for i in target.graph.initializer
                     if i.name.startswith("l0.") and i.name.endswith(".act_scale")}
    assert scales["self1"] == target_scales and all(v > 0 for v in scales["eagle"].values())
    assert scales["eagle"] != target_scales
