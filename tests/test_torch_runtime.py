"""The GPU runtime (torch + the kernels' references on a CPU): `--device cuda` builds of a tiny
checkpoint in fp32, bf16 and FP8 give transformers' logits, are batch invariant, and pass the
losslessness tests of the ONNX runtime: greedy identity for every drafter (self-draft, EAGLE
head, prompt lookup, lookup+eagle), seeded sampling equal to plain sampling; sequences beyond
the KV slots wait for room; a repository built for another GPU refuses to load."""
import json

import numpy as np
import pytest

from backend.config import DrafterKind, SamplingParams
from backend.manifest import Device, EngineManifest, WeightFormat
from backend.sequence import Request
from conftest import (LOSSLESS_PROMPTS as PROMPTS, assert_seeded_sampling_matches_plain,  # noqa: E402
                      assert_serves_like_offline, assert_spec_is_plain, chain,
                      spec_decoder, tiny_with_head)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_with_head(tmp_path_factory.mktemp("tiny_cuda"), Device.CUDA,
                          (WeightFormat.FP32, WeightFormat.BF16, WeightFormat.FP8))


def test_build_logits_invariance_and_repository(tiny):
    from backend.devices import load_runtime
    from backend.devices.cuda import Fp8Record

    m, ckpt, repo = tiny
    assert m.device is Device.CUDA and m.gpu is None and m.cost_model is not None
    assert all(ef.batch_invariant for ef in m.engines.values()), {k: e.batch_invariant for k, e in m.engines.items()}
    assert "KIND_CPU" in (repo / "generator" / "config.pbtxt").read_text()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, m.model.vocab_size, 29)
    with torch.no_grad():
        ref = hf(torch.tensor([ids.tolist()])).logits[0].numpy()
    for fmt, tol in (("fp32", 1e-4), ("bf16", 2e-2), ("fp8", 0.15)):
        rt = load_runtime(m, fmt)
        rt.alloc(0)
        out = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None])
        assert np.abs(out.logits[0] - ref).max() / np.abs(ref).max() < tol, fmt
        rt.close()
    tensors = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(m.resolve(m.engine("fp8").path)))
    record = Fp8Record.of(m.engines["fp8"])
    static = record.recipe["inputs"] == "tensor"                             # the recipe the build chose
    assert tensors["layers.0.q"].dtype == torch.float8_e4m3fn and tensors["layers.0.qkv.w_scale"].dtype == torch.float32
    assert ("layers.0.qkv.act_scale" in tensors) == static and record.choice["measured"]


def decoder(m, **spec):
    return spec_decoder(m, "fp32", **spec)


@pytest.mark.parametrize("kind", ["prompt-lookup", "draft-model", "eagle", "lookup+eagle"])
def test_greedy_speculation_is_identical_to_plain(tiny, kind, plain_tokens):
    assert_spec_is_plain(plain_tokens, tiny[0], "fp32", kind, num_draft_tokens=4)


def test_seeded_sampling_equals_plain_sampling_in_a_batch(tiny):
    assert_seeded_sampling_matches_plain(decoder(tiny[0], num_draft_tokens=3))


def test_requests_beyond_the_kv_slots_wait_for_room(tiny):
    from backend.scheduler import Scheduler

    m, _, _ = tiny
    dec = decoder(m, num_draft_tokens=2)
    done, outs = [], {}

    class Sink:
        def __init__(self, i):
            self.i = i

        def send(self, out):
            outs.setdefault(self.i, []).extend(out.new_ids)

        def error(self, exc, internal):
            raise AssertionError(exc)

        def cancelled(self):
            return False

        def close(self):
            done.append(self.i)

    sched = Scheduler(dec, max_batch=8, start=False)
    for i in range(14):                              # 6 slots for 14 requests
        sched.submit(Request(tuple(PROMPTS[i % 3]), SamplingParams(max_tokens=12, ignore_eos=True),
                             DrafterKind.PROMPT_LOOKUP), Sink(i))
    while sched.has_work():
        sched.iterate()
        assert dec.target.room() >= 0 and sched.num_active() <= 6
    assert sorted(done) == list(range(14)) and all(len(outs[i]) == 12 for i in range(14))


