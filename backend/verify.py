"""Lossless verification of drafted token trees.

Vocabulary (used the same way everywhere in specdec):
  target           the model whose output distribution must be preserved exactly.
  draft            whatever proposes tokens: a draft model, prompt lookup, an EAGLE head.
  root             node 0 of the tree: the last committed token; the target scores it together
                   with the drafted nodes in one forward pass.
  draft tokens     the tree's other nodes.
  accepted tokens  draft tokens the target keeps (a root-to-node path).
  recovered token  the target's token where the path was rejected (no child matched it).
  bonus token      the target's token after the last node of a fully accepted path.
  num_accepted     accepted draft tokens; emitted tokens per step = num_accepted + 1.
  position         a node at depth d predicts the token at sequence position
                   len(prompt_ids) + len(output_ids) + d; its noise is that position's
                   (sampling.PositionNoise).

The rule: at a node of depth d the target's token is y = argmax(p / E) with p the target's
warped distribution after the node's path and E the noise of the node's position, exactly what
plain decoding emits there (sampling.target_token). If a child of the node carries y, the child
is accepted and the walk goes on; otherwise y is emitted (recovered, or bonus at a leaf) and the
step ends. Greedy is the same walk with y = argmax(logits).

Why it is lossless: the emitted token at every position is the target's own sample given the
emitted prefix, drawn with noise that nothing earlier has seen, so the output is plain sampling
itself; drafts only decide how many positions one forward settles. For a point-mass draft
token x (prompt lookup, EAGLE trees, greedy draft models) the chance that it is accepted is
p(x), the acceptance of modified rejection sampling (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318), and for a node with several such children the sum of their
p, the acceptance of recursive rejection sampling over siblings (SpecInfer, arXiv:2305.09781).
A drafter that samples from its own q couples its draw to the same noise (draft token =
argmax(q / E) at that position): accepted with the Gumbel-max coupling probability, at least
(1 - TV(p, q)) / (1 + TV(p, q)), slightly below rejection sampling's 1 - TV(p, q), in exchange
for output that does not depend on the drafter or the draft budget ("drafter-invariant",
Daliri, Musco and Suresh 2024, arXiv:2408.07978). So one seed gives one text, alone or among
other streams, with any drafter and any budget the controller picks.
Knows: one tree, its tokens, target logits, noise per depth. Does not know: models, KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from backend.config import SamplingParams
from backend.sampling import target_token
from backend.tree import TokenTree


@dataclass
class TreeVerdict:
    accepted_nodes: np.ndarray   # [num_accepted + 1] int32, root first: KV to keep
    output_ids: np.ndarray       # [num_accepted + 1] int64: accepted draft tokens + final token
    num_accepted: int
    final_is_bonus: bool         # True: bonus token (path ended at a leaf); False: recovered


NoiseFn = Callable[[int], np.ndarray]     # depth -> [V] Exp(1) noise of that depth's position


def verify_tree(tree: TokenTree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams,
                noise: NoiseFn | None) -> TreeVerdict:
    """Walk the tree from the root, accepting the child that carries the target's token.

    tokens: [num_nodes] int64, tokens[0] is the root token (not tested)
    logits: [num_nodes, V] float32, target logits after each node's path
    noise:  depth -> [V] Exp(1) noise; may be None for greedy params.
    """
    n = tree.num_nodes
    assert tokens.shape == (n,), (tokens.shape, n)
    assert logits.ndim == 2 and logits.shape[0] >= n, (logits.shape, n)
    assert params.greedy or noise is not None, "sampled verification needs noise"
    node, path = 0, [0]
    while True:
        y = target_token(logits[node], params, None if params.greedy else noise(len(path) - 1))
        nxt = next((c for c in tree.children[node] if int(tokens[c]) == y), None)
        if nxt is None:
            return _verdict(tokens, path, y, bonus=not tree.children[node])
        path.append(nxt)
        node = nxt


def _verdict(tokens, path, final: int, bonus: bool) -> TreeVerdict:
    nodes = np.asarray(path, np.int32)
    out = np.concatenate([tokens[nodes[1:]].astype(np.int64), [final]])
    return TreeVerdict(nodes, out, len(path) - 1, bonus)


def pad_verdicts(verdicts: list[TreeVerdict], max_depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fixed-shape batch form: (output_ids [B, max_depth+1], num_accepted [B],
    accepted_nodes [B, max_depth+1]), padded with -1 (static shapes for a GPU kernel)."""
    b = len(verdicts)
    out = np.full((b, max_depth + 1), -1, np.int64)
    nodes = np.full((b, max_depth + 1), -1, np.int32)
    num = np.zeros(b, np.int32)
    for i, v in enumerate(verdicts):
        out[i, : v.output_ids.size] = v.output_ids
        nodes[i, : v.accepted_nodes.size] = v.accepted_nodes
        num[i] = v.num_accepted
    return out, num, nodes
