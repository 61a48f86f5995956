"""Checkpoints the tests make themselves: tiny random HF directories (Llama with tied embeddings,
Qwen2 with random q/k/v biases) go through load, build (fp32 + 4-bit) and a forward that matches
transformers; GGUF block decoding matches the gguf package; clear errors for what we refuse."""
import json

import numpy as np
import pytest

from backend.buildlib import quant
from backend.buildlib.checkpoint import CheckpointError, load_checkpoint
from backend.builder.pipeline import ENGINE_SUBDIR, BuildConfig, build
from backend.manifest import WeightFormat
from backend.devices import load_runtime
from conftest import chain, make_tiny_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_hf_checkpoint_build_and_forward(tmp_path, arch):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", arch)
    m = build(BuildConfig(target=str(ckpt), output=tmp_path / "repo", quiet=True, measure_costs=False))
    assert m.model.architecture == arch and m.model.attention_bias == (arch == "qwen2")
    assert m.engine("fp32").batch_invariant and m.engine("q4").batch_invariant
    assert (tmp_path / "repo" / "specdec" / "config.pbtxt").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, m.model.vocab_size, 23)
    with torch.no_grad():
        ref = hf(torch.tensor([ids.tolist()])).logits[0].numpy()
    # weights read per token, stated in the manifest: fp32 is every parameter but the embedding
    # table (its tied LM head included) in 4 bytes; q4 is less; the source is its own tensors
    ck = load_checkpoint(str(ckpt))
    params = sum(int(np.prod(t.raw.shape)) for k, t in ck.tensors.items() if k != "embed")
    params += 0 if "lm_head" in ck.tensors else int(np.prod(ck.tensors["embed"].raw.shape))
    fp32 = m.engine("fp32").weight_bytes_per_token
    assert 4 * params <= fp32 <= 4 * params * 1.01 + 4096, (fp32, 4 * params)
    assert m.engine("q4").weight_bytes_per_token < 0.5 * fp32
    tied = "lm_head" not in ck.tensors          # an untied embedding is read one row per token
    assert m.source_bytes_per_token == sum(t.raw.nbytes for k, t in ck.tensors.items() if k != "embed" or tied)
    # q4 within its 4-bit rounding: conftest's Qwen2 has the architecture tests' wider weights
    # (init 0.08, random norms and biases), where 4-bit rows move the logits more (0.13-0.18 over
    # seeds 0-2; Mistral's alike 0.20-0.38) than the Llama's 0.02 init does (0.05-0.06)
    for fmt, tol in (("fp32", 1e-4), ("q4", {"llama": 0.15, "qwen2": 0.25}[arch])):
        rt = load_runtime(m, fmt)
        rt.alloc(0)
        out = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None])
        err = np.abs(out.logits[0] - ref).max() / np.abs(ref).max()
        assert err < tol, (fmt, err)
        rt.close()


def test_manifest_and_templates_are_complete(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    build(BuildConfig(target=str(ckpt), output=tmp_path / "repo", quiet=True, measure_costs=False,
                      weights=(WeightFormat.FP32,)))
    man = json.loads((tmp_path / "repo" / ENGINE_SUBDIR / "manifest.json").read_text())
    for key in ("model", "engines", "default_format", "device", "max_seq_len", "tokenizer_path",
                "chat_template", "tool_versions"):
        assert key in man, key
    assert man["tool_versions"]["onnxruntime"] and man["device"] == "cpu"
    for cfg in (tmp_path / "repo").glob("*/config.pbtxt"):
        assert "${" not in cfg.read_text(), cfg


def test_unfilled_template_fails(tmp_path):
    from backend.builder.templates import TemplateError, fill

    with pytest.raises(TemplateError, match="nope"):
        fill("a ${nope} b", {"x": 1}, "t")


def _random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    nbytes, nel = quant._BLOCK[qtype]
    raw = rng.integers(0, 256, (rows, cols // nel, nbytes), dtype=np.uint8)
    f16 = lambda shape: rng.uniform(0.001, 0.05, shape).astype(np.float16).view(np.uint8)
    if qtype in ("Q4_0", "Q8_0"):
        raw[..., 0:2] = f16((rows, cols // nel, 1)).reshape(rows, cols // nel, 2)
    elif qtype == "Q4_1":
        raw[..., 0:4] = f16((rows, cols // nel, 2)).reshape(rows, cols // nel, 4)
    elif qtype == "Q4_K":
        raw[..., 0:4] = f16((rows, cols // nel, 2)).reshape(rows, cols // nel, 4)
    elif qtype == "Q6_K":
        raw[..., 208:210] = f16((rows, cols // nel, 1)).reshape(rows, cols // nel, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_block_decoding_matches_gguf(qtype):
    import gguf

    raw = _random_blocks(qtype, 8, 512, np.random.default_rng(1))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    ours = quant.decode_blocks(qtype, raw).dequantize()
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_matmul_nbits_repack_is_exact(tmp_path):
    """One MatMulNBits node (+ offset correction) reproduces x @ W.T of Q4_1 weights."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from backend.buildlib import graph
    from backend.runtime.ort import default_threads, session_options

    raw = _random_blocks("Q4_1", 64, 256, np.random.default_rng(2))
    blocks = quant.decode_blocks("Q4_1", raw)
    g = graph._Builder()
    y = graph._Linear(g, WeightFormat.Q4)("x", "w", blocks)
    g.op("Identity", [y], outputs=["y"])
    model = helper.make_model(helper.make_graph(
        g.nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 64])], g.inits),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    x = np.random.default_rng(3).standard_normal((1, 4, 256)).astype(np.float32)
    so = session_options(default_threads(), spinning=False)    # the process may already share ORT's global pool
    out = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = x @ blocks.dequantize().T
    # accuracy_level 4 quantizes activations to int8 per block: relative error well under 1%
    assert np.abs(out - ref).max() / np.abs(ref).max() < 0.01


def test_unsupported_inputs_are_named(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "gpt_neox"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPTNeoXForCausalLM"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="Hugging Face checkpoint directory or a .gguf"):
        load_checkpoint(tmp_path / "nothing.bin")


def test_unsupported_gguf_quantization_is_named(tmp_path):
    import gguf

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_head_count(4)
    w.add_feed_forward_length(512)
    w.add_context_length(128)
    raw = np.zeros((256, 256 // 256 * 84), np.uint8)           # Q2_K: 84 bytes per 256 values
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="Q2_K"):
        load_checkpoint(path)
