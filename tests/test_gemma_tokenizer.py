"""SentencePiece ("llama") tokenizers rebuilt from GGUF metadata (Gemma-3), and what a model
without a chat template (a base model) means for requests and the bench.

(a) the real Gemma-3-270M GGUF: our tokenizer gives transformers' GGUF tokenizer's ids on the public
    prompts and on text with odd spaces, newlines, tabs, digits, emoji and CJK, and decodes back
    to the text; (b) a tiny synthetic vocabulary: merge order by score, byte fallback, spaces;
    (c) `apply_chat_template` refused as INVALID_ARG naming the input, and the bench's plain
    continuation for such a model.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backend.tokenizer import IncrementalDetokenizer, Tokenizer, sentencepiece_merges, tokenizer_json_from_gguf
from conftest import real_gemma_gguf

BOS, EOS = 2, 1

# text beyond the prompt sets: spaces (leading, trailing, runs), newlines, tabs, digits, byte
# fallback (emoji, rare CJK, combining marks), HTML-like user-defined tokens, control tokens
EDGE_TEXTS = [
    "Hello world", " leading", "  two leading", "   three leading", "trailing ", "trailing   ",
    "a  b", "x   y  z    w", "     ", " ", "a", "tab\there", "\t\tindented\t", "new\nline",
    "\n\nstarts with newlines", "ends with newlines\n\n\n", "a \n b", " \n\t \n", "\r\n crlf\r\n",
    "digits 1234567890 3.14159 -42 1e10 0x1F", "2026-12-03 10:09:59", "room 101, floor 7",
    "emoji 🦙😀👍🏽 ok 🇺🇸 👨‍👩‍👧‍👦", "中文测试，日本語のテキスト。한국어 텍스트", "𠜎𠜱𠝹 rare CJK",
    "mixed Ünïcödé ñ ß ø e\u0301", "\u200b zero width", "ＡＢＣ fullwidth", "<b>bold</b> <div>x</div>",
    "def f(x):\n    return x  # comment\n", "   \t \n \t  mixed whitespace  \n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
]
# runs longer than Gemma's longest space token (31): SentencePiece and llama.cpp take the longest
# user-defined token first (31 + 9); transformers' GGUF converter turns those tokens into merges
# and splits such runs otherwise (15 + 23), so these are checked against token strings instead
LONG_SPACE_RUNS = [" " * 40 + "x", "x" + " " * 33]
HAS_CONTROL = ("<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>")


# ----------------------------------------------------------------------------- (a) the real GGUF

@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return real_gemma_gguf()


@pytest.fixture(scope="module")
def gemma_vocab(gemma_path):
    from backend.buildlib.checkpoint import load_checkpoint

    src = load_checkpoint(str(gemma_path)).tokenizer
    assert src.gguf_vocab["model"] == "llama"
    return src


@pytest.fixture(scope="module")
def gemma(gemma_vocab, tmp_path_factory) -> Tokenizer:
    """Our tokenizer, built once per module (the 262k-token merges take a few seconds)."""
    path = tmp_path_factory.mktemp("gemma_tok") / "tokenizer.json"
    path.write_text(tokenizer_json_from_gguf(gemma_vocab.gguf_vocab))
    return Tokenizer(path, gemma_vocab.chat_template, gemma_vocab.eos_token_ids,
                     gemma_vocab.bos_token_id, gemma_vocab.add_bos_token)


@pytest.fixture(scope="module")
def reference(gemma_path):
    """transformers' tokenizer for the GGUF: what AutoTokenizer.from_pretrained(dir, gguf_file=...)
    builds (its convert_gguf_tokenizer), without also reading the whole model's metadata."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (convert_gguf_tokenizer,
                                                                       get_gguf_tokenizer)

    arch, tokenizer_dict, config = get_gguf_tokenizer(str(gemma_path))
    assert arch == "gemma3" and config["add_bos_token"] is True
    backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    return backend


def _public_texts() -> list[str]:
    from backend.bench.prompt_sets import default_prompts, load_prompts

    return [m["content"] for p in load_prompts(default_prompts()) for m in p["messages"]]


def test_gemma_metadata_as_expected(gemma_vocab, gemma):
    v = gemma_vocab.gguf_vocab
    assert (v["pre"], v["add_space_prefix"], len(v["tokens"]), len(v["scores"])) == ("default", False, 262144, 262144)
    assert gemma_vocab.chat_template is None and gemma_vocab.add_bos_token
    assert (gemma_vocab.bos_token_id, gemma_vocab.eos_token_ids) == (BOS, (EOS,))
    assert gemma.vocab_size == 262144
    assert gemma.token_to_id("<start_of_turn>") == 105 and gemma.token_to_id("<0x41>") is not None


def test_gemma_ids_match_transformers(gemma, reference):
    texts = _public_texts() + EDGE_TEXTS
    assert len(texts) > len(EDGE_TEXTS) >= 30
    diffs = []
    for text in texts:
        ours = gemma.encode(text)
        ref = [BOS] + reference.encode(text, add_special_tokens=False).ids
        if ours != ref:
            diffs.append((text[:60], ours[:24], ref[:24]))
    assert diffs == []


