"""EAGLE-3 heads (issue 15, points 1-2): `--draft eagle:DIR` loads a head in the layout the
EAGLE-3 reference implementation publishes (config.json + model.safetensors, `midlayer.*` keys,
fc [H, 3H], its own LM head over a draft vocabulary mapped by `d2t`). The target engines then
output the residual stream entering the head's three layers, on every runtime: the ONNX graph
(ONNX Runtime, and the TensorRT engine graph on its reference executor), the native kernel and
the torch runtime. Proven against transformers' hidden states and a reference EAGLE-3 forward
written here from the paper's equations; speculation with the head is lossless. The heads are
tiny, random, written by the test."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from backend.builder.pipeline import BuildConfig, build  # noqa: E402
from backend.buildlib.heads.formats import HeadFormatError, feature_layers, read_head  # noqa: E402
from backend.manifest import Device, WeightFormat  # noqa: E402
from conftest import assert_greedy_identity, chain, device_env, make_tiny_checkpoint, spec_decoder  # noqa: E402

LAYERS = 6                      # the reference's default feature layers: (2, L/2, L-3) = (2, 3, 3)
DRAFT_VOCAB = 80


def eagle3_state(cfg: dict, vocab: int, seed: int) -> dict:
    """Random EAGLE-3 weights under the reference implementation's names."""
    g = torch.Generator().manual_seed(seed)
    h, i, nh, nkv = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                     cfg["num_key_value_heads"])
    d = h // nh
    r = lambda *s: torch.randn(*s, generator=g) / np.sqrt(s[-1])
    norm = lambda: 1 + 0.1 * torch.randn(h, generator=g)
    ids = torch.sort(torch.randperm(vocab, generator=g)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return {"fc.weight": r(h, 3 * h), "midlayer.input_layernorm.weight": norm(),
            "midlayer.hidden_norm.weight": norm(), "midlayer.post_attention_layernorm.weight": norm(),
            "midlayer.self_attn.q_proj.weight": r(nh * d, 2 * h), "midlayer.self_attn.k_proj.weight": r(nkv * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": r(nkv * d, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, nh * d),
            "midlayer.mlp.gate_proj.weight": r(i, h), "midlayer.mlp.up_proj.weight": r(i, h),
            "midlayer.mlp.down_proj.weight": r(h, i), "norm.weight": norm(),
            "lm_head.weight": 4 * r(DRAFT_VOCAB, h), "d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}


def write_eagle3_head(out, target_config: dict, seed: int = 0, **config) -> dict:
    cfg = {k: target_config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "rms_norm_eps", "vocab_size")}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, model_type="llama",
               draft_vocab_size=DRAFT_VOCAB, rope_theta=target_config.get("rope_theta") or 10000.0, **config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    state = eagle3_state(cfg, cfg["vocab_size"], seed)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return state


@pytest.fixture(scope="module", params=["cpu-fp32", "cpu-gguf", "cuda-fp32", "tensorrt-fp32"])
def built(request, tmp_path_factory):
    """A tiny 6-layer target and a published EAGLE-3 head, built for one runtime (cuda: the
    torch runtime on this CPU; tensorrt: the engine graph on the reference executor)."""
    device, weights = request.param.split("-")
    if weights == "gguf":
        native = pytest.importorskip("backend.runtime.native")
        if not native.compiled():
            pytest.skip("the native kernel is not compiled")
    mp = device_env(device)
    d = tmp_path_factory.mktemp(f"eagle3_{device}_{weights}")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=11, layers=LAYERS)
    state = write_eagle3_head(d / "head", json.loads((ckpt / "config.json").read_text()), seed=4)
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", device=Device(device), weights=(WeightFormat(weights),),
                          drafts=(f"eagle:{d / 'head'}",), quiet=True))
    yield m, ckpt, state
    mp.undo()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_eagle3(hf, state: dict, aux: torch.Tensor, next_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """EAGLE-3's draft layer over a causal sequence, from the paper and its reference code: the
    residual stream is fc(target features), the attention reads [norm(embedding), norm(stream)],
    logits = lm_head(norm(stream)) -> (pre-norm stream [n, H], logits [n, Vd])."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

    cfg = hf.config
    eps, n = cfg.rms_norm_eps, next_ids.size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // nh
    w = lambda k: state[f"midlayer.{k}.weight"]
    with torch.no_grad():
        emb = hf.model.embed_tokens(torch.tensor(next_ids))
        x = aux @ state["fc.weight"].T
        a = torch.cat([_rms(emb, w("input_layernorm"), eps), _rms(x, w("hidden_norm"), eps)], -1)
        q = (a @ w("self_attn.q_proj").T).view(n, nh, d).transpose(0, 1)
        k = (a @ w("self_attn.k_proj").T).view(n, nkv, d).transpose(0, 1)
        v = (a @ w("self_attn.v_proj").T).view(n, nkv, d).transpose(0, 1)
        cos, sin = LlamaRotaryEmbedding(cfg)(x[None], torch.arange(n)[None])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / np.sqrt(d) + torch.full((n, n), float("-inf")).triu(1), -1)
        x = x + (att @ v).transpose(0, 1).reshape(n, nh * d) @ w("self_attn.o_proj").T
        m = _rms(x, w("post_attention_layernorm"), eps)
        x = x + (torch.nn.functional.silu(m @ w("mlp.gate_proj").T) * (m @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
        return x.numpy(), (_rms(x, state["norm.weight"], eps) @ state["lm_head.weight"].T).numpy()


def _close(got, want) -> float:
    """Relative max error (float engines agree to rounding; gguf ones carry 8-bit blocks)."""
    return np.abs(got - want).max() / np.abs(want).max()


def test_target_engines_output_the_inputs_of_the_head_s_layers(built):
    from backend.devices import load_runtime

    m, ckpt, _ = built
    ef = m.engine()
    assert ef.feature_layers == (2, 3, 3) and m.drafts["eagle"].head["layout"] == "eagle3"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, m.model.vocab_size, 19)
    with torch.no_grad():
        hs = hf(torch.tensor([ids.tolist()]), output_hidden_states=True).hidden_states   # hs[j]: layer j's input
    rt = load_runtime(m)
    rt.alloc(0)
    got = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None]).hidden[0]
    rt.close()
    h = m.model.hidden_size
    assert got.shape == (ids.size, 4 * h)
    tol = 0.05 if ef.weights is WeightFormat.GGUF else 1e-4
    assert _close(got[:, :h], hs[-1][0].numpy()) < tol                 # final norm first
    for a, j in enumerate(ef.feature_layers):
        assert _close(got[:, (1 + a) * h:(2 + a) * h], hs[j][0].numpy()) < tol, j


def test_a_published_eagle3_head_computes_what_its_reference_computes(built):
    from backend.config import SpecConfig
    from backend.drafters.eagle import head_features
    from backend.draft_kinds import eagle_drafter
    from backend.devices import load_runtime

    m, ckpt, state = built
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(3, m.model.vocab_size, 17)
    n = ids.size - 1
    with torch.no_grad():
        hs = hf(torch.tensor([ids.tolist()]), output_hidden_states=True).hidden_states
    aux = torch.cat([hs[j][0, :n] for j in m.engine().feature_layers], -1)
    want_x, want = reference_eagle3(hf, state, aux, ids[1:])
    drafter = eagle_drafter(m, SpecConfig())
    target = load_runtime(m)
    target.alloc(0)
    feats = target.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None]).hidden[0, :n]
    h = m.model.hidden_size
    fused = feats[:, h:] @ state["fc.weight"].numpy().T                # the head's fc, exactly
    # the drafter's host fc (8-bit blocks on the native kernel where compiled) is close to it
    assert _close(head_features(feats, h, drafter.fc), fused) < 0.02
    head = drafter.rt
    head.alloc(0)
    out = head.forward([0], ids[None, 1:], chain(n), np.arange(n)[None], extra_inputs={"features": fused[None]})
    gguf = m.engine().weights is WeightFormat.GGUF
    tol = 0.1 if gguf else 1e-4
    assert _close(out.logits[0], want) < tol
    assert _close(out.hidden[0], want_x) < tol        # the next level's feature
    assert (out.logits[0].argmax(-1) == want.argmax(-1)).mean() >= (0.8 if gguf else 1.0)
    vocab = drafter.vocab
    assert np.array_equal(vocab, (state["d2t"] + torch.arange(DRAFT_VOCAB)).numpy())      # d2t: draft -> target ids
    target.close()
    head.close()


def test_speculation_with_a_published_eagle3_head_is_lossless(built):
    m, _, _ = built
    assert_greedy_identity(spec_decoder(m, m.default_format.value, num_draft_tokens=4), "eagle")


def test_feature_layers_follow_the_config_or_the_reference_default(tmp_path):
    ckpt_cfg = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-5, "vocab_size": 320}
    write_eagle3_head(tmp_path / "a", ckpt_cfg)
    write_eagle3_head(tmp_path / "b", ckpt_cfg, eagle_aux_hidden_state_layer_ids=[1, 7, 20])
    assert feature_layers(read_head(tmp_path / "a")[0], 30) == (2, 15, 27)       # SmolLM2's 30 layers
    assert feature_layers(read_head(tmp_path / "b")[0], 30) == (1, 7, 20)
    with pytest.raises(HeadFormatError, match="three layers"):
        feature_layers(read_head(tmp_path / "b")[0], 12)
    write_eagle3_head(tmp_path / "c", ckpt_cfg, norm_before_residual=True)
    with pytest.raises(HeadFormatError, match="norm_before_residual"):
        read_head(tmp_path / "c")
