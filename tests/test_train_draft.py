"""`specdec train-draft` end to end on a tiny target: fixed text and the target's own answers,
labels recomputed from the stored features, held-out validation choosing the written head,
and the written head builds and speculates losslessly."""
import json

import numpy as np
import pytest

from backend.builder.pipeline import BuildConfig, build
from conftest import chain, make_tiny_checkpoint

torch = pytest.importorskip("torch")

DOCS = '''
def {name}(x):
    """{text}"""
'''


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from backend.train.eagle_train import TrainConfig, train

    d = tmp_path_factory.mktemp("train")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=5)
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", quiet=True, measure_costs=False))
    src = d / "src" / "pkg"
    src.mkdir(parents=True)
    sentence = "the quick brown fox jumps over the lazy dog and says hello world to speculative decoding. "
    for k in range(8):
        (src / f"mod{k}.py").write_text("".join(DOCS.format(
            name=f"f{j}", text=f"Function {j} of module {k}: " + sentence * (3 + j)) for j in range(4)))
    cfg = TrainConfig(out=d / "head", engine_dir=m.root, work=d / "work", corpus_tokens=3000,
                      corpus_roots=[str(d / "src")], num_prompts=3, max_new_tokens=12, draft_vocab=64,
                      window=32, batch=4, epochs=2, minutes=2.0, val_prompts=3, val_every=4)
    return m, train(cfg), cfg


def test_corpus_is_fixed_text_as_chats(trained):
    from backend.tokenizer import Tokenizer

    m, _, cfg = trained
    tok = Tokenizer.from_manifest(m)
    recs = [json.loads(l) for l in (cfg.work / "data" / "corpus.jsonl").read_text().splitlines()]
    assert sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in recs) >= cfg.corpus_tokens
    answer = tok.decode(recs[0]["output_ids"])
    assert "quick brown fox" in answer
    assert "assistant" in tok.decode(recs[0]["prompt_ids"], skip_special_tokens=False)
    own = [json.loads(l) for l in (cfg.work / "data" / "responses.jsonl").read_text().splitlines()]
    assert len(own) == cfg.num_prompts


def test_stored_features_give_the_targets_distribution(trained):
    """Training labels are softmax(feature @ LM head): check that against the engine's logits."""
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.devices import load_runtime
    from backend.train.eagle_train import _load_shards

    m, _, cfg = trained
    seq = _load_shards(sorted((cfg.work / "data" / "val_features").glob("hidden_*.npz")))[0]
    ck = load_checkpoint(m.source)
    head = ck.tensors.get("lm_head", ck.tensor("embed")).float32()
    rt = load_runtime(m, m.default_format.value)
    ids = seq["tokens"].astype(np.int64)
    rt.alloc(0)
    out = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None])
    rt.free(0)
    recomputed = seq["feats"].astype(np.float32) @ head.T
    np.testing.assert_allclose(recomputed, out.logits[0], atol=5e-3 * np.abs(out.logits).max())
    assert (seq["top1"] == out.logits[0].argmax(-1)).all()        # probe_every=1 for validation


def test_validation_curve_selects_the_written_head(trained):
    from backend.train.eagle_train import _load_shards, load_head, validate
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.engine_format import rope_tables
    from backend.train.eagle_model import EagleHead

    m, head_dir, cfg = trained
    conf, w = load_head(head_dir)
    curve = conf["training"]["validation_curve"]
    assert len(curve) >= 3 and curve[0]["tokens"] == 0
    assert all(b["tokens"] > a["tokens"] for a, b in zip(curve, curve[1:]))
    best = conf["training"]["validation_best"]
    assert best["score"] == max(v["score"] for v in curve)
    assert (head_dir / "training.png").stat().st_size > 10_000
    # the written weights are the best checkpoint's: validating them again gives its numbers
    vocab = w["draft_vocab"].astype(np.int64)
    ck = load_checkpoint(m.source)
    embed = ck.tensor("embed").float32()
    cos, sin = rope_tables(m.model, m.max_seq_len)
    model = EagleHead(conf, embed, ck.tensors.get("lm_head", ck.tensor("embed")).float32()[vocab], cos, sin)
    model.load_weights({k: v.astype(np.float32) for k, v in w.items()})
    val = _load_shards(sorted((cfg.work / "data" / "val_features").glob("hidden_*.npz")))
    again = validate(model.eval(), val, vocab)
    assert again["positions"] == best["positions"]
    assert abs(again["acc1"] - best["acc1"]) <= 2.0 / best["positions"]   # fp16 weights