def test_a_repository_built_for_another_gpu_refuses_to_load(tiny, tmp_path):
    from backend.devices import load_runtime

    m, _, _ = tiny
    other = json.loads((m.root / "manifest.json").read_text())
    other["gpu"] = {"name": "NVIDIA H200", "compute_capability": "9.0", "torch": "2.11", "triton": "3.6"}
    (tmp_path / "manifest.json").write_text(json.dumps(other))
    moved = EngineManifest.load(tmp_path)
    with pytest.raises(RuntimeError, match="built for NVIDIA H200 .* rebuild|no CUDA device"):
        load_runtime(moved)


def test_quality_reports_top1_agreement_and_kl(tiny, tmp_path):
    """`specdec quality`: a format against itself agrees everywhere with KL 0; FP8 (emulated
    here: the build's scales, quantize then dequantize) against fp32 reports both numbers."""
    from backend.bench import quality

    m, _, _ = tiny
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "the quick brown fox"}]},
               {"id": "b", "messages": [{"role": "user", "content": "def f(x): return x"}]}]
    same = quality.run(str(m.root), "fp32", "fp32", prompts, 12, None)
    assert same["top1_agreement"] == 1.0 and abs(same["kl_mean"]) < 1e-9
    fp8 = quality.run(str(m.root), "fp8", "fp32", prompts, 12, str(tmp_path / "q.json"))
    saved = json.loads((tmp_path / "q.json").read_text())
    assert saved["top1_agreement"] == fp8["top1_agreement"] and 0.0 <= fp8["top1_agreement"] <= 1.0
    assert fp8["kl_mean"] > 0 and [p["positions"] for p in saved["prompts"]] == [12, 12]


def test_check_kernels_lists_the_kernels_and_the_engine_graph_ok(tmp_path, monkeypatch):
    """`specdec check-kernels --quick` (the command's report), then the one case --quick leaves out
    that no other CPU test has: tree attention at Llama-8B's shape (32 query heads over 8, head_dim
    128, context 300). What else the full command adds are vocabularies of 4099 and 49152 for
    verify: the same loop over 1024-entry blocks as test_kernels' ragged 2500 (43 s of CPU here)."""
    from backend.bench import kernel_check
    from backend.cli import main

    assert main(["check-kernels", "--quick", "--json", str(tmp_path / "k.json")]) == 0
    report = json.loads((tmp_path / "k.json").read_text())
    assert report["quick"] and [k["name"] for k in report["kernels"]] == ["tree_attention", "verify", "engine_graph"]
    assert all(k["ok"] and k["cases"] > 0 for k in report["kernels"]) and report["kernels"][0]["bitwise_invariant"]
    assert report["kernels"][2]["max_abs_err"] <= 1e-4 and report["kernels"][2]["rejection_sample_equal"]
    assert report["kernels"][0]["plugin_kernel_equal"] and report["kernels"][1]["plugin_mismatched_rows"] == 0
    rng = np.random.default_rng(0)
    big = list(kernel_check._attention_cases(rng))[-1]
    assert big[0].shape[2:] == (32, 128) and big[1].shape[1] == 8 and int(big[4][0]) == 300
    monkeypatch.setattr(kernel_check, "_attention_cases", lambda rng: iter([big]))
    r = kernel_check.check_attention("cpu", rng)
    assert r["cases"] == 1 and r["ok"] and r["bitwise_invariant"] and r["plugin_kernel_equal"], r


@pytest.mark.slow
def test_the_torch_repository_serves_on_tritonserver(tiny, tmp_path):
    """The same Triton models run the torch runtime: one stream through `specdec` and one
    through the ensemble equal offline decoding of the built repository."""
    pytest.importorskip("tritonclient.grpc")
    m, _, repo = tiny
    assert_serves_like_offline(m, repo, tmp_path)
