"""Medusa heads (issue 15, point 2): `--draft medusa:DIR` reads Medusa-1's published layout
(config.json + medusa_lm_head.safetensors or .pt, keys `{k}.{j}.linear.*` and `{k}.{L}.weight`);
the drafter's chain equals Medusa's own computation (torch ResBlocks and LM heads on the
target's last final-norm hidden state); the build prices it; speculation with it is lossless,
greedy and seeded. Heads are tiny and random, written by the test."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backend.builder.pipeline import BuildConfig, build  # noqa: E402
from backend.config import DrafterKind, RuntimeOptions, SamplingParams, ServeConfig, SpecConfig  # noqa: E402
from backend.manifest import Device, WeightFormat  # noqa: E402
from conftest import device_env, assert_greedy_identity, chain, generate, make_tiny_checkpoint  # noqa: E402

HEADS, LAYERS = 3, 1


class ResBlock(torch.nn.Module):               # Medusa's, as published
    def __init__(self, h):
        super().__init__()
        self.linear = torch.nn.Linear(h, h)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_heads(hidden: int, vocab: int, seed: int) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    heads = torch.nn.ModuleList([torch.nn.Sequential(*[ResBlock(hidden) for _ in range(LAYERS)],
                                                     torch.nn.Linear(hidden, vocab, bias=False))
                                 for _ in range(HEADS)])
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return heads


@pytest.fixture(scope="module", params=[("safetensors", "cpu"), ("pt", "cpu"), ("safetensors", "cuda"),
                                        ("safetensors", "tensorrt")], ids=lambda p: "-".join(p))
def built(request, tmp_path_factory):
    """Medusa heads on a tiny target, built for each runtime (cuda: the torch runtime on this CPU;
    tensorrt: the engine graph on the reference executor)."""
    fmt, device = request.param
    mp = device_env(device)
    d = tmp_path_factory.mktemp(f"medusa_{fmt}_{device}")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=9)
    cfg = json.loads((ckpt / "config.json").read_text())
    heads = medusa_heads(cfg["hidden_size"], cfg["vocab_size"], seed=4)
    (d / "medusa").mkdir()
    (d / "medusa" / "config.json").write_text(json.dumps({"medusa_num_heads": HEADS, "medusa_num_layers": LAYERS,
                                                           "base_model_name_or_path": str(ckpt)}))
    state = {k: v.detach().contiguous() for k, v in heads.state_dict().items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(d / "medusa" / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, str(d / "medusa" / "medusa_lm_head.pt"))
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", device=Device(device), weights=(WeightFormat.FP32,),
                          drafts=(f"medusa:{d / 'medusa'}",), quiet=True))
    yield m, heads
    mp.undo()


def decoder(m, **spec):
    from backend.engine import make_decoder

    return make_decoder(ServeConfig(engine_dir=str(m.root), weight_format="fp32", spec=SpecConfig(**spec),
                                    runtime=RuntimeOptions(max_sequences=4)))


def test_the_chain_is_what_medusa_computes_and_the_build_prices_it(built):
    from backend.devices import load_runtime

    m, heads = built
    assert m.drafts["medusa"].kind == "medusa" and m.cost_model["draft_step_s"]["medusa"] > 0
    dec = decoder(m, num_draft_tokens=HEADS)
    ids = np.random.default_rng(3).integers(3, m.model.vocab_size, 15)
    rt = load_runtime(m)
    rt.alloc(0)
    h = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None]).hidden[0, -1]
    with torch.no_grad():
        want = [int(head(torch.from_numpy(h)).argmax()) for head in heads]
    drafter = dec.drafters[DrafterKind.MEDUSA]
    got = drafter.heads(h[None], HEADS)[0].argmax(-1).tolist()
    assert got == want


def test_speculation_with_medusa_heads_is_lossless(built):
    m, _ = built
    dec = decoder(m, num_draft_tokens=HEADS)
    assert_greedy_identity(dec, "medusa")
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=24, seed=11, ignore_eos=True)
    prompt = [5, 9, 13, 5, 9, 13, 21]
    assert generate(dec, prompt, DrafterKind.MEDUSA, params) == generate(dec, prompt, DrafterKind.NONE, params)
