"""Tokenizer, chat template and incremental detokenization.

Knows: Hugging Face `tokenizers` JSON, how to rebuild one from GGUF metadata (byte-level BPE
and SentencePiece BPE), Jinja chat templates as transformers renders them. Does not know: models
or requests.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backend.errors import NoChatTemplate
from backend.manifest import EngineManifest

# Pre-tokenizer split patterns of llama.cpp's known BPE "pre" types (llama-vocab.cpp).
_PRE_REGEX = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def tokenizer_json_from_gguf(vocab: dict) -> str:
    """Rebuild a `tokenizers` JSON from GGUF metadata (tokenizer.ggml.*): byte-level BPE ("gpt2")
    or SentencePiece BPE ("llama")."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if vocab["model"] == "llama":
        return _sentencepiece_json(vocab)
    if vocab["model"] != "gpt2":
        raise ValueError(f"GGUF tokenizer model {vocab['model']!r} is not supported (only byte-level "
                         "BPE 'gpt2' and SentencePiece 'llama'); build from a Hugging Face directory "
                         "with tokenizer.json")
    pre = vocab.get("pre") or "default"
    tokens, types = vocab["tokens"], vocab["token_types"]
    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                              fuse_unk=False))
    if pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in ("gpt2", "default"):
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _PRE_REGEX:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise ValueError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: "
                         f"smollm, gpt2, {', '.join(_PRE_REGEX)}")
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL])
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED])
    return tk.to_str()


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, which stores none: (a, b) is a merge
    wherever a, b and a+b are all tokens, ranked by the score of a+b, higher first (SentencePiece
    and llama.cpp merge the adjacent pair whose result scores highest). Ties as transformers'
    `generate_merges` (the GGUF converter's) breaks them: the longer left piece first, then the
    longer right piece, then the merged token's vocabulary order, then (left id, right id)."""
    ids = {t: i for i, t in enumerate(tokens)}      # a repeated token: its last id, as HF's
    get = ids.get
    found = []          # (-score, -len(left), -len(right), merged token's order, left id, right id)
    for order, (merged, mid) in enumerate(ids.items()):
        n = len(merged)
        if n < 2:
            continue
        score = -scores[mid]
        for k in range(1, n):
            a = get(merged[:k])
            if a is None:
                continue
            b = get(merged[k:])
            if b is not None:
                found.append((score, -k, k - n, order, a, b))
    found.sort()
    return [(tokens[a], tokens[b]) for _, _, _, _, a, b in found]


def _sentencepiece_json(vocab: dict) -> str:
    """SentencePiece BPE with byte fallback, as llama.cpp's SPM tokenizer runs it: spaces become
    "▁" (plus one in front where the file sets add_space_prefix), no pre-tokenizer (merges may
    cross words), characters outside the vocabulary fall back to <0xNN> byte tokens; control and
    unknown tokens (types 3, 2) are special added tokens and user-defined ones (4, e.g. Gemma's
    runs of spaces, newlines and tabs and its HTML tags) plain added tokens, all matched whole in
    the raw text before the rest is tokenized, as llama.cpp does (with special tokens parsed)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens, types, scores = vocab["tokens"], vocab["token_types"], vocab.get("scores") or []
    if len(scores) != len(tokens):
        raise ValueError(f"GGUF SentencePiece tokenizer: {len(scores)} scores for {len(tokens)} "
                         "tokens (tokenizer.ggml.scores gives the merge order; it is required)")
    unk_id = vocab.get("unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    merges = ([tuple(m.split(" ", 1)) for m in vocab["merges"]] if vocab.get("merges")
              else sentencepiece_merges(tokens, scores))
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                              unk_token=unk, fuse_unk=True, byte_fallback=True))
    space = normalizers.Replace(" ", "\u2581")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.get("add_space_prefix", True):
        # llama.cpp puts the space in front of the text and after each special token; so does a
        # normalizer, which runs on every stretch of text between added tokens
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tk.normalizer = space
    tk.decoder = decoders.Sequence(steps)
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
                           if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)])
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED])
    return tk.to_str()


@dataclass
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    """Text <-> token ids for one engine, plus its chat template."""

    def __init__(self, tokenizer_json: str | Path, chat_template: str | None,
                 eos_token_ids: tuple[int, ...], bos_token_id: int | None = None,
                 add_bos_token: bool = False):
        from tokenizers import Tokenizer as HFTokenizer

        self._tk = HFTokenizer.from_file(str(tokenizer_json))
        self.chat_template = chat_template
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self._template = None

    @classmethod
    def from_manifest(cls, m: EngineManifest) -> "Tokenizer":
        extra = json.loads((m.resolve(m.tokenizer_path).parent / "tokenizer_meta.json").read_text())
        return cls(m.resolve(m.tokenizer_path), m.chat_template, m.model.eos_token_ids,
                   m.model.bos_token_id, extra.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tk.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages as transformers' `apply_chat_template(tokenize=False)` does."""
        if not self.chat_template:
            raise NoChatTemplate("this model has no chat template (a base model): it continues plain "
                                 "text; send the prompt as is")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos, eos_token=eos)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text chunks without splitting UTF-8 characters.

    Decodes a short window (from `prefix` to the end) and emits only what extends the text the
    window decoded to before, holding back output that ends in an incomplete character (U+FFFD),
    as HF text-generation-inference does.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids or [])[-4:]
        self.prefix = 0
        self.read = len(self.ids)
        self.skip = skip_special_tokens

    def push(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        full_text = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            chunk = full_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return chunk
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        full_text = self.tok.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return full_text[len(prefix_text):]
