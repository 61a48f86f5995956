"""The native CPU engine (`--weights gguf`: our C decode step over the GGUF's own blocks): the
kernel against its numpy reference, row invariance by construction, a tiny build's logits
against transformers, batch invariance measured by the build, and the losslessness tests every
runtime passes (greedy identity for each drafter, seeded sampling equal to plain sampling)."""
from pathlib import Path

import numpy as np
import pytest

from backend.manifest import Device, WeightFormat
from conftest import assert_greedy_identity, assert_seeded_sampling_matches_plain, chain, spec_decoder, tiny_with_head

native = pytest.importorskip("backend.runtime.native")


def _random_blocks(kind, n, k, rng):
    d = (rng.uniform(0.002, 0.02, (n, k // 32))).astype(np.float16).view(np.uint16)
    if kind == "q4":
        m = (-8 * rng.uniform(0.002, 0.02, (n, k // 32))).astype(np.float16).view(np.uint16)
        return d, m, rng.integers(0, 16, (n, k)).astype(np.uint8)
    return d, None, rng.integers(-128, 128, (n, k)).astype(np.int8)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_blocked_matmul_matches_reference_and_rows_are_independent(kind):
    from backend.build.native_engine import repack
    from plugins.reference import blocked_matmul_ref

    rng = np.random.default_rng(1)
    n, k = 44, 96                                     # 44: the last group of 16 is padding
    d, m, ints = _random_blocks(kind, n, k, rng)
    data = repack(kind, d, m, ints)
    x = rng.standard_normal((9, k)).astype(np.float32)
    x[3, :32] = 0.0                                   # an all-zero block: scale 0
    y = native.blocked_matmul(kind, data, data.shape[0] * 16, k, x, threads=2)[:, :n]
    ref = blocked_matmul_ref(kind, d.view(np.float16), None if m is None else m.view(np.float16), ints, x)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(y - ref).max()
    # a row's bits do not depend on the other rows, their number, or the thread count
    for r in (0, 4, 8):
        alone = native.blocked_matmul(kind, data, data.shape[0] * 16, k, x[r:r + 1], threads=1)[0, :n]
        assert np.array_equal(alone, y[r])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_with_head(tmp_path_factory.mktemp("tiny_native"), Device.CPU, (WeightFormat.GGUF, WeightFormat.FP32))


def test_build_logits_and_invariance(tiny):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from backend.runtime import load_runtime

    m, ckpt, repo = tiny
    ef = m.engine("gguf")
    assert ef.batch_invariant is True and m.default_format is WeightFormat.GGUF
    assert ef.weight_bytes_per_token < m.engine("fp32").weight_bytes_per_token / 3     # 8-bit blocks
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, m.model.vocab_size, 29)
    with torch.no_grad():
        ref = hf(torch.tensor([ids.tolist()])).logits[0].numpy()
    rt = load_runtime(m, "gguf")
    rt.alloc(0)
    out = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None])
    # float weights become Q8_0 blocks and activations int8 blocks: close, not equal
    assert np.abs(out.logits[0] - ref).max() / np.abs(ref).max() < 0.05
    assert (out.logits[0].argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    rt.close()


@pytest.mark.parametrize("kind", ["prompt-lookup", "draft-model", "eagle", "lookup+eagle"])
def test_greedy_speculation_is_identical_to_plain(tiny, kind):
    assert_greedy_identity(spec_decoder(tiny[0], "gguf", num_draft_tokens=4), kind)


def test_seeded_sampling_matches_plain(tiny):
    assert_seeded_sampling_matches_plain(spec_decoder(tiny[0], "gguf", num_draft_tokens=3))


def test_ragged_rows_match_rows_alone_and_padding_is_not_computed(tiny):
    """Rows of one forward with different node counts (PAD_PARENT padding after a row's nodes):
    every real node's logits and features are bitwise those of its row run alone; padding nodes
    read zero (they are skipped, not computed)."""
    from backend.kv_cache import PAD_PARENT
    from backend.runtime import load_runtime

    m = tiny[0]
    rt = load_runtime(m, "gguf")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, m.model.vocab_size, n) for n in (19, 7)]
    new = rng.integers(3, m.model.vocab_size, (2, 4))
    parents = np.array([[-1, 0, 1, 1], [-1, 0, PAD_PARENT, PAD_PARENT]], np.int32)   # a tree; a chain of 2
    alone = []
    for sid, (p, ids, par) in enumerate(zip(prompts, new, parents)):
        rt.alloc(sid)
        rt.forward([sid], p[None], chain(p.size), np.array([[p.size - 1]]))
        rt.commit([sid], [np.arange(p.size)])
        n = int((par != PAD_PARENT).sum())
        out = rt.forward([sid], ids[None, :n], par[None, :n], np.arange(n)[None])
        alone.append((out.logits[0].copy(), out.hidden[0].copy()))
        rt.commit([sid], [np.zeros(0, np.int64)])
    out = rt.forward([0, 1], new, parents, np.broadcast_to(np.arange(4), (2, 4)).copy())
    for r, (logits, hidden) in enumerate(alone):
        n = logits.shape[0]
        assert np.array_equal(out.logits[r, :n], logits) and np.array_equal(out.hidden[r, :n], hidden), r
    assert not out.logits[1, 2:].any() and not out.hidden[1, 2:].any()
    rt.close()


def test_eagle_head_on_the_native_kernel_agrees_with_its_onnx_export(tiny, tmp_path):
    """With gguf serving, the build puts the EAGLE head on the native kernel too (Q8_0 blocks,
    int8 activations): its draft-vocabulary argmax agrees with the float ONNX head's."""
    from dataclasses import replace

    from backend.build.checkpoint import load_checkpoint
    from backend.drafters.eagle_export import export_eagle_head
    from backend.runtime import load_runtime
    from backend.runtime.ort import OrtRuntime

    m, ckpt, _ = tiny
    d = m.drafts["eagle"]
    assert d.extra["weights"] == "gguf" and d.path.endswith(".bin")
    path, _ = export_eagle_head(Path(d.source), load_checkpoint(ckpt), tmp_path, m.max_seq_len)
    cfg = replace(m.model, vocab_size=int(d.extra["draft_vocab_size"]), num_layers=1)
    rng = np.random.default_rng(2)
    t = 17
    toks = rng.integers(3, m.model.vocab_size, (1, t))
    feats = rng.standard_normal((1, t, m.model.hidden_size)).astype(np.float32)
    outs = []
    for rt in (load_runtime(m, engine="eagle"), OrtRuntime(path, cfg, 1, m.max_seq_len)):
        rt.alloc(0)
        outs.append(rt.forward([0], toks, chain(t), np.arange(t)[None], {"features": feats}).logits[0].copy())
        rt.close()
    native, onnx = outs
    assert (native.argmax(-1) == onnx.argmax(-1)).mean() >= 0.8
    assert np.abs(native - onnx).max() <= 0.1 * np.abs(onnx).max()
