"""The vocabulary map between a draft model's tokenizer and the target's (issue 28): which draft
tokens are target tokens, compared by the BYTES each one decodes to.

Knows: tokenizer JSON (byte-level BPE's byte-to-character table, SentencePiece's "▁" and <0xNN>
byte tokens, added and special tokens), the map draft id -> target id and its coverage, which
target tokens are a proper prefix of a longer one (a re-tokenized candidate that could still
grow), and the file the build writes and the drafter reads (.npz). Does not know: models,
requests, how a drafter uses the map (drafters/cross_vocab.py).

Why bytes and not strings: HF and vLLM match token strings after swapping the space marker
(Ġ <-> ▁). Byte-level BPE stores a newline as "Ċ" and "é" as "Ã©", so those tokens either drop
out of the intersection or false-match a SentencePiece token that really is the text "Ċ"
(Timor et al., ICML 2025, arXiv:2502.05202, the intersection TLI restricts to;
docs/hetero-vocab.md). Special and control tokens decode to nothing and map to nothing.
When several target tokens decode to the same bytes (Gemma's "\\n" and its byte token
<0x0A>), the map names the one the target itself writes: a normal piece before a byte-fallback
token, then the lowest id. Several draft tokens may map to one target token; a drafter then sums
their probabilities (the pushforward), which `compact` makes one bincount.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of `bytes_to_unicode`)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _decoder_types(node) -> set[str]:
    if not isinstance(node, dict):
        return set()
    out = {node.get("type", "")}
    for child in node.get("decoders") or ():
        out |= _decoder_types(child)
    if node.get("type") == "Replace" and node.get("pattern", {}).get("String") == "\u2581":
        out.add("Metaspace")
    return out


@dataclass
class TokenBytes:
    """What each id of one tokenizer decodes to on its own: bytes, or None (special, control,
    unknown or empty); `is_byte[i]`: a SentencePiece byte-fallback token."""

    table: list[bytes | None]
    is_byte: np.ndarray                   # [V] bool

    @classmethod
    def from_json(cls, tokenizer_json: str) -> "TokenBytes":
        j = json.loads(tokenizer_json)
        model, kinds = j.get("model") or {}, _decoder_types(j.get("decoder"))
        if model.get("type") == "Unigram":
            vocab = {piece: i for i, (piece, _) in enumerate(model["vocab"])}
        elif isinstance(model.get("vocab"), dict):
            vocab = model["vocab"]
        else:
            raise ValueError(f"tokenizer model {model.get('type')!r}: only BPE and Unigram vocabularies are mapped")
        if "ByteLevel" in kinds:
            table = byte_level_table()
            decode = lambda t: bytes(table[c] for c in t) if all(c in table for c in t) else t.encode()
        elif "Metaspace" in kinds or "ByteFallback" in kinds:
            decode = lambda t: t.replace("\u2581", " ").encode()
        else:
            raise ValueError(f"tokenizer decoder {sorted(kinds - {''})}: only byte-level BPE and "
                             "SentencePiece-style vocabularies are mapped")
        added = {a["id"]: a for a in j.get("added_tokens") or ()}
        size = max(max(vocab.values(), default=-1), max(added, default=-1)) + 1
        out: list[bytes | None] = [None] * size
        is_byte = np.zeros(size, bool)
        fallback = "ByteFallback" in kinds
        for tok, i in vocab.items():
            m = _BYTE_TOKEN.match(tok) if fallback else None
            if m:
                out[i], is_byte[i] = bytes([int(m.group(1), 16)]), True
            else:
                out[i] = decode(tok) or None
        for i, a in added.items():            # matched whole in the raw text: their content is text
            out[i] = None if a.get("special") else (a["content"].encode() or None)
            is_byte[i] = False
        return cls(out, is_byte)

    def padded(self, size: int) -> "TokenBytes":
        """As many entries as the model's logits (a checkpoint may pad its vocabulary past the
        tokenizer's ids: those rows decode to nothing)."""
        n = max(size, len(self.table))
        return TokenBytes(self.table + [None] * (n - len(self.table)),
                          np.concatenate([self.is_byte, np.zeros(n - self.is_byte.size, bool)]))


