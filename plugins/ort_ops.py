"""The engine graph's `specdec::` ops for ONNX Runtime's CPU provider, implemented by the numpy
references (onnxruntime-extensions Python custom ops), so the graph TensorRT builds can be run
and checked on a CPU. Import this module, then `register(options)` for a session that has them.
Knows: the op contracts of plugins/reference.py. Does not know: TensorRT.
"""
from __future__ import annotations

import numpy as np
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

from plugins.reference import tree_attention_ref, verify_ref, write_nodes

_F, _I32, _I64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64


@onnx_op(op_type="specdec::tree_attention", inputs=[_F, _F, _F, _F, _F, _I32, _I32, _I32, _I32],
         outputs=[_F], attrs={"scale": PyCustomOpDef.dt_float, "num_heads": PyCustomOpDef.dt_int64,
                              "num_kv_heads": PyCustomOpDef.dt_int64, "head_dim": PyCustomOpDef.dt_int64,
                              "window": PyCustomOpDef.dt_int64, "softcap": PyCustomOpDef.dt_float,
                              "plugin_namespace": PyCustomOpDef.dt_string,
                              "plugin_version": PyCustomOpDef.dt_string, "aot": PyCustomOpDef.dt_int64})
def tree_attention(q, k, v, k_cache, v_cache, slots, ctx_len, n_prior, paths, **attrs):
    kc, vc = write_nodes(k_cache, v_cache, k, v, slots, ctx_len, n_prior)
    return tree_attention_ref(q, kc, vc, slots, ctx_len, paths, float(attrs.get("scale", 1.0)),
                              int(attrs.get("window", 0)), float(attrs.get("softcap", 0.0)))


@onnx_op(op_type="specdec::rejection_sample", inputs=[_F, _I64, _I32, _F, _I32, _F, _F, _I64, _I64],
         outputs=[_I32, _I64, _I32], attrs={"plugin_namespace": PyCustomOpDef.dt_string,
                                            "plugin_version": PyCustomOpDef.dt_string,
                                            "aot": PyCustomOpDef.dt_int64})
def rejection_sample(logits, tokens, parents, temperature, top_k, top_p, min_p, seeds, positions, **attrs):
    nodes, out, num = verify_ref(logits, tokens, parents, temperature.astype(np.float64), top_k,
                                 top_p.astype(np.float64), min_p.astype(np.float64),
                                 np.asarray(seeds, np.int64).view(np.uint64), positions)
    return nodes.astype(np.int32), out.astype(np.int64), num.astype(np.int32)


def register(so):
    """Session options `so` (the caller's: runtime/ort.session_options) with these ops registered."""
    so.register_custom_ops_library(get_library_path())
    return so
