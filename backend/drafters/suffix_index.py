"""The suffix structures of suffix decoding (Oliaro et al., "SuffixDecoding", 2024,
arXiv:2411.04975; vLLM's `suffix` method over Arctic Inference's SuffixTree): which tokens followed
the current context elsewhere in this request's text and in earlier requests' texts, and how often.

A `SuffixTrie` of depth D holds every window text[i:i+D] of each text it is given as a path from
its root; a node counts the windows through it, which is the number of occurrences of its path.
Paths that occurred once are not spelled out: a *tail* node stands for the rest of its single
occurrence's window (a reference into that text, as a suffix tree's leaf edge does), and opens
up one level when a second occurrence reaches it. So the trie holds a node per repeated path
and about one per position, not D per position (a 4k-token text: ~9k nodes, not 130k).

A text grows one token at a time. Its suffixes that occurred before (at most the longest match
+ 1 of them, each an explicit node, kept as `active`) take one child step each; the longer ones
are inside their own tails and need nothing. So a token costs O(longest match) node steps,
whatever the history's length, and `active` also tells the longest suffix that occurred before.
Removing a text walks its windows down to its own tails with the counts going down (nodes
reaching 0 are unlinked), so a bounded store (`SuffixStore`) drops its oldest texts exactly.

`grow_tree` proposes from one or more tries at once (a request's own trie and the store's): the
continuations of a matched suffix, their counts summed over the tries, grown best first by path
probability (each step's count over its siblings' total, multiplied down the path) down to
`min_prob`; the nodes are the `size` most probable continuations, ties broken by the token path,
so the result is a pure function of the counts (tests/test_suffix.py checks counts, matches and
trees against brute force over the texts).

Knows: tokens, counts, tree shapes. Does not know: requests, models, the decode step.
"""
from __future__ import annotations

import heapq
from collections import deque


class _Node:
    """Explicit (`kids` a dict, `ref` None) or a tail: one occurrence, whose next tokens are
    ref[pos:pos + room] (as far as that text goes; room: depth left in its window)."""

    __slots__ = ("count", "kids", "ref", "pos", "room")

    def __init__(self, count: int = 0, ref: list | None = None, pos: int = 0, room: int = 0):
        self.count = count                    # occurrences of the path (windows through it)
        self.kids: dict[int, _Node] | None = {} if ref is None else None
        self.ref, self.pos, self.room = ref, pos, room

    def open(self) -> None:
        """A tail reached by a second occurrence becomes explicit: its occurrence's next token
        becomes a tail of its own."""
        ref, pos, room = self.ref, self.pos, self.room
        self.ref, self.kids = None, {}
        if room > 0 and pos < len(ref):
            self.kids[ref[pos]] = _Node(1, ref, pos + 1, room - 1)

    def has_next(self) -> bool:
        if self.kids is not None:
            return bool(self.kids)
        return self.room > 0 and self.pos < len(self.ref)


class SuffixTrie:
    def __init__(self, depth: int):
        assert depth >= 2, depth
        self.depth = depth
        self.root = _Node()

    def start(self) -> list[_Node]:
        """The active nodes of an empty text (just the root)."""
        return [self.root]

    def extend(self, text: list, active: list[_Node], tokens) -> list[_Node]:
        """Append `tokens` to `text` (a list this trie's tails may point into) whose active nodes
        are `active` -> its new active nodes (active[j]: the explicit node of its last j tokens,
        for every j up to the longest suffix that occurred before, j < depth). Only the text
        given last may grow: another text opening the tail at a growing text's end could not
        know its next token (a request's trie holds its one text; the store, finished ones)."""
        root, depth = self.root, self.depth
        for t in tokens:
            text.append(t)
            nxt = [root]
            for j, node in enumerate(active):
                child = node.kids.get(t)
                if child is None:             # a new path: it, and every longer one, a tail
                    node.kids[t] = _Node(1, text, len(text), depth - j - 1)
                    continue
                if child.ref is not None:
                    child.open()
                child.count += 1
                nxt.append(child)
            if len(nxt) > depth:
                nxt.pop()
            active = nxt
        return active

    def remove(self, text) -> None:
        """Take out a whole text added with extend(text, start(), ...)."""
        depth, n = self.depth, len(text)
        for i in range(n):
            node = self.root
            for j in range(i, min(i + depth, n)):
                t = text[j]
                child = node.kids[t]
                child.count -= 1
                if child.ref is not None or not child.count:   # its own tail, or its last use:
                    assert child.ref is None or (child.ref is text and not child.count), (i, j)
                    del node.kids[t]                           # the rest of the window is in it
                    break
                node = child

    def find(self, path) -> _Node | None:
        """The node of `path` (a transient tail where it ends inside one), or None."""
        node = self.root
        for i, t in enumerate(path):
            if node.kids is None:             # inside a tail: the rest must be its text
                rest = len(path) - i
                if rest > node.room or list(node.ref[node.pos:node.pos + rest]) != list(path[i:]):
                    return None
                return _Node(1, node.ref, node.pos + rest, node.room - rest)
            node = node.kids.get(t)
            if node is None:
                return None
        return node

    def longest_match(self, context: list[int], max_len: int) -> tuple[int, _Node | None]:
        """(m, node): the longest suffix of `context` (m <= max_len) followed by some token here.
        Binary search: a suffix followed by a token means every shorter one is too."""
        lo, hi, best = 0, min(max_len, len(context)), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.find(context[len(context) - mid:])
            if node is not None and node.has_next():
                lo, best = mid, node
            else:
                hi = mid - 1
        return lo, best