def test_gemma_long_space_runs_take_the_longest_space_token(gemma):
    tid = gemma.token_to_id
    assert gemma.encode(LONG_SPACE_RUNS[0]) == [BOS, tid(" " * 31), tid(" " * 9), tid("x")]
    assert gemma.encode(LONG_SPACE_RUNS[1]) == [BOS, tid("x"), tid(" " * 31), tid(" " * 2)]


def test_gemma_round_trips(gemma):
    for text in _public_texts() + EDGE_TEXTS + LONG_SPACE_RUNS:
        ids = gemma.encode(text)
        assert ids[0] == BOS
        if any(c in text for c in HAS_CONTROL):
            assert gemma.decode(ids, skip_special_tokens=False) == "<bos>" + text
        else:
            assert gemma.decode(ids) == text
            det = IncrementalDetokenizer(gemma, ids[:1])
            streamed = "".join(det.push([i]) for i in ids[1:]) + det.flush()
            assert streamed == text


def test_gemma_special_tokens_and_byte_fallback(gemma):
    tid = gemma.token_to_id
    ids = gemma.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)
    assert ids[0] == tid("<start_of_turn>") and ids[-1] == tid("<end_of_turn>") and tid("\n") in ids
    llama = gemma.encode("🦙", add_special_tokens=False)          # not in the vocabulary: its bytes
    assert llama == [tid(f"<0x{b:02X}>") for b in "🦙".encode()]
    assert gemma.encode("a\t\tb", add_special_tokens=False)[1] == tid("\t\t")


# ----------------------------------------------------------------------------- (b) synthetic vocab

def _tiny_vocab(add_space_prefix: bool = False) -> dict:
    """A SentencePiece vocabulary in GGUF form: control tokens, the 256 byte tokens, a handful of
    pieces whose scores disagree with their order, and a user-defined run of two spaces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 3] + [6] * 256
    scores = [0.0] * 4 + [0.0] * 256
    pieces = [("\u2581", -1), ("a", -2), ("b", -3), ("c", -4), ("d", -5), ("x", -6),
              ("ab", -20), ("bc", -10),          # "bc" scores higher though listed after "ab"
              ("\u2581a", -11), ("\u2581b", -12), ("bd", -25), ("abd", -30), ("\u2581\u2581", -40),
              ("cd", -50)]
    for piece, score in pieces:
        tokens.append(piece), types.append(1), scores.append(float(score))
    tokens.append("  "), types.append(4), scores.append(-1000.0)
    return {"model": "llama", "pre": "default", "tokens": tokens, "merges": [], "token_types": types,
            "scores": scores, "add_space_prefix": add_space_prefix, "unknown_token_id": 3}


def _tiny_tokenizer(tmp_path, template: str | None = None, **kw) -> Tokenizer:
    path = tmp_path / "tok.json"
    path.write_text(tokenizer_json_from_gguf(_tiny_vocab(**kw)))
    return Tokenizer(path, template, (EOS,), BOS, add_bos_token=True)


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)]


def test_merges_as_transformers_generates_them():
    from transformers.tokenization_utils_base import generate_merges

    v = _tiny_vocab()
    # ties: two tokens of equal score, and one token ("abd") reachable by two splits
    v["scores"][v["tokens"].index("cd")] = v["scores"][v["tokens"].index("abd")]
    vocab = {t: i for i, t in enumerate(v["tokens"])}
    ours = sentencepiece_merges(v["tokens"], v["scores"])
    assert ours == generate_merges(vocab, dict(zip(v["tokens"], v["scores"])))
    assert ours.index(("b", "c")) < ours.index(("a", "b"))          # by score, not by position
    assert ours.index(("ab", "d")) < ours.index(("a", "bd"))        # a tie: the longer left piece


def test_tiny_merge_order_is_by_score(tmp_path):
    tok = _tiny_tokenizer(tmp_path)
    assert _pieces(tok, "abc") == ["a", "bc"]          # "bc" outranks "ab" (llama.cpp would agree)
    assert _pieces(tok, "abd") == ["abd"]              # "ab" (not "bd"), then "abd"
    assert _pieces(tok, "xbd") == ["x", "bd"]
    assert _pieces(tok, "abcd") == ["a", "bc", "d"]


def test_tiny_byte_fallback(tmp_path):
    tok = _tiny_tokenizer(tmp_path)
    assert _pieces(tok, "aé") == ["a", "<0xC3>", "<0xA9>"]
    assert _pieces(tok, "z") == ["<0x7A>"]             # ASCII outside the vocabulary too
    for text in ("aé", "🦙 b", "中a", "z"):
        assert tok.decode(tok.encode(text)) == text


def test_tiny_spaces(tmp_path):
    tok = _tiny_tokenizer(tmp_path)
    assert _pieces(tok, "a b") == ["a", "\u2581b"]
    assert _pieces(tok, " a") == ["\u2581a"]            # no space prefix of its own (add_space_prefix false)
    assert _pieces(tok, "a") == ["a"]
    assert _pieces(tok, "a  b") == ["a", "  ", "b"]      # the user-defined run, matched whole in the text
    assert _pieces(tok, "a ") == ["a", "\u2581"]
    assert _pieces(tok, "a\u2581\u2581b") == ["a", "\u2581", "\u2581b"]    # "\u2581b" outscores "\u2581\u2581"
    for text in ("a b", " a", "a  b", "a ", "   ", "ab cd", "x \t\n x"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a", add_special_tokens=True)[0] == BOS
    assert _pieces(tok, "<eos>a") == ["<eos>", "a"]     # control tokens are special added tokens
    assert tok.decode(tok.encode("<eos>a")) == "a"


def test_tiny_space_prefix(tmp_path):
    tok = _tiny_tokenizer(tmp_path, add_space_prefix=True)
    assert _pieces(tok, "a b") == ["\u2581a", "\u2581b"]
    assert _pieces(tok, "<eos>a") == ["<eos>", "\u2581a"]      # after a special token too, as llama.cpp
    for text in ("a b", "b", " a"):
        assert tok.decode(tok.encode(text)) == text


def test_unsupported_gguf_tokenizer_is_named():
    with pytest.raises(ValueError, match="'bert'.*'gpt2'.*'llama'"):
        tokenizer_json_from_gguf({**_tiny_vocab(), "model": "bert"})
    with pytest.raises(ValueError, match="scores"):
        tokenizer_json_from_gguf({**_tiny_vocab(), "scores": []})


# ----------------------------------------------------------------------------- (c) no chat template

def _request(text: str, chat: bool | None) -> dict:
    inputs = {"text_input": np.array([[text.encode()]], dtype=np.object_)}
    if chat is not None:
        inputs["apply_chat_template"] = np.array([[chat]], dtype=bool)
    return inputs


def test_chat_template_refused_for_a_base_model(tmp_path):
    from backend import triton_io
    from backend.config import RequestError
    from backend.errors import NoChatTemplate, UserError

    tok = _tiny_tokenizer(tmp_path)
    with pytest.raises(NoChatTemplate) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(e.value, UserError)
    for fn in (lambda i: triton_io.prompt_text(i, tok.apply_chat_template),
               lambda i: triton_io.prompt_ids(i, tok)):
        with pytest.raises(RequestError) as e:
            fn(_request("ab", True))
        msg = str(e.value)
        assert e.value.field == "apply_chat_template" and msg.startswith("apply_chat_template: ")
        assert "no chat template" in msg and "apply_chat_template=false" in msg and "--raw" in msg
        assert triton_io.error_code(msg) == "INVALID_ARG"
    assert triton_io.prompt_text(_request("ab", False), tok.apply_chat_template) == "ab"
    assert triton_io.prompt_ids(_request("ab", None), tok) == [BOS, tok.token_to_id("ab")]


def test_chat_template_still_applies_when_the_model_has_one(tmp_path):
    from backend import triton_io

    tok = _tiny_tokenizer(tmp_path, template="{% for m in messages %}{{ m['content'] }}d{% endfor %}")
    assert triton_io.prompt_text(_request("ab", True), tok.apply_chat_template) == "abd"


class _FakeDecoder:
    """spec_bench's view of a decoder: a tokenizer, and generate() yielding outputs."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    def generate(self, req):
        from backend.stats import SpecStats

        self.seen.append(req.prompt_ids)

        class Out:
            new_ids, stats = [5, 6], SpecStats()
        yield Out()


