"""Gemma-3's layer on every CPU runtime, from a tiny random-weight checkpoint made with
transformers' own classes (conftest.make_tiny_checkpoint "gemma3": a sliding window of 6, shorter
than the prompts; sliding and full layers with their own rope bases; q/k norms; norms after
attention and MLP; GeGLU; a scaled embedding; q's scale from query_pre_attn_scalar; random norm
weights, so the (1 + w) conversion matters).

The model description (manifest.ModelConfig) is what every engine reads; these tests hold each
engine to transformers: the ONNX fp32 graph within 1e-4 (prefill past the window, incremental
decode, every branch of a tree), the 4-bit and native engines within their quantization, and
every engine bitwise batch-invariant, with greedy speculation identical to plain decoding."""
from __future__ import annotations

import numpy as np
import pytest

from backend.buildlib.checkpoint import load_checkpoint
from backend.builder.pipeline import BuildConfig, build
from backend.devices import load_runtime
from backend.manifest import EngineManifest, ModelConfig, WeightFormat
from conftest import (assert_greedy_identity, decode_and_branch_errors, hf_logits, make_tiny_checkpoint,
                      prefill_logits, rel_err, spec_decoder)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WINDOW = 6


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    ckpt = make_tiny_checkpoint(d / "ckpt", "gemma3", layers=3)
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", quiet=True, measure_costs=False,
                          weights=(WeightFormat.FP32, WeightFormat.Q4, WeightFormat.GGUF), drafts=("self:1",)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return m, hf


def test_description_read_from_the_checkpoint(gemma):
    m, hf = gemma
    c = m.model
    assert (c.architecture, c.activation, c.qk_norm, c.post_norms) == ("gemma3", "gelu_tanh", True, True)
    assert c.sliding_window == WINDOW and c.layer_types == ("sliding", "full", "sliding")
    assert [c.window(i) for i in range(3)] == [WINDOW, 0, WINDOW]
    assert c.rope_local_theta == 10000.0 and c.rope_theta == 1e6 and c.local_rope(0) and not c.local_rope(1)
    assert c.embed_scale == pytest.approx(8.0) and c.scale == pytest.approx(24 ** -0.5)
    assert ModelConfig.from_json(c.to_json()) == c
    # the norms are stored plain: the checkpoint's (1 + w) became w + 1
    ck = load_checkpoint(m.source)
    w = hf.model.layers[0].self_attn.q_norm.weight.detach().numpy()
    np.testing.assert_allclose(ck.tensor("layers.0.q_norm").float32(), w + 1, rtol=1e-6)


@pytest.mark.parametrize("fmt,tol", [("fp32", 1e-4), ("q4", 0.6), ("gguf", 0.15)])
def test_prefill_past_the_window_matches_transformers(gemma, fmt, tol):
    m, hf = gemma
    ids = np.random.default_rng(1).integers(3, m.model.vocab_size, 4 * WINDOW + 3)
    rt = load_runtime(m, fmt)
    got = prefill_logits(rt, 1, ids)
    ref = hf_logits(hf, ids)
    assert rel_err(got, ref) < tol, (fmt, rel_err(got, ref))
    if fmt == "fp32":
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    rt.close()


@pytest.mark.parametrize("fmt", ["fp32", "gguf"])
def test_incremental_decode_and_tree_branches(gemma, fmt):
    """Decode steps past the window equal transformers' full forward; every branch of a tree
    verified in one forward equals that branch decoded alone (bitwise) and transformers (fp32 to
    1e-4): the window is counted along each node's own path."""
    m, hf = gemma
    rt = load_runtime(m, fmt)
    errs = decode_and_branch_errors(rt, hf, m.model.vocab_size, WINDOW)
    if fmt == "fp32":
        assert errs["decode"] < 1e-4 and errs["tree"] < 1e-4, errs
    else:
        assert all(same or err < 0.15 for err, same in errs["decode_steps"]), errs["decode_steps"]
    rt.close()


@pytest.mark.parametrize("fmt", ["fp32", "q4", "gguf"])
def test_greedy_speculation_is_plain(gemma, fmt):
    m, _ = gemma
    plain = None
    for kind in ("prompt-lookup", "draft-model"):         # the draft model: self:1, the first layer
        plain = assert_greedy_identity(spec_decoder(m, fmt, num_draft_tokens=4), kind, plain)


def test_manifest_round_trip(gemma):
    m, _ = gemma
    again = EngineManifest.load(m.root)
    assert again.model == m.model and again.engine("gguf").batch_invariant


def test_a_device_refuses_what_it_does_not_implement(tmp_path, monkeypatch):
    """Every engine implements Gemma-3's layer (the GPU devices: tests/test_gemma3_gpu_path.py) and
    the attention soft-cap (tests/test_attn_softcap.py). A backend that lacks a feature the model
    uses refuses the build before anything is written, naming what is missing (the CLI prints
    that line and exits 2: backend.errors.UserError): shown by taking q/k norms from cuda and
    tensorrt."""
    from backend.builder.pipeline import BuildError
    from backend.devices import BACKENDS
    from backend.manifest import Device

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "gemma3", layers=2)
    gemma = load_checkpoint(ckpt).config
    assert all(b.unsupported(gemma) == [] for b in BACKENDS), {b.name: b.unsupported(gemma) for b in BACKENDS}
    for b in BACKENDS:
        if b.device in (Device.CUDA, Device.TENSORRT):
            monkeypatch.setattr(b, "model_features", b.model_features - {"qk_norm"})
    for device in (Device.CUDA, Device.TENSORRT):
        with pytest.raises(BuildError, match=r"gemma3 on --device .* do not implement qk_norm"):
            build(BuildConfig(target=str(ckpt), output=tmp_path / device.value, device=device, quiet=True,
                              measure_costs=False))
        assert not (tmp_path / device.value / "specdec").exists()