def _blob(table: list[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    """Byte strings as one uint8 array and [V + 1] offsets (None: a negative length marker)."""
    lengths = np.array([-1 if b is None else len(b) for b in table], np.int64)
    off = np.zeros(len(table) + 1, np.int64)
    off[1:] = np.cumsum(np.maximum(lengths, 0))
    blob = np.frombuffer(b"".join(b for b in table if b), np.uint8)
    return blob, np.where(lengths < 0, -1, off[:-1]), off


def _unblob(blob: np.ndarray, starts: np.ndarray, off: np.ndarray) -> list[bytes | None]:
    raw = blob.tobytes()
    return [None if s < 0 else raw[s:e] for s, e in zip(starts.tolist(), off[1:].tolist())]


def grows(table: list[bytes | None]) -> np.ndarray:
    """[V] bool: token i's bytes are a proper prefix of another token's. In sorted order every
    string that starts with P follows P directly, so one look at the next distinct string says."""
    distinct = sorted({b for b in table if b})
    prefixes = {a for a, b in zip(distinct, distinct[1:]) if b.startswith(a)}
    return np.array([b in prefixes for b in table], bool)


@dataclass
class VocabMap:
    """Draft id -> target id (-1: no target token decodes to its bytes), both byte tables, the
    target tokens that can grow, and the draft tokenizer's BOS rule (its prompt starts with it)."""

    to_target: np.ndarray                 # [Vd] int32
    draft_bytes: list[bytes | None]       # Vd entries
    target_bytes: list[bytes | None]      # Vt entries
    target_grows: np.ndarray              # [Vt] bool
    draft_bos: int = -1                   # the draft's BOS id where its tokenizer adds one, else -1

    @classmethod
    def build(cls, draft: TokenBytes, target: TokenBytes, draft_bos: int = -1) -> "VocabMap":
        best: dict[bytes, int] = {}
        for i, b in enumerate(target.table):
            if b is None:
                continue
            j = best.get(b)       # a normal piece over a byte-fallback token, then the lowest id
            if j is None or (target.is_byte[j] and not target.is_byte[i]):
                best[b] = i
        to_target = np.array([-1 if b is None else best.get(b, -1) for b in draft.table], np.int32)
        return cls(to_target, draft.table, target.table, grows(target.table), draft_bos)

    def coverage(self) -> dict:
        """What the manifest records: draft tokens, those with text, those mapped (and their share
        of the draft's text tokens), distinct target tokens reached, target tokens reached by
        more than one draft token (whose draft probabilities are summed)."""
        text = sum(b is not None for b in self.draft_bytes)
        mapped = self.to_target[self.to_target >= 0]
        counts = np.bincount(mapped, minlength=1)
        return {"draft_tokens": len(self.draft_bytes), "draft_text_tokens": text, "mapped": int(mapped.size),
                "share": round(mapped.size / max(1, text), 4), "target_tokens": len(self.target_bytes),
                "target_reached": int(np.count_nonzero(counts)), "many_to_one": int(np.count_nonzero(counts > 1))}

    # --- derived, for the drafter -------------------------------------------------------------
    @cached_property
    def union(self) -> np.ndarray:
        """[U] int64 sorted target ids some draft token maps to (the intersection, target side)."""
        return np.unique(self.to_target[self.to_target >= 0]).astype(np.int64)

    @cached_property
    def compact(self) -> np.ndarray:
        """[Vd] int64: draft id -> index into `union` (-1: outside), for summing by bincount."""
        out = np.full(self.to_target.size, -1, np.int64)
        m = self.to_target >= 0
        out[m] = np.searchsorted(self.union, self.to_target[m])
        return out

    @cached_property
    def mapped(self) -> np.ndarray:
        """[M] int64 draft ids that are target tokens."""
        return np.flatnonzero(self.to_target >= 0)

    def pushforward(self, q: np.ndarray) -> np.ndarray:
        """[U] float64: a draft distribution q [Vd] carried to the intersection's target tokens,
        each the sum of q over the draft tokens that are it."""
        return np.bincount(self.compact[self.mapped], q[self.mapped], minlength=self.union.size)

    @cached_property
    def noise_index(self) -> np.ndarray:
        """[Vd] int64: the target noise entry a draft token draws with: its target token's, or
        for a token outside the intersection one of the target ids no draft token maps to
        (independent Exp(1) values; reused round-robin if there are too few)."""
        out = self.to_target.astype(np.int64)
        free = np.setdiff1d(np.arange(len(self.target_bytes)), self.union)
        outside = np.flatnonzero(out < 0)
        if outside.size:
            pool = free if free.size else np.arange(len(self.target_bytes))
            out[outside] = pool[np.arange(outside.size) % pool.size]
        return out

    @cached_property
    def single_bytes(self) -> dict[int, int]:
        """byte value -> a draft token that is exactly that byte (to feed bytes that are not text)."""
        out: dict[int, int] = {}
        for i, b in enumerate(self.draft_bytes):
            if b is not None and len(b) == 1:
                out.setdefault(b[0], i)
        return out

    # --- the file -----------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        db, ds, do = _blob(self.draft_bytes)
        tb, ts, to = _blob(self.target_bytes)
        np.savez(path, to_target=self.to_target, target_grows=self.target_grows, draft_bos=self.draft_bos,
                 draft_blob=db, draft_starts=ds, draft_off=do, target_blob=tb, target_starts=ts, target_off=to)

    @classmethod
    def load(cls, path: Path) -> "VocabMap":
        z = np.load(path)
        return cls(z["to_target"], _unblob(z["draft_blob"], z["draft_starts"], z["draft_off"]),
                   _unblob(z["target_blob"], z["target_starts"], z["target_off"]), z["target_grows"],
                   int(z["draft_bos"]))
