"""The op references: every branch of a tree equals causal attention over that branch (the
hand-written mask of the design), and the paths input names each node's ancestors."""
import numpy as np

from backend.tree import TokenTree
from plugins.reference import paths_of, tree_attention_ref


def causal(q, k, v, scale):
    """Plain causal attention of the last q.shape[0] positions of a sequence [n, H, D]."""
    n, t = k.shape[0], q.shape[0]
    s = np.einsum("thd,nhd->htn", q.astype(np.float64), k.astype(np.float64)) * scale
    s = np.where(np.arange(n)[None, None, :] <= (n - t + np.arange(t))[None, :, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("htn,nhd->thd", w, v.astype(np.float64))


def test_each_branch_equals_causal_attention_over_the_branch():
    rng = np.random.default_rng(0)
    ctx, h, d = 5, 2, 8
    tree = TokenTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    t = tree.num_nodes
    q = rng.standard_normal((1, t, h, d)).astype(np.float32)
    kc = rng.standard_normal((1, h, ctx + t, d)).astype(np.float32)
    vc = rng.standard_normal((1, h, ctx + t, d)).astype(np.float32)
    paths = paths_of(tree.parents[None])
    out = tree_attention_ref(q, kc, vc, np.array([0]), np.array([ctx]), paths, 0.3)
    for path in tree.paths:
        path = path[path >= 0]
        cols = np.concatenate([np.arange(ctx), ctx + path])
        ref = causal(q[0, path], kc[0][:, cols].transpose(1, 0, 2), vc[0][:, cols].transpose(1, 0, 2), 0.3)
        np.testing.assert_allclose(out[0, path], ref, rtol=1e-6, atol=1e-6)


def test_paths_list_each_nodes_ancestors_by_depth():
    tree = TokenTree.from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    parents = np.concatenate([tree.parents, [-2, -2]])[None]
    paths = paths_of(parents)
    for j in range(tree.num_nodes):
        path = paths[0, j][paths[0, j] >= 0]
        assert path.tolist() == tree.path_to(j).tolist()
    assert (paths[0, -2:] == -1).all()                                   # padding: sees nothing
