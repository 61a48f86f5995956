"""The engine graph: the decoder of graph.py with each layer's attention as one node
`specdec::tree_attention` and the verification at the end as `specdec::rejection_sample`, the
graph TensorRT builds (it maps a node of domain `specdec` to the plugin `specdec::<op>`).

Extra inputs (B rows, T new nodes, P deepest path, S KV slots, L columns):
    slots [B] int32, ctx_len [B] int32     each row's KV slot and committed columns
    n_prior [B] int32                      scratch nodes already in the slot before this forward
    paths [B, T, P] int32                  each node's path by depth, scratch indices (-1 after)
    k_cache_i / v_cache_i [S, Hkv, L, D]   layer i's KV slots (the runtime's buffers)
    parents [B, T] int32, temperature [B] float, top_k [B] int32, top_p [B] float,
    min_p [B] float, seeds [B] int64, out_positions [B] int64     the verification's
Extra outputs:
    present_key_i / present_value_i [B, T, Hkv, D]   the new nodes' KV (written by the plugin
                                                      into their slot columns; ONNX Runtime's
                                                      reference op cannot write an input)
    accepted_nodes [B, T] int32, output_ids [B, T] int64, num_accepted [B] int32
The tree input is the paths (at most T x T), never a mask over the cache. The plugin verifies
trees of up to kernels.PLUGIN_MAX_NODES (64) nodes; the runtime verifies wider ones on the host. Op contracts:
plugins/reference.py (`tree_attention` after writing the new nodes at columns
ctx_len + n_prior + j of their slot, with the layer's sliding window as the node's `window`
attribute and the model's attention soft-cap as its `softcap`; `verify` with float32 parameters
and R = T).
Knows: the plugin nodes' wiring. Does not know: weights (graph.py).
"""
from __future__ import annotations

from onnx import TensorProto, helper

from backend import program
from backend.manifest import ModelConfig

DOMAIN = "specdec"
# What TensorRT's ONNX parser reads to find a Python plugin: the node's op type is the plugin's
# name, `plugin_namespace` its namespace; `aot` asks for the ahead-of-time implementation
# (plugins/trt_plugins.py). The node's domain is what ONNX Runtime reads (plugins/ort_ops.py).
PLUGIN_ATTRS = {"plugin_namespace": DOMAIN, "plugin_version": "1", "aot": 1}


class PluginAttention:
    def __init__(self, g, cfg: ModelConfig, inputs: list):
        self.g, self.cfg, self.inputs = g, cfg, inputs
        i32 = TensorProto.INT32
        inputs += [helper.make_tensor_value_info("slots", i32, ["B"]),
                   helper.make_tensor_value_info("ctx_len", i32, ["B"]),
                   helper.make_tensor_value_info("n_prior", i32, ["B"]),
                   helper.make_tensor_value_info("paths", i32, ["B", "T", "P"])]

    def layer(self, i: int, q: str, k: str, v: str, outputs: list, op: program.Attention) -> str:
        """Layer i's attention op: q [B,T,Hq,D], k and v [B,T,Hkv,D] -> [B,T,Hq*D]. q carries the
        op's scale already (graph.py folds it into Wq, or into the q norm's weight where q is
        normed), so the node's `scale` is 1; the op gives the sliding window (0: none), counted
        along each node's path (plugins/reference.py), and the scores' soft-cap (0: none)."""
        g, cfg = self.g, self.cfg
        nkv, d = cfg.num_kv_heads, cfg.head_dim
        kc, vc = f"k_cache_{i}", f"v_cache_{i}"
        for name in (kc, vc):
            self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["S", nkv, "L", d]))
        for name, src in ((f"present_key_{i}", k), (f"present_value_{i}", v)):
            g.op("Identity", [src], outputs=[name])
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", "T", nkv, d]))
        o = g.op("tree_attention", [q, k, v, kc, vc, "slots", "ctx_len", "n_prior", "paths"],
                 domain=DOMAIN, hint=f"l{i}.attention", scale=1.0, num_heads=cfg.num_heads,
                 num_kv_heads=nkv, head_dim=d, window=int(op.window), softcap=float(op.softcap),
                 **PLUGIN_ATTRS)
        return g.op("Reshape", [o, g.i64(0, 0, cfg.num_heads * d)])

    def verify_tail(self, inputs: list, outputs: list) -> None:
        """rejection_sample over the logits of every node (logits_index = 0..T-1)."""
        f32, i32, i64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
        extra = [("parents", i32, ["B", "T"]), ("temperature", f32, ["B"]), ("top_k", i32, ["B"]),
                 ("top_p", f32, ["B"]), ("min_p", f32, ["B"]), ("seeds", i64, ["B"]),
                 ("out_positions", i64, ["B"])]
        inputs += [helper.make_tensor_value_info(n, t, s) for n, t, s in extra]
        names = ["accepted_nodes", "output_ids", "num_accepted"]
        self.g.op("rejection_sample", ["logits", "input_ids"] + [n for n, _, _ in extra], domain=DOMAIN,
                  outputs=names, **PLUGIN_ATTRS)
        outputs += [helper.make_tensor_value_info("accepted_nodes", i32, ["B", "T"]),
                    helper.make_tensor_value_info("output_ids", i64, ["B", "T"]),
                    helper.make_tensor_value_info("num_accepted", i32, ["B"])]
