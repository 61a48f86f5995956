"""TensorRT plugins `specdec::tree_attention` and `specdec::rejection_sample` (the engine
graph's nodes, buildlib/engine_graph.py), defined with TensorRT's Python plugin API
(`tensorrt.plugin`; the ONNX parser takes AOT Python plugins from TensorRT 10.9): shapes and
types, and an ahead-of-time implementation
whose PTX is the Triton kernels of plugins/kernels.py compiled for the build's GPU, so a built
engine runs without Python. Importing this module registers both (once per process).

TensorRT passes an AOT kernel its input pointers, then the `extra_args` scalars, then its output
pointers: the `*_plugin_kernel`s of kernels.py take exactly that order and derive strides from
the (contiguous) shapes; kernels.compile_plugin cuts the scratch pointers Triton >= 3.3 appends
to a kernel's parameters (unused here), so the PTX takes exactly those. Attributes are not
stored in an AOT engine: scale, the sliding window (the layer's; 0: none), the scores' soft-cap
(Gemma-2's; 0: none) and the head counts are compiled into the PTX as constants. The ONNX
parser finds a plugin by the node's op type and its `plugin_namespace` attribute ("specdec"),
passes only the declared attributes (as int32 / float32), and `aot` = 1 asks for this
implementation; this module must be imported before parsing (devices/tensorrt/export.py does).
Knows: TensorRT's plugin API, the kernels' signatures. Does not know: graphs, runtimes.
"""
# No `from __future__ import annotations`: TensorRT reads these functions' annotations as classes.
from typing import Tuple

import tensorrt as trt
import tensorrt.plugin as trtp

from plugins import kernels

NAMESPACE = "specdec"
NUM_WARPS = 4
_PTR = {trt.float32: "*fp32", trt.int32: "*i32", trt.int64: "*i64", trt.bfloat16: "*bf16"}


def _arch() -> int:
    """The compute capability the build targets, as 90 for sm_90: the GPU's, or
    SPECDEC_TRT_ARCH where set (compiling on a machine without the GPU)."""
    import os

    if os.environ.get("SPECDEC_TRT_ARCH"):
        return int(os.environ["SPECDEC_TRT_ARCH"])
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return 10 * major + minor


@trtp.register("specdec::tree_attention")
def tree_attention_desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                        v_cache: trtp.TensorDesc, slots: trtp.TensorDesc, ctx_len: trtp.TensorDesc,
                        n_prior: trtp.TensorDesc, paths: trtp.TensorDesc, scale: float, num_heads: int,
                        num_kv_heads: int, head_dim: int, window: int, softcap: float) -> Tuple[trtp.TensorDesc]:
    """o [B, T, Hq, D] float32: q's shape (plugins/reference.py, tree_attention after the new
    nodes are written to their columns)."""
    o = q.like()
    o.dtype = trt.float32
    return o


@trtp.autotune("specdec::tree_attention")
def tree_attention_tune(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                        v_cache: trtp.TensorDesc, slots: trtp.TensorDesc, ctx_len: trtp.TensorDesc,
                        n_prior: trtp.TensorDesc, paths: trtp.TensorDesc, scale: float, num_heads: int,
                        num_kv_heads: int, head_dim: int, window: int, softcap: float,
                        outputs: Tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:
    return [trtp.AutoTuneCombination("FP32, FP32, FP32, FP32, FP32, INT32, INT32, INT32, INT32, FP32", "LINEAR")]


@trtp.aot_impl("specdec::tree_attention")
def tree_attention_aot(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                       v_cache: trtp.TensorDesc, slots: trtp.TensorDesc, ctx_len: trtp.TensorDesc,
                       n_prior: trtp.TensorDesc, paths: trtp.TensorDesc, scale: float, num_heads: int,
                       num_kv_heads: int, head_dim: int, window: int, softcap: float,
                       outputs: Tuple[trtp.TensorDesc], tactic: int
                       ) -> Tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    ptx, name, shared = kernels.compile_plugin("tree_attention", _arch(), kv_dtype=_PTR[k_cache.dtype][1:],
                                               head_dim=head_dim, group=num_heads // num_kv_heads,
                                               scale=scale, window=window, softcap=softcap, num_warps=NUM_WARPS)
    launch = trtp.KernelLaunchParams()
    launch.grid_x = q.shape_expr[0] * q.shape_expr[1]       # one program per (row, node) ...
    launch.grid_y = num_kv_heads                            # ... and KV head
    launch.block_x = 32 * NUM_WARPS
    launch.shared_mem = shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(q.shape_expr[1]), trtp.SymInt32(paths.shape_expr[2]),
                                         trtp.SymInt32(k_cache.shape_expr[2])])     # T, P, L
    return name, ptx, launch, extra


@trtp.register("specdec::rejection_sample")
def rejection_sample_desc(logits: trtp.TensorDesc, tokens: trtp.TensorDesc, parents: trtp.TensorDesc,
                          temperature: trtp.TensorDesc, top_k: trtp.TensorDesc, top_p: trtp.TensorDesc,
                          min_p: trtp.TensorDesc, seeds: trtp.TensorDesc, positions: trtp.TensorDesc
                          ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
    """accepted_nodes [B, T] int32, output_ids [B, T] int64, num_accepted [B] int32."""
    nodes = parents.like()
    out = tokens.like()
    num = top_k.like()
    return nodes, out, num


@trtp.autotune("specdec::rejection_sample")
def rejection_sample_tune(logits: trtp.TensorDesc, tokens: trtp.TensorDesc, parents: trtp.TensorDesc,
                          temperature: trtp.TensorDesc, top_k: trtp.TensorDesc, top_p: trtp.TensorDesc,
                          min_p: trtp.TensorDesc, seeds: trtp.TensorDesc, positions: trtp.TensorDesc,
                          outputs: Tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:
    return [trtp.AutoTuneCombination("FP32, INT64, INT32, FP32, INT32, FP32, FP32, INT64, INT64, INT32, INT64, INT32",
                                     "LINEAR")]


@trtp.aot_impl("specdec::rejection_sample")
def rejection_sample_aot(logits: trtp.TensorDesc, tokens: trtp.TensorDesc, parents: trtp.TensorDesc,
                         temperature: trtp.TensorDesc, top_k: trtp.TensorDesc, top_p: trtp.TensorDesc,
                         min_p: trtp.TensorDesc, seeds: trtp.TensorDesc, positions: trtp.TensorDesc,
                         outputs: Tuple[trtp.TensorDesc], tactic: int
                         ) -> Tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    ptx, name, shared = kernels.compile_plugin("rejection_sample", _arch(), num_warps=NUM_WARPS)
    launch = trtp.KernelLaunchParams()
    launch.grid_x = logits.shape_expr[0]                    # one program per row
    launch.block_x = 32 * NUM_WARPS
    launch.shared_mem = shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(tokens.shape_expr[1]), trtp.SymInt32(logits.shape_expr[1]),
                                         trtp.SymInt32(logits.shape_expr[2])])      # T, R, V
    return name, ptx, launch, extra


def registered() -> list[tuple[str, str, str]]:
    """(name, version, namespace) of this module's plugin creators in TensorRT's registry."""
    return sorted((c.name, c.plugin_version, c.plugin_namespace) for c in trt.get_plugin_registry().all_creators
                  if c.plugin_namespace == NAMESPACE)