def test_bench_uses_plain_continuation_without_a_chat_template(tmp_path, capsys):
    from backend.bench import prompt_sets, spec_bench
    from backend.config import DrafterKind

    prompts = [{"id": "p1", "kind": "k", "messages": [{"role": "user", "content": "ab c"}]}]
    base = _tiny_tokenizer(tmp_path)
    assert prompt_sets.prompt_format(base) == prompt_sets.PLAIN_CONTINUATION
    assert prompt_sets.prompt_ids(base, prompts[0]["messages"]) == base.encode("ab c", add_special_tokens=True)
    dec = _FakeDecoder(base)
    out = tmp_path / "bench.json"
    result = spec_bench.run(dec, prompts, DrafterKind.NONE, 4, out_json=out, log=lambda *a: None)
    assert result["prompt_format"] == "plain continuation (no chat template)"
    assert json.loads(out.read_text())["prompt_format"] == result["prompt_format"]
    assert tuple(dec.seen[-1]) == tuple(base.encode("ab c", add_special_tokens=True))
    err = capsys.readouterr().err
    assert err.count("no chat template") == 1 and "plain continuation" in err

    chat = _tiny_tokenizer(tmp_path, template="{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}")
    assert prompt_sets.prompt_format(chat) == prompt_sets.CHAT_TEMPLATE
    assert prompt_sets.prompt_ids(chat, prompts[0]["messages"]) == chat.encode("<bos>ab c", add_special_tokens=False)
    result = spec_bench.run(_FakeDecoder(chat), prompts, DrafterKind.NONE, 4, log=lambda *a: None)
    assert result["prompt_format"] == "chat template" and capsys.readouterr().err == ""
