"""Lossless verification of drafted token trees: speculative (rejection) sampling.

Vocabulary (used the same way everywhere in specdec):
  target           the model whose output distribution must be preserved exactly.
  draft            whatever proposes tokens: a draft model, prompt lookup, an EAGLE head.
  root             node 0 of the tree: the last committed token; the target scores it together
                   with the drafted nodes in one forward pass.
  draft tokens     the tree's other nodes; `q` is the distribution a node was drawn from.
  accepted tokens  draft tokens the target keeps (a root-to-node path).
  recovered token  sampled from the residual distribution where the path was rejected.
  bonus token      sampled from the target after the last node of a fully accepted path.
  num_accepted     accepted draft tokens; emitted tokens per step = num_accepted + 1.

Chains: Leviathan et al. 2023 (arXiv:2211.17192) and Chen et al. 2023 (arXiv:2302.01318):
accept draft token x with probability min(1, p(x)/q(x)); on rejection sample from
norm(max(0, p - q)); after a fully accepted chain sample a bonus token from p.

Trees (several candidates under one node): recursive rejection sampling over the siblings
(SpecInfer, Miao et al. 2024, arXiv:2305.09781; RRS, Jeon et al. 2024, arXiv:2402.14160).
Sibling i is tested against the current residual p_i with the distribution q_i it was drawn
from; on rejection p_{i+1} = norm(max(0, p_i - q_i)). For siblings drawn i.i.d. (with
replacement) q_i = q; drawn without replacement q_i is q with the earlier siblings removed and
renormalised. Whatever q_i is, conditioned on everything before, the residual chain outputs
exactly p, so the scheme is lossless. A deterministic drafter (prompt lookup, top-k trees) has
q_i = point mass on its token: accept with probability p_i(x), else remove x from p_i.

Greedy (temperature 0) is the special case p = one-hot(argmax): accept while the draft token
equals the target's argmax. Randomness is an input (uniforms per node, exponential noise for the
final sample), drawn by the caller from the request's generator.
Knows: one tree, its tokens, target logits, draft distributions. Does not know: models, KV.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backend.config import SamplingParams
from backend.sampling import sample, target_probs
from backend.tree import TokenTree


@dataclass
class TreeVerdict:
    accepted_nodes: np.ndarray   # [num_accepted + 1] int32, root first: KV to keep
    output_ids: np.ndarray       # [num_accepted + 1] int64: accepted draft tokens + final token
    num_accepted: int
    final_is_bonus: bool         # True: bonus token (path ended at a leaf); False: recovered


@dataclass
class Noise:
    uniforms: np.ndarray         # [num_nodes] float64 in [0, 1): acceptance test of node i
    exponentials: np.ndarray     # [V] float64 Exp(1): the final (recovered/bonus) sample

    @classmethod
    def draw(cls, rng: np.random.Generator, num_nodes: int, vocab: int) -> "Noise":
        return cls(rng.random(num_nodes), rng.standard_exponential(vocab))


def verify_tree(tree: TokenTree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams,
                noise: Noise | None, draft_probs: np.ndarray | None = None,
                without_replacement: bool = False) -> TreeVerdict:
    """Walk the tree from the root accepting nodes losslessly.

    tokens:      [num_nodes] int64, tokens[0] is the root token (not tested)
    logits:      [num_nodes, V] float32, target logits after each node's path
    draft_probs: [num_nodes, V] float (row i = q that node i was drawn from, before any sibling
                 exclusion), or None for a deterministic drafter (point masses).
    noise:       may be None for greedy params.
    """
    n = tree.num_nodes
    assert tokens.shape == (n,), (tokens.shape, n)
    assert logits.ndim == 2 and logits.shape[0] >= n, (logits.shape, n)
    assert draft_probs is None or draft_probs.shape[0] >= n, (draft_probs.shape, n)
    if params.greedy:
        return _verify_greedy(tree, tokens, logits)
    assert noise is not None, "sampled verification needs noise"
    return verify_sampled(tree, tokens, lambda node: target_probs(logits[node], params), noise,
                          draft_probs, without_replacement)


def verify_sampled(tree: TokenTree, tokens: np.ndarray, target_p, noise: Noise,
                   draft_probs: np.ndarray | None, without_replacement: bool) -> TreeVerdict:
    """Recursive rejection sampling; target_p(node) -> [V] warped target probabilities."""
    node, path = 0, [0]
    while True:
        residual = target_p(node)
        children = tree.children[node]
        chosen = None
        for i, c in enumerate(children):
            x = int(tokens[c])
            if draft_probs is None:
                q, q_x = None, 1.0                                   # point mass on x
            else:
                q = draft_probs[c]
                if without_replacement and i:
                    q = q.copy()
                    q[tokens[children[:i]]] = 0.0
                    mass = q.sum()
                    if mass <= 0.0:
                        continue                 # q_i has no mass left: x could not be drawn
                    q /= mass
                q_x = q[x]
            if q_x > 0.0 and noise.uniforms[c] * q_x < residual[x]:  # u < p_i(x) / q_i(x)
                chosen = c
                break
            residual = _residual(residual, q, x)
        if chosen is None:
            return _verdict(tokens, path, sample(residual, noise.exponentials), bonus=not children)
        path.append(chosen)
        node = chosen


def _residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """norm(max(0, p - q)); q None = point mass on x."""
    if q is None:
        r = p.copy()
        r[x] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    s = r.sum()
    # s == 0 only if p <= q everywhere, i.e. p == q, where rejection has probability 0.
    return r / s if s > 0 else p


def _verify_greedy(tree: TokenTree, tokens: np.ndarray, logits: np.ndarray) -> TreeVerdict:
    node, path = 0, [0]
    while True:
        best = int(np.argmax(logits[node]))
        nxt = next((c for c in tree.children[node] if int(tokens[c]) == best), None)
        if nxt is None:
            return _verdict(tokens, path, best, bonus=not tree.children[node])
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