class SuffixStore:
    """The global trie: texts of finished requests, at most `budget` tokens, oldest dropped first."""

    def __init__(self, depth: int, budget: int):
        self.trie = SuffixTrie(depth)
        self.budget = budget
        self.texts: deque[list[int]] = deque()
        self.tokens = 0
        self.version = 0                      # changes with every add (matches cached on it)

    def add(self, tokens) -> None:
        tokens = list(tokens)[-self.budget:] if self.budget > 0 else []
        if not tokens:
            return
        while self.texts and self.tokens + len(tokens) > self.budget:
            old = self.texts.popleft()
            self.trie.remove(old)
            self.tokens -= len(old)
        text: list[int] = []
        self.trie.extend(text, self.trie.start(), tokens)
        self.texts.append(text)
        self.tokens += len(text)
        self.version += 1


def children(nodes: tuple) -> list[tuple[int, int, tuple]]:
    """Continuations of a tuple of nodes (one per trie, None where a trie has none), their counts
    summed -> [(token, count, child nodes)]."""
    merged: dict[int, list] = {}
    n = len(nodes)
    for i, node in enumerate(nodes):
        if node is None:
            continue
        if node.kids is not None:
            kids = node.kids.items()
        elif node.room > 0 and node.pos < len(node.ref):
            kids = ((node.ref[node.pos], _Node(1, node.ref, node.pos + 1, node.room - 1)),)
        else:
            continue
        for t, kid in kids:
            e = merged.get(t)
            if e is None:
                e = merged[t] = [0, [None] * n]
            e[0] += kid.count
            e[1][i] = kid
    return [(t, c, tuple(k)) for t, (c, k) in merged.items()]


def share(count: int, total: int, context: int) -> float:
    """The probability that a continuation seen `count` times of `total` after a `context`-token
    match comes next: its share, discounted as if one more, unseen continuation had been seen
    1/context times. A short match predicts poorly even when all its occurrences agree
    (measured on the benchmark prompts: a first token after a 1-2 token match was accepted
    0.3-0.7 of the time, after 8+ tokens 0.8-1.0), a long one well."""
    return count / (total + 1.0 / context)


def grow_tree(nodes: tuple, match: int, size: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """The `size` most probable continuations under `nodes` (a `match`-token suffix) with
    probability >= min_prob, as a tree -> (parents, tokens, probabilities), root excluded:
    parents index the drafted nodes with -1 for the root (the root's children are the matched
    suffix's continuations). A path's probability is the product of its steps' `share`."""
    parents: list[int] = []
    tokens: list[int] = []
    probs: list[float] = []
    heap: list = []

    def push(index: int, state: tuple, prob: float, path: tuple) -> None:
        kids = children(state)
        total = sum(c for _, c, _ in kids)
        for t, c, st in kids:
            p = prob * share(c, total, match + len(path))
            if p >= min_prob:
                heapq.heappush(heap, (-p, path + (t,), index, st))

    push(-1, nodes, 1.0, ())
    while heap and len(tokens) < size:
        neg_p, path, parent, state = heapq.heappop(heap)
        parents.append(parent)
        tokens.append(path[-1])
        probs.append(-neg_p)
        push(len(tokens) - 1, state, -neg_p, path)
    return parents, tokens, probs


def best_chain(nodes: tuple, match: int, size: int, min_prob: float) -> list[int]:
    """The most probable single continuation (the top child at every step, ties to the smaller
    token), while its probability stays >= min_prob, at most `size` tokens."""
    chain, prob = [], 1.0
    while len(chain) < size:
        kids = children(nodes)
        if not kids:
            break
        total = sum(c for _, c, _ in kids)
        t, c, nodes = min(kids, key=lambda k: (-k[1], k[0]))
        prob = prob * share(c, total, match + len(chain))
        if prob < min_prob:
            break
        chain.append(t)
    return chain
