"""Text between two vocabularies: bytes into a tokenizer's ids, and a draft's text re-tokenized
into target candidates after the committed text (the string-level step of SLEM, Timor et al.,
ICML 2025, arXiv:2502.05202, Alg. 2).

Boundaries, the two ways re-tokenization goes wrong (docs/hetero-vocab.md):
- enc(a + b) != enc(a) + enc(b). The draft's text is encoded together with a look-behind of the
  last committed target tokens, and the candidates are what follows them, only if the encoding
  reproduces those committed tokens exactly; where it would merge across the committed boundary
  (committed "▁hel" + draft "lo" -> "▁hello") the draft's text is encoded alone instead. The
  committed tokens are never rewritten: candidates start after them.
- the last candidate may be the prefix of a longer target token that more text would form
  ("▁wor" of "▁world"): it is dropped when the map says it can grow.
A candidate whose bytes do not continue the draft's text (a normalizer, an unknown piece) ends
the list.
Knows: bytes, `tokenizers` objects, the vocabulary map's byte tables. Does not know: models, KV.
"""
from __future__ import annotations

from backend.vocab_map import VocabMap

LOOK_BEHIND = 3                 # committed target tokens re-encoded with the draft's text


def utf8_prefix(b: bytes) -> int:
    """Length of the longest prefix of `b` that is valid UTF-8."""
    try:
        b.decode("utf-8")
        return len(b)
    except UnicodeDecodeError as exc:
        return exc.start


def incomplete_tail(b: bytes) -> bool:
    """`b` ends inside a multi-byte character (more bytes would complete it)."""
    i = len(b) - 1
    while i >= 0 and len(b) - i <= 3 and (b[i] & 0xC0) == 0x80:     # continuation bytes
        i -= 1
    if i < 0:
        return False
    lead = b[i]
    need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return len(b) - i < need


def load_encoder(tokenizer_json: str):
    """A `tokenizers` Tokenizer that treats special tokens' text as text (a committed "<|im_end|>"
    written by the target is text to the draft)."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(tokenizer_json)
    tk.encode_special_tokens = True
    return tk


def encode_bytes(encoder, b: bytes, single_bytes: dict[int, int]) -> list[int]:
    """Ids for the bytes `b`: valid UTF-8 runs through the tokenizer, any other byte as the
    vocabulary's token for that byte (stops where it has none)."""
    out, i = [], 0
    while i < len(b):
        n = utf8_prefix(b[i:])
        if n:
            out += encoder.encode(b[i:i + n].decode("utf-8"), add_special_tokens=False).ids
            i += n
        elif b[i] in single_bytes:
            out.append(single_bytes[b[i]])
            i += 1
        else:
            break
    return out


def continues(vm_bytes, ids: list[int], text: bytes) -> list[int]:
    """The longest prefix of `ids` whose bytes spell a prefix of `text`."""
    pos = 0
    for n, t in enumerate(ids):
        b = vm_bytes[t]
        if not b or text[pos:pos + len(b)] != b:
            return ids[:n]
        pos += len(b)
    return ids


def retokenize(encoder, vm: VocabMap, behind_ids: list[int], behind: bytes, text: bytes) -> list[int]:
    """Target candidates for the draft's `text`, which follows committed text ending with the
    target tokens `behind_ids` (bytes `behind`)."""
    text = text[:utf8_prefix(text)]
    if not text:
        return []
    ids = None
    if behind_ids:
        whole = encoder.encode((behind + text).decode("utf-8"), add_special_tokens=False).ids
        if whole[:len(behind_ids)] == list(behind_ids):
            ids = whole[len(behind_ids):]
    if ids is None:                 # merges across the committed boundary: the draft's text alone
        ids = encoder.encode(text.decode("utf-8"), add_special_tokens=False).ids
    ids = continues(vm.target_bytes, ids, text)
    if ids and vm.target_grows[ids[-1]]:
        ids = ids[:-1]
    return ids


def look_behind(vm: VocabMap, ids: list[int], text: bytes, ends: list[int]) -> tuple[list[int], bytes]:
    """The last committed target tokens (at most LOOK_BEHIND, text tokens only, starting on a
    character boundary) and their bytes. ends[i]: byte end of ids[i] in `text`."""
    n = 0
    while n < min(LOOK_BEHIND, len(ids)) and vm.target_bytes[ids[-1 - n]]:
        n += 1
    while n:
        start = ends[-n - 1] if len(ends) > n else 0
        if utf8_prefix(text[start:]) == len(text) - start:
            return list(ids[-n:]), bytes(text[start:])
        n -= 1
    return [], b""
