"""EAGLE heads for any supported target (issue 27 point 4): a head is a Llama layer of its own
shape (ModelConfig.eagle_head) reading the target's raw embedding rows and features, so it
serves a Gemma-3 target as well as a Llama one, and a head whose heads / head dim / MLP width differ
from the target's loads too. Each: the head engine equals the torch head model, and greedy EAGLE
speculation is token-identical to plain decoding on the native and ONNX engines."""
import numpy as np
import pytest

from backend.builder.pipeline import BuildConfig, build
from backend.manifest import WeightFormat
from conftest import assert_greedy_identity, chain, eagle_head_reference, make_tiny_checkpoint, random_head, spec_decoder

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

CASES = {"gemma3": ("gemma3", {}),
         "own_shape": ("llama", dict(num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=96))}


@pytest.fixture(scope="module", params=sorted(CASES))
def with_head(request, tmp_path_factory):
    arch, shape = CASES[request.param]
    d = tmp_path_factory.mktemp(f"eagle_{request.param}")
    ckpt = make_tiny_checkpoint(d / "ckpt", arch, layers=2)
    m = build(BuildConfig(target=str(ckpt), output=d / "plain", quiet=True, measure_costs=False,
                          weights=(WeightFormat.FP32,)))
    head = random_head(m, d / "head", vocab_size=96, **shape)
    repos = {fmt: build(BuildConfig(target=str(ckpt), output=d / fmt, quiet=True, measure_costs=False,
                                    weights=(WeightFormat(fmt),), drafts=(f"eagle:{head}",)))
             for fmt in ("gguf", "fp32")}         # the head on the native kernel, and on ONNX Runtime
    return repos, head, shape


def test_the_head_engine_equals_the_torch_head(with_head, tmp_path):
    from backend.devices import load_runtime

    repos, head_dir, shape = with_head
    m = repos["fp32"]
    t = 11
    hck, feats, toks, f_ref, l_ref = eagle_head_reference(
        m, head_dir, t, rope_layer=lambda cfg: m.model.llama_layer(head_dim=cfg["head_dim"]))
    assert hck.config.features() == [] and hck.config.hidden_size == m.model.hidden_size
    assert all(getattr(hck.config, k) == v for k, v in shape.items())
    for fmt, m in repos.items():
        rt = load_runtime(m, engine="eagle")
        rt.alloc(0)
        out = rt.forward([0], toks, chain(t), np.arange(t)[None], {"features": feats})
        tol = 1e-4 if fmt == "fp32" else 0.05    # the native head in Q8_0 blocks
        np.testing.assert_allclose(out.hidden[0], f_ref, rtol=tol, atol=tol)
        np.testing.assert_allclose(out.logits[0], l_ref, rtol=tol, atol=tol)
        rt.close()


@pytest.mark.parametrize("fmt", ["gguf", "fp32"])
def test_greedy_eagle_speculation_is_plain(with_head, fmt):
    m = with_head[0][fmt]
    assert_greedy_identity(spec_decoder(m, fmt, num_draft_tokens=4), "eagle")


@pytest.mark.parametrize("fmt", ["gguf", "fp32"])
def test_medusa_heads_serve_a_gemma3_target(tmp_path, fmt):
    """Medusa heads read the target's last final-norm hidden state whatever its family: on a
    Gemma-3 target they build, are priced, and greedy speculation with them is plain."""
    import json

    from safetensors.torch import save_file

    from test_medusa import HEADS, LAYERS, medusa_heads

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "gemma3", layers=2)
    cfg = json.loads((ckpt / "config.json").read_text())
    heads = medusa_heads(cfg["hidden_size"], cfg["vocab_size"], seed=4)
    (tmp_path / "medusa").mkdir()
    (tmp_path / "medusa" / "config.json").write_text(json.dumps({"medusa_num_heads": HEADS, "medusa_num_layers": LAYERS}))
    save_file({k: v.detach().contiguous() for k, v in heads.state_dict().items()},
              str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))
    m = build(BuildConfig(target=str(ckpt), output=tmp_path / "repo", weights=(WeightFormat(fmt),),
                          drafts=(f"medusa:{tmp_path / 'medusa'}",), quiet=True))
    assert m.cost_model["draft_step_s"]["medusa"] > 0
    assert_greedy_identity(spec_decoder(m, fmt, num_draft_tokens=HEADS), "medusa")