def test_trained_head_builds_and_is_lossless(trained):
    from backend.config import DrafterKind, ServeConfig, SpecConfig
    from backend.engine import make_decoder
    from conftest import assert_greedy_identity

    m, head_dir, _ = trained
    m2 = build(BuildConfig(target=m.source, output=m.root.parents[2] / "repo2", quiet=True,
                           measure_costs=False, drafts=(f"eagle:{head_dir}",)))
    dec = make_decoder(ServeConfig(engine_dir=str(m2.root), spec=SpecConfig(auto_drafter=DrafterKind.EAGLE)))
    assert_greedy_identity(dec, DrafterKind.EAGLE)


@pytest.fixture(scope="module")
def trained3(tmp_path_factory):
    """An EAGLE-3 head trained on a tiny 6-layer target served by the native kernel."""
    from backend.runtime import native
    from backend.train.eagle_train import TrainConfig, train

    if not native.compiled():
        pytest.skip("EAGLE-3 features come from the native kernel (not compiled here) or the torch runtime")
    d = tmp_path_factory.mktemp("train3")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=6, layers=6)
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", quiet=True, measure_costs=False))
    cfg = TrainConfig(out=d / "head", engine_dir=m.root, work=d / "work", corpus_tokens=0, num_prompts=6,
                      max_new_tokens=24, draft_vocab=64, window=32, batch=4, epochs=3, minutes=2.0,
                      val_prompts=3, val_every=4, eagle3=True)
    return m, train(cfg), cfg


def test_an_eagle3_head_trains_on_three_layers_and_is_written_in_the_reference_layout(trained3):
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.engine_format import rope_tables
    from backend.buildlib.heads.formats import layout, read_head
    from backend.train.eagle_model import Eagle3Head
    from backend.train.eagle_train import _load_shards, validate

    m, head_dir, cfg = trained3
    assert m.default_format.value == "gguf" and layout(head_dir) == "eagle3"
    conf = json.loads((head_dir / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    val = _load_shards(sorted((cfg.work / "data" / "val_features_eagle3").glob("hidden_*.npz")))
    assert val[0]["feats"].shape[1] == 4 * m.model.hidden_size            # final norm + three layers' inputs
    curve, best = conf["training"]["validation_curve"], conf["training"]["validation_best"]
    assert len(curve) >= 3 and best["score"] == max(v["score"] for v in curve)
    # the written weights (read back through the published-layout reader) are the best checkpoint's
    hcfg, w = read_head(head_dir)
    vocab = w["draft_vocab"]
    ck = load_checkpoint(m.source)
    embed = ck.tensor("embed").float32()
    cos, sin = rope_tables(m.model, m.max_seq_len)
    model = Eagle3Head(hcfg, embed, ck.tensors.get("lm_head", ck.tensor("embed")).float32()[vocab], cos, sin)
    model.load_weights(w)
    again = validate(model.eval(), val, vocab)
    assert again["positions"] == best["positions"]
    assert abs(again["acc1"] - best["acc1"]) <= 2.0 / best["positions"]      # fp16 weights


@pytest.fixture(scope="module")
def built3(trained3):
    """The trained EAGLE-3 head built with its target (gguf serving, fp32 beside it)."""
    m, head_dir, _ = trained3
    return build(BuildConfig(target=m.source, output=m.root.parents[2] / "repo2", quiet=True, measure_costs=False,
                             drafts=(f"eagle:{head_dir}",)))


def test_a_trained_eagle3_head_builds_and_is_lossless(built3):
    from backend.config import DrafterKind, ServeConfig, SpecConfig
    from backend.engine import make_decoder
    from conftest import assert_greedy_identity

    assert built3.engine().feature_layers == (2, 3, 3) and built3.engine("fp32").feature_layers == (2, 3, 3)
    dec = make_decoder(ServeConfig(engine_dir=str(built3.root), spec=SpecConfig(auto_drafter=DrafterKind.EAGLE)))
    assert_greedy_identity(dec, DrafterKind.EAGLE)


@pytest.mark.parametrize("fmt", ["gguf", "fp32"])
def test_final_norm_features_extract_from_engines_built_for_eagle3(built3, tmp_path, fmt):
    """Training an EAGLE-1-style head on a repository whose engines also output EAGLE-3's layer
    features stores the final-norm part only (fp32: the graph has the layers built in)."""
    from backend.train.data import extract_hidden
    from backend.train.eagle_train import _load_shards

    recs = [{"i": 0, "prompt_ids": [5, 9, 13, 5], "output_ids": [9, 13, 21, 40, 7]}]
    seq = _load_shards(extract_hidden(built3.root, recs, tmp_path / "f", fmt))[0]
    assert seq["feats"].shape == (9, built3.model.hidden_size)
