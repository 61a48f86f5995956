"""The TensorRT engine graph (each layer's attention one `specdec::tree_attention` node, the
verification a `specdec::rejection_sample` node) on ONNX Runtime's CPU provider with the ops
implemented by the numpy references: its logits equal the standard CPU graph's to 1e-4 over
prefill chains, single steps, chain verifies, branching trees and padded batches, and its
rejection_sample equals backend/verify.py on the standard graph's logits."""
import onnx
import pytest

pytest.importorskip("onnxruntime_extensions")

from backend.buildlib.graph import GraphSpec, build_decoder  # noqa: E402
from backend.manifest import WeightFormat  # noqa: E402
from backend.bench import engine_check  # noqa: E402
from conftest import make_tiny_checkpoint  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_graph_equals_the_standard_graph_on_random_weights(seed):
    r = engine_check.compare(seed=seed)
    assert r["cases"] == 7 and r["max_abs_err"] < 1e-4 and r["verify_equal"], r


def test_engine_graph_of_a_real_checkpoint_layout(tmp_path):
    """A Hugging Face checkpoint (tied embeddings, GQA) through the loader, as the build reads it."""
    pytest.importorskip("torch")
    from backend.buildlib.checkpoint import load_checkpoint

    ck = load_checkpoint(make_tiny_checkpoint(tmp_path / "ckpt", seed=5))
    r = engine_check.compare(ck)
    assert r["max_abs_err"] < 1e-4 and r["verify_equal"], r


def test_the_engine_graph_holds_plugin_nodes_and_no_cache_wide_mask():
    ck = engine_check.random_checkpoint()
    model = build_decoder(ck, GraphSpec(WeightFormat.FP32, ck.config.num_layers, 128, plugins=True))
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert ops.count(("specdec", "tree_attention")) == ck.config.num_layers
    assert ops.count(("specdec", "rejection_sample")) == 1
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert "attn_bias" not in inputs and inputs["paths"] == ["B", "T", "P"]
    assert "specdec" in {o.domain for o in model.opset_import}
    onnx.checker.check_model(model)
