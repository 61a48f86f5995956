"""Published EAGLE head layouts (issue 15, point 2): `--draft eagle:DIR` loads an EAGLE-1/2 head
as the reference implementation publishes it (config.json + model.safetensors or
pytorch_model.bin, its key names, no input norm in the layer and no final norm): the built
head's logits equal the reference computation (transformers' Llama layer without its input
norm, then the target's LM head), and speculation with it is lossless. An incomplete EAGLE-3
checkpoint and Medusa heads are refused saying why (EAGLE-3 heads: test_eagle3.py). Heads are
tiny, random, written by the test."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from backend.builder.pipeline import BuildConfig, build  # noqa: E402
from backend.config import RuntimeOptions, ServeConfig, SpecConfig  # noqa: E402
from backend.buildlib.heads.formats import HeadFormatError  # noqa: E402
from backend.manifest import Device, WeightFormat  # noqa: E402
from conftest import device_env, assert_greedy_identity, chain, make_tiny_checkpoint  # noqa: E402


def eagle_state(cfg: dict, seed: int, bias: bool = True) -> dict:
    """Random EAGLE-1 weights under the reference implementation's names."""
    g = torch.Generator().manual_seed(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    r = lambda *s: torch.randn(*s, generator=g) / np.sqrt(s[-1])
    state = {"fc.weight": r(h, 2 * h), "embed_tokens.weight": r(cfg["vocab_size"], h),
             "layers.0.self_attn.q_proj.weight": r(h, h), "layers.0.self_attn.k_proj.weight": r(kv, h),
             "layers.0.self_attn.v_proj.weight": r(kv, h), "layers.0.self_attn.o_proj.weight": r(h, h),
             "layers.0.mlp.gate_proj.weight": r(i, h), "layers.0.mlp.up_proj.weight": r(i, h),
             "layers.0.mlp.down_proj.weight": r(h, i),
             "layers.0.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    if bias:
        state["fc.bias"] = 0.1 * torch.randn(h, generator=g)
    return state


def write_eagle_head(out, target_config: dict, seed: int = 0, fmt: str = "safetensors") -> dict:
    cfg = {k: target_config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "rms_norm_eps", "vocab_size")}
    theta = target_config.get("rope_theta") or target_config["rope_parameters"]["rope_theta"]
    cfg.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, bias=True, model_type="llama",
               rope_theta=theta)       # as the published heads' configs (transformers 4) write it
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    state = eagle_state(cfg, seed)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    else:
        torch.save(state, str(out / "pytorch_model.bin"))
    return state


@pytest.fixture(scope="module", params=[("safetensors", "cpu"), ("bin", "cpu"), ("safetensors", "cuda"),
                                        ("safetensors", "tensorrt")], ids=lambda p: "-".join(p))
def built(request, tmp_path_factory):
    """A tiny target and a published-layout head, built for each runtime (cuda: the torch
    runtime on this CPU; tensorrt: the engine graph on the reference executor)."""
    fmt, device = request.param
    mp = device_env(device)
    d = tmp_path_factory.mktemp(f"eagle_{fmt}_{device}")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=7)
    target_config = json.loads((ckpt / "config.json").read_text())
    state = write_eagle_head(d / "head", target_config, seed=1, fmt=fmt)
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", device=Device(device), weights=(WeightFormat.FP32,),
                          drafts=(f"eagle:{d / 'head'}",), quiet=True))
    yield m, ckpt, state
    mp.undo()


def reference_head_logits(ckpt, state, features: np.ndarray, next_ids: np.ndarray) -> np.ndarray:
    """EAGLE-1 as its reference implementation computes it: fc([embed(x_{t+1}), f_t]), one Llama
    layer without input norm (causal, positions 0..n-1), the target's LM head, no final norm."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    config = hf.config
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    n = next_ids.size
    with torch.no_grad():
        emb = hf.model.embed_tokens(torch.tensor(next_ids)[None])
        x = torch.cat([emb, torch.from_numpy(features)[None]], -1) @ state["fc.weight"].T + state["fc.bias"]
        pos = torch.arange(n)[None]
        cos, sin = LlamaRotaryEmbedding(config)(x, pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
        out = out[0] if isinstance(out, tuple) else out
        return (out @ hf.lm_head.weight.T)[0].numpy()


def test_a_published_eagle_head_computes_what_its_reference_computes(built):
    from backend.devices import load_runtime

    m, ckpt, state = built
    assert m.drafts["eagle"].head["layout"] == "eagle" and m.drafts["eagle"].head["norms"] == []
    ids = np.random.default_rng(0).integers(3, m.model.vocab_size, 17)
    target = load_runtime(m)
    target.alloc(0)
    feats = target.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None]).hidden[0]
    head = load_runtime(m, engine="eagle")
    head.alloc(0)
    n = ids.size - 1
    got = head.forward([0], ids[None, 1:], chain(n), np.arange(n)[None],
                       extra_inputs={"features": feats[None, :n]}).logits[0]
    want = reference_head_logits(ckpt, state, feats[:n], ids[1:])
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_speculation_with_a_published_eagle_head_is_lossless(built):
    from backend.engine import make_decoder

    m, _, _ = built
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), weight_format="fp32", spec=SpecConfig(num_draft_tokens=3),
                                   runtime=RuntimeOptions(max_sequences=4)))
    assert_greedy_identity(dec, "eagle")


@pytest.mark.parametrize("keys,match", [({"midlayer.self_attn.q_proj.weight": (8, 8), "d2t": (4,)}, "EAGLE-3"),
                                        ({"0.0.linear.weight": (8, 8), "0.1.weight": (8, 8)}, "Medusa")])
def test_incomplete_eagle3_and_medusa_checkpoints_are_refused_saying_why(tmp_path, keys, match):
    from safetensors.torch import save_file

    from backend.buildlib.heads.formats import read_head

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    save_file({k: torch.zeros(s) for k, s in keys.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadFormatError, match=match):
        read_head(tmp_path)
