"""Hand-written masks, depths, paths and positions for small trees (these double as docs)."""
import numpy as np
import pytest

from backend.kv_cache import KVLayout, PAD_PARENT
from backend.tree import MASK_VALUE, TokenTree


def test_chain():
    t = TokenTree.chain(3)
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert t.depth.tolist() == [0, 1, 2, 3]
    assert t.paths.tolist() == [[0, 1, 2, 3]]
    assert t.ancestor_mask.astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert t.is_chain and t.num_draft_tokens == 3


def test_from_choices_medusa_format():
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    #   |
    #   6
    t = TokenTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.children == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert t.paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    expected = np.array([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1]], bool)
    np.testing.assert_array_equal(t.ancestor_mask, expected)
    bias = t.attn_bias()
    assert bias[6, 3] == 0 and bias[6, 4] == MASK_VALUE
    assert t.path_to(6).tolist() == [0, 1, 3, 6]


def test_invalid_trees_are_refused():
    with pytest.raises(AssertionError):
        TokenTree([0, 0])            # root must have parent -1
    with pytest.raises(AssertionError):
        TokenTree([-1, 2, 0])        # parent after child
    with pytest.raises(ValueError, match="prefix"):
        TokenTree.from_choices([[0, 0]])
    with pytest.raises(ValueError, match="duplicate"):
        TokenTree.from_choices([[0], [0]])


def test_layout_bias_positions_commit_and_padding():
    lay = KVLayout(2, np.array([3, 1]))
    parents = np.array([[-1, 0, 0], [-1, 0, PAD_PARENT]], np.int32)
    bias, pos = lay.forward_inputs(parents)
    assert pos.tolist() == [[3, 4, 4], [1, 2, 1]]
    vis = bias == 0
    # row 0: 3 committed columns, then tree columns (node 2 sees root and itself, not node 1)
    assert vis[0].astype(int).tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]]
    # row 1: one committed column (the other two are padding); a padding node sees only itself
    assert vis[1].astype(int).tolist() == [[1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    lay.append(3)
    lay.commit(0, np.array([0, 2]))
    lay.commit(1, np.array([0, 1]))
    assert lay.lengths.tolist() == [5, 3]
    assert lay.columns(0).tolist() == [0, 1, 2, 3, 5]
    assert lay.columns(1).tolist() == [0, 3, 4]
    lay.truncate(0, 4)
    assert lay.columns(0).tolist() == [0, 1, 2, 3]


def test_scratch_tree_across_forwards():
    """A drafter grows a tree over two forwards; the second level sees only its own ancestors."""
    lay = KVLayout(1, np.array([2]))
    bias, pos = lay.forward_inputs(np.array([[-1, -1]], np.int32))     # two roots' children
    assert pos.tolist() == [[2, 2]]
    lay.append(2)
    bias, pos = lay.forward_inputs(np.array([[0, 1, 2]], np.int32))    # node 4 is a child of node 2
    vis = (bias[0] == 0).astype(int)
    # columns: 2 committed, scratch nodes 0,1 at columns 2,3, then the three new nodes
    assert vis.tolist() == [[1, 1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 0, 1, 0], [1, 1, 1, 0, 1, 0, 1]]
    assert pos.tolist() == [[3, 3, 4]]
    lay.append(3)
    lay.commit(0, np.array([0, 2, 4]))
    assert lay.columns(0).tolist() == [0, 1, 2, 4, 6] and lay.lengths.tolist() == [5]
    assert not lay.has_scratch()
