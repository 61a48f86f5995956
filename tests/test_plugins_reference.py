"""The tree-attention reference: every branch of a tree equals causal attention over that branch."""
import numpy as np

from backend.kv_cache import KVLayout
from backend.tree import TokenTree
from plugins.reference import tree_attention_ref


def test_each_branch_equals_causal_attention_over_the_branch():
    rng = np.random.default_rng(0)
    past, hq, hkv, d = 5, 4, 2, 8
    tree = TokenTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    t = tree.num_nodes
    q = rng.standard_normal((1, hq, t, d)).astype(np.float32)
    k = rng.standard_normal((1, hkv, past + t, d)).astype(np.float32)
    v = rng.standard_normal((1, hkv, past + t, d)).astype(np.float32)
    bias, _ = KVLayout(1, np.array([past])).forward_inputs(tree.parents[None])
    out = tree_attention_ref(q, k, v, bias)
    for path in tree.paths:
        path = path[path >= 0]
        cols = np.concatenate([np.arange(past), past + path])
        causal = np.where(np.tril(np.ones((path.size, cols.size)), past) > 0, 0, -1e30).astype(np.float32)
        ref = tree_attention_ref(q[:, :, path], k[:, :, cols], v[:, :, cols], causal[None])
        np.testing.assert_allclose(out[:, :, path], ref, rtol=1e-6, atol=1e-6)
