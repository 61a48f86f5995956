"""The prefix cache's policy: which full blocks of prompt tokens have their KV kept, under which
key, what a new request can reuse, and what is evicted when the memory budget is full.

A block is `block` consecutive prompt tokens starting at a multiple of `block`. Its key is a
hash of its parent's key and its own tokens (vLLM's automatic prefix caching), so a key names
the whole prefix up to the block's end: a block is reused only after exactly the same tokens,
and a prompt that repeats one block is as many different keys as blocks. The entry keeps its
tokens and its parent's key too, and a lookup compares them, so a hash collision cannot hand a
request another prompt's KV.

    attach(seq_id, tokens)    the longest cached chain of the prompt's blocks (never its last
                              token: the prefill must produce that token's logits), copied into
                              the sequence's KV by the storage; the chain is pinned until
    publish(seq_id, tokens)   the prompt's full blocks the cache lacks are copied out of the
                              sequence's KV (the prompt is prefilled); the pins are released
    release(seq_id)           a sequence that ends before publishing drops its pins

Blocks in use (pinned: a sequence between attach and publish) are never evicted. Otherwise the
least recently used block goes first. A chain is touched deepest block first and its root last,
so a parent is always more recent than its children: eviction takes leaves before their parents
and never strands a child no lookup can reach (a lookup walks from the root).

The copies make a hit independent of the cache afterwards: a sequence's KV is its own, so a
block evicted while the sequence runs changes nothing for it. Targets' features (`hidden`,
what an EAGLE head or Medusa reads) ride along where the publishing request had them, counted
in the budget; a lookup that needs them stops at the first block without.

The storage (`BlockStorage`) is the runtime's: a pool of `capacity` block-sized entries beside
its KV slots (runtime/slot_blocks.py), allocated once from the budget.

A listener (`BlockEvents`, `events`) hears every block the cache keeps and every block it lets
go, once each: a chain of new blocks after its copy succeeded (their keys, tokens and the key of
the block before them), a block's key when it is evicted. That is what a KV-aware router needs
to know which node holds a prompt's prefix (backend/kv_events.py publishes it in vLLM's
KV-event format).
Knows: blocks, keys, pins, recency, bytes. Does not know: tensors, devices, models.
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

BLOCK_TOKENS = 16          # vLLM's default block; TensorRT-LLM's tokens_per_block is 32-64
ROOT_KEY = b"specdec-prefix-v1"


def block_keys(tokens, block: int, limit: int | None = None, root: bytes = ROOT_KEY) -> list[bytes]:
    """The chain keys of the first full blocks of `tokens` (at most `limit`): key_i =
    blake2b(key_{i-1} || block i's tokens as int64)."""
    n = len(tokens) // block if limit is None else min(limit, len(tokens) // block)
    ids = np.asarray(tokens[: n * block], np.int64).reshape(n, block)
    keys, parent = [], root
    for row in ids:
        parent = hashlib.blake2b(parent + row.tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


def chain_root(tag: bytes, *tokens: int) -> bytes:
    """A chain's first parent for KV that depends on more than its own tokens (an EAGLE head's
    column j reads the target's features of token j and the token j + 1: its chain runs over
    the prompt from the second token, rooted at the first)."""
    return hashlib.blake2b(ROOT_KEY + tag + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class BlockStorage(Protocol):
    """A runtime's side: KV of whole blocks between its slots and a pool of block entries."""

    def block_bytes(self, block: int) -> int:
        """Bytes of one block's KV (every layer, K and V)."""

    def allocate(self, capacity: int, block: int) -> None:
        """The pool: `capacity` entries of one block each."""

    def save(self, seq_id: int, first_block: int, handles: list[int]) -> None:
        """The sequence's KV of blocks first_block, first_block + 1, ... -> pool entries `handles`."""

    def load(self, seq_id: int, handles: list[int]) -> None:
        """Pool entries `handles` -> the sequence's first len(handles) blocks, which become its
        committed prefix (the sequence holds nothing yet)."""


class BlockEvents(Protocol):
    """A listener to what the cache holds (called from the thread that uses the cache)."""

    def stored(self, parent: bytes | None, blocks: list[tuple[bytes, bytes]]) -> None:
        """A chain of blocks kept: (key, token ids as int64 bytes) in order; `parent` is the key
        of the block before the first (None: the first follows the root)."""

    def removed(self, keys: list[bytes]) -> None:
        """Blocks evicted (each one announced by `stored` before)."""


@dataclass
class _Entry:
    key: bytes
    parent: bytes
    tokens: bytes                        # the block's token ids, int64 bytes
    handle: int                          # the storage's pool entry
    hidden: np.ndarray | None = None     # [block, W] target features, when a publisher had them
    pins: int = 0
    announced: bool = False              # told to `events` (so its eviction is told too)


@dataclass
class PrefixStats:
    """Counters since the cache was made (metrics.py publishes their increments)."""

    lookups: int = 0            # sequences looked up
    lookup_tokens: int = 0      # prompt tokens they brought
    hits: int = 0               # sequences that reused at least one block
    hit_tokens: int = 0         # prompt tokens reused
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    bytes: int = 0              # held now (KV and features)
    capacity_bytes: int = 0     # the budget the pool was sized from


@dataclass
class PrefixHit:
    tokens: int                              # prompt tokens now in the sequence's KV
    hidden: np.ndarray | None = None         # [tokens, W] their target features (when asked)


class PrefixCache:
    def __init__(self, storage: BlockStorage, budget_bytes: int, block: int = BLOCK_TOKENS):
        assert block > 0 and budget_bytes >= 0, (block, budget_bytes)
        self.storage, self.block = storage, block
        self.block_bytes = storage.block_bytes(block)
        self.budget = int(budget_bytes)
        self.capacity = self.budget // self.block_bytes          # pool entries: a block's KV each
        if self.capacity:
            storage.allocate(self.capacity, block)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._lru: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()   # oldest first
        self._pins: dict[int, list[_Entry]] = {}
        self.stats = PrefixStats(capacity_bytes=self.capacity * self.block_bytes)
        self.events: BlockEvents | None = None

    def __len__(self) -> int:
        return len(self._lru)

    # --- a sequence's life ---------------------------------------------------------------------
    def attach(self, seq_id: int, tokens, need_hidden: bool = False, root: bytes = ROOT_KEY) -> PrefixHit:
        """Copy the longest cached chain of `tokens`' blocks (leaving at least the last token to
        prefill) into the sequence's KV and pin it; need_hidden: only blocks with features.
        root: the chain's first parent (what the tokens' KV depends on beyond the tokens)."""
        assert seq_id not in self._pins, f"sequence {seq_id} attached twice"
        chain = []
        for key in block_keys(tokens, self.block, (len(tokens) - 1) // self.block, root):
            e = self._lru.get(key)
            i = len(chain)
            want = np.asarray(tokens[i * self.block: (i + 1) * self.block], np.int64).tobytes()
            if e is None or e.tokens != want or e.parent != (chain[-1].key if chain else root) or \
                    (need_hidden and e.hidden is None):
                break
            chain.append(e)
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        self._pins[seq_id] = chain
        if not chain:
            return PrefixHit(0)
        for e in chain:
            e.pins += 1
        self._touch(chain)
        self.storage.load(seq_id, [e.handle for e in chain])
        n = len(chain) * self.block
        self.stats.hits += 1
        self.stats.hit_tokens += n
        return PrefixHit(n, np.concatenate([e.hidden for e in chain]) if need_hidden else None)

    def publish(self, seq_id: int, tokens, hidden: np.ndarray | None = None, root: bytes = ROOT_KEY) -> int:
        """The sequence holds `tokens` in its KV (hidden: [len, W] their features, or None):
        keep its full blocks the cache lacks, while the budget allows; release its pins.
        -> blocks copied."""
        chain: list[_Entry] = []                 # the prompt's chain, pinned while it is built
        new: list[tuple[int, _Entry]] = []       # (block index, entry) to copy into
        failed = False
        try:
            parent = root
            for i, key in enumerate(block_keys(tokens, self.block, root=root)):
                ids = np.asarray(tokens[i * self.block: (i + 1) * self.block], np.int64).tobytes()
                feats = None if hidden is None else np.ascontiguousarray(
                    hidden[i * self.block: (i + 1) * self.block], np.float32)
                e = self._lru.get(key)
                if e is None:
                    e = self._insert(key, parent, ids, feats)
                    if e is None:
                        break                                   # pinned blocks fill the budget
                    new.append((i, e))
                elif e.tokens != ids or e.parent != parent:
                    break                                       # a hash collision: keep the first
                e.pins += 1
                chain.append(e)
                if feats is not None and e.hidden is None and self._make_room(feats.nbytes):
                    e.hidden = feats
                    self.stats.bytes += feats.nbytes
                parent = key
            self._save(seq_id, new)
            self._announce(chain, new)
        except BaseException:
            failed = True
            raise
        finally:
            for e in chain:
                e.pins -= 1
            for _, e in new if failed else ():                  # never keep a block not copied
                self._evict(e)
            self._touch(chain)
            self.release(seq_id)
        return len(new)

    def _save(self, seq_id: int, new: list[tuple[int, _Entry]]) -> None:
        """Copy the new blocks, one storage call per run of consecutive blocks."""
        start = 0
        for j in range(1, len(new) + 1):
            if j == len(new) or new[j][0] != new[j - 1][0] + 1:
                self.storage.save(seq_id, new[start][0], [e.handle for _, e in new[start:j]])
                start = j

    def _announce(self, chain: list[_Entry], new: list[tuple[int, _Entry]]) -> None:
        """Tell `events` of the new blocks, one call per run of consecutive blocks (a block
        between runs was cached already: the next run's parent)."""
        if self.events is None:
            return
        start = 0
        for j in range(1, len(new) + 1):
            if j == len(new) or new[j][0] != new[j - 1][0] + 1:
                first = new[start][0]
                parent = chain[first - 1].key if first else None
                self.events.stored(parent, [(e.key, e.tokens) for _, e in new[start:j]])
                for _, e in new[start:j]:
                    e.announced = True
                start = j

    def release(self, seq_id: int) -> None:
        for e in self._pins.pop(seq_id, []):
            e.pins -= 1

    def clear(self) -> None:
        """Drop every unpinned block (an operator's reset; tests)."""
        for e in [e for e in self._lru.values() if not e.pins]:
            self._evict(e)

    # --- inside --------------------------------------------------------------------------------
    def _insert(self, key: bytes, parent: bytes, ids: bytes, feats: np.ndarray | None) -> _Entry | None:
        extra = 0 if feats is None else feats.nbytes
        if not self._make_room(self.block_bytes + extra, handle=True):
            return None
        e = _Entry(key, parent, ids, self._free.pop(), feats)
        self._lru[key] = e
        self.stats.bytes += self.block_bytes + extra
        self.stats.inserted_blocks += 1
        return e

    def _make_room(self, nbytes: int, handle: bool = False) -> bool:
        """Evict least recently used unpinned blocks until `nbytes` more fit the budget (and a
        pool entry is free, if `handle`); False if pinned blocks leave no room."""
        while self.stats.bytes + nbytes > self.budget or (handle and not self._free):
            victim = next((e for e in self._lru.values() if not e.pins), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, e: _Entry) -> None:
        del self._lru[e.key]
        self._free.append(e.handle)
        self.stats.bytes -= self.block_bytes + (0 if e.hidden is None else e.hidden.nbytes)
        self.stats.evicted_blocks += 1
        if e.announced and self.events is not None:
            self.events.removed([e.key])

    def _touch(self, chain: list[_Entry]) -> None:
        """Most recent: the chain, its root last (a parent stays more recent than its children)."""
        for e in reversed(chain):
            if e.key in self._lru:
                self._lru.move_to_end(e.key)
