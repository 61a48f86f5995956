"""ONNX decoder graph for Llama-family models, written directly with onnx.helper.

Inputs (B = sequences, T = new tokens per sequence, P = cached columns, S = P + T):
    input_ids      [B, T] int64
    position_ids   [B, T] int64     rotary positions (prefix length + tree depth)
    attn_bias      [B, T, S] float  additive 0 / -1e30: any token tree, padding, per-row masks
    logits_index   [B, R] int64     which of the T rows get logits (R = 1 for prefill)
    past_key_i / past_value_i  [B, Hkv, P, D] float
Outputs:
    logits [B, R, V], hidden [B, T, H (1 + len(feature_layers))] (final-norm features for
        feature drafters, then the residual stream entering each of `feature_layers`: EAGLE-3),
    present_key_i / present_value_i  [B, Hkv, S, D]

Why standard ops rather than com.microsoft.GroupQueryAttention: GQA refuses B > 1 with T > 1
and past context on CPU (batched tree verification needs exactly that), and its T = 1 kernel
path is not batch invariant. The attention here is written so that the logits of a token do
not depend on where its keys sit in the row (see docs/architecture.md, "batch invariance"):
  * masked columns contribute exact zeros (exp(-1e30 - m) == 0, 0 * v == 0),
  * the softmax denominator and exp(s - m) @ V are summed in float64 and rounded once to
    float32, so neither the order of the columns nor how a GEMM blocks its K dimension (MLAS
    splits K at 256: float32 sums then depended on where garbage columns from rejected drafts
    sat, measured up to 1.16 logits on the 4-bit engine past 256 columns) changes the result.
Knows: graph wiring and weight placement. Does not know: checkpoint formats (checkpoint.py) or
block encodings (quant.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from backend import program
from backend.buildlib import quant
from backend.buildlib.checkpoint import BLOCK_TYPES, Checkpoint, SourceTensor
from backend.engine_format import rope_tables
from backend.manifest import ModelConfig, WeightFormat

OPSET = 17
ENGINE_OPSET = 21        # the engine graph: float8 Q/DQ need 19, blocked DequantizeLinear 21
MASK_VALUE = -1e30
ACCURACY_LEVEL = 4   # int8 activations: the only fast MatMulNBits path on AVX2 (cpu-engine.md §4)


@dataclass(frozen=True)
class GraphSpec:
    weights: WeightFormat
    num_layers: int          # <= config.num_layers (self-draft: first N layers + final head)
    max_positions: int       # size of the rotary tables
    eagle: bool = False      # EAGLE draft head: extra input `features` fused with the embedding
    plugins: bool = False    # the engine graph: attention and verification as specdec:: nodes
                             # (engine_graph.py), for TensorRT; else standard ops (ONNX Runtime)
    verify: bool = True      # with plugins: the rejection_sample tail (the target's engine)
    feature_layers: tuple[int, ...] = ()   # EAGLE-3: these layers' inputs appended to `hidden`


class _Builder:
    def __init__(self, opset: int = OPSET):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._consts: dict[tuple, str] = {}
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.require(array, requirements="C"), name))  # keeps 0-d
        return name

    def i64(self, *values: int) -> str:
        key = ("i64",) + values
        if key not in self._consts:
            self._consts[key] = self.init(f"const_i64_{len(self._consts)}", np.array(values, np.int64))
        return self._consts[key]

    def f32(self, value: float) -> str:
        key = ("f32", value)
        if key not in self._consts:
            self._consts[key] = self.init(f"const_f32_{len(self._consts)}", np.array(value, np.float32))
        return self._consts[key]

    def reduce_mean(self, x: str, axis: int) -> str:
        if self.opset >= 18:                                  # axes became an input at 18
            return self.op("ReduceMean", [x, self.i64(axis)], keepdims=1)
        return self.op("ReduceMean", [x], axes=[axis], keepdims=1)

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, n_out: int = 1,
           domain: str | None = None, outputs: list[str] | None = None, **attrs):
        outs = outputs or [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name("n_" + op_type),
                                           domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs


FP8_LINEARS = ("qkv", "o", "gate_up", "down")    # a layer's linears; the rest stays float32


class _Linear:
    """Emits y = x @ W.T (+ b) for one weight format; shares per-block sums of a common input.
    FP8 (the engine graph): a layer's linears by the build's FP8 recipe (runtime/fp8.py, written
    by fp8_graph.py): float8 E4M3 weights with their block scales, the input quantized per
    tensor with its calibrated scale ("layers.<i>.<qkv|o|gate_up|down>.act_scale",
    buildlib/calibration.calibrate) as the QuantizeLinear / DequantizeLinear pairs TensorRT fuses
    into FP8 GEMMs, or per token / per group as the recipe says; the recipe's weight-only
    linears (and, in the legacy recipe, an input without a scale) keep their input in float."""

    def __init__(self, g: _Builder, fmt: WeightFormat, act_scales: dict | None = None, recipe=None):
        from backend.runtime import fp8

        self.g, self.fmt, self.act_scales = g, fmt, act_scales or {}
        self.recipe = recipe or fp8.LEGACY
        self._block_sums: dict[tuple[str, int], str] = {}

    def _fp8(self, x: str, name: str, w: np.ndarray, linear: str, row_scale: np.ndarray | None) -> str:
        from backend.buildlib.fp8_graph import fp8_linear

        act = self.act_scales.get(f"{linear}.act_scale")
        quantize = self.recipe.quantizes_input(linear) and (act is not None or not self.recipe.static)
        return fp8_linear(self.g, x, name, w, self.recipe, act, quantize, row_scale, self.act_scales, linear)

    def __call__(self, x: str, name: str, w, bias: np.ndarray | None = None,
                 row_scale: np.ndarray | None = None) -> str:
        """row_scale [N]: FP8's output multipliers (q's scale; other formats fold it into w)."""
        g = self.g
        layer = re.fullmatch(r"l(\d+)\.(" + "|".join(FP8_LINEARS) + ")", name)
        if self.fmt is WeightFormat.FP8 and layer and isinstance(w, np.ndarray):
            y = self._fp8(x, name, w, f"layers.{layer[1]}.{layer[2]}", row_scale)
        elif isinstance(w, list):
            y = g.op("Concat", [self(x, f"{name}.{j}", part) for j, part in enumerate(w)], axis=-1)
        elif isinstance(w, np.ndarray):
            y = g.op("MatMul", [x, g.init(f"{name}.wT", np.ascontiguousarray(w.T.astype(np.float32)))],
                     hint=name)
        else:
            n, k = w.ints.shape
            packed, scales = quant.pack_matmul_nbits(w)
            y = g.op("MatMulNBits", [x, g.init(f"{name}.qweight", packed), g.init(f"{name}.scales", scales)],
                     hint=name, domain="com.microsoft", K=k, N=n, bits=w.bits,
                     block_size=w.block_size, accuracy_level=ACCURACY_LEVEL)
            if w.offset is not None:
                # exact per-block offset: sum_b offset[n,b] * sum_{k in b} x[k]  (quant.py)
                key = (x, w.block_size)
                if key not in self._block_sums:
                    r = g.op("Reshape", [x, g.i64(0, 0, k // w.block_size, w.block_size)])
                    self._block_sums[key] = g.op("ReduceSum", [r, g.i64(-1)], keepdims=0)
                corr = g.op("MatMul", [self._block_sums[key],
                                       g.init(f"{name}.offsetT", np.ascontiguousarray(w.offset.T))])
                y = g.op("Add", [y, corr])
        if bias is not None:
            y = g.op("Add", [y, g.init(f"{name}.bias", bias.astype(np.float32))])
        return y


def _weight(t: SourceTensor, fmt: WeightFormat, scale: float = 1.0, bits_for_float: int = 4):
    """A linear weight [out, in] as float32 (fp32 engine; FP8: quantized by _Linear) or Blocks
    (4-bit engine)."""
    if fmt in (WeightFormat.FP32, WeightFormat.FP8):
        w = t.float32()
        return w * np.float32(scale) if scale != 1.0 else w
    if quant.decodable(t.qtype):
        b = quant.decode_blocks(t.qtype, t.rows())
    elif t.qtype in BLOCK_TYPES:
        # 5- and 6-bit GGUF blocks (Q5_0, Q5_1, Q5_K, and Q6_K where its layout is not repacked)
        # have no 4-bit form: 8-bit blocks of their values, within 1/510 of each block's range
        b = quant.quantize_rtn(t.float32(), bits=8, block_size=32)
    else:
        b = quant.quantize_rtn(t.float32(), bits=bits_for_float, block_size=32)
    return b.scaled(scale) if scale != 1.0 else b


def _cat(parts):
    """Fuse weights along the output dimension; a list when block layouts differ (Q4_K_M files
    mix Q4_K and Q6_K), which the linear then emits as separate nodes joined by a Concat."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=0)
    if len({(p.bits, p.block_size) for p in parts}) == 1:
        return quant.concat_rows(parts)
    return list(parts)


def build_decoder(ckpt: Checkpoint, spec: GraphSpec, progress=None, act_scales: dict | None = None,
                  fp8_recipe=None) -> onnx.ModelProto:
    """act_scales, fp8_recipe: for WeightFormat.FP8, the static recipe's input scales
    (buildlib/calibration.calibrate) and the build's recipe (runtime/fp8.py; None: the legacy one).
    The steps in the order they write the graph (node names count up, so the order is the graph)."""
    assert spec.weights is not WeightFormat.FP8 or spec.plugins, "FP8 is a format of the engine graph"
    dec = _Decoder(ckpt, spec, act_scales, fp8_recipe)      # inputs and outputs declared
    x, embeds = dec.embed()
    tables = dec.tables()
    for i in range(spec.num_layers):
        x = dec.layer(i, x, embeds, tables)
        if progress is not None:
            progress(1)
    dec.head(x, [dec.features[j] for j in spec.feature_layers])
    return dec.model()


@dataclass(frozen=True)
class _Tables:
    """What every layer reads besides the residual stream: the rotary tables' rows at
    position_ids ([B, T, 1, D/2] each), and the standard attention's masks [B, 1, G*T, S]."""
    rope: tuple[str, str]
    local_rope: tuple[str, str] | None    # the sliding layers' own rope base, where they have one
    bias: str | None                      # None with plugins (they mask by paths)
    bias_local: str | None                # the sliding layers' mask, where there are any


class _Decoder:
    """One decoder graph being written by build_decoder's steps: the builder, the graph's inputs
    and outputs (declared here; layers and the verify tail append theirs), the model description."""

    def __init__(self, ckpt: Checkpoint, spec: GraphSpec, act_scales: dict | None, fp8_recipe):
        cfg = self.cfg = ckpt.config
        self.ckpt, self.spec = ckpt, spec
        self.g = _Builder(ENGINE_OPSET if spec.plugins else OPSET)
        self.lin = _Linear(self.g, spec.weights, act_scales, fp8_recipe)
        # EAGLE-3: the residual stream is the feature (fc'd target features, or the head's own);
        # the attention reads [norm(embedding of x_{t+1}), norm(feature)] (buildlib/heads/eagle.py)
        self.eagle3 = spec.eagle and "layers.0.hidden_norm" in ckpt.tensors
        # each layer's program (backend/program.py); the stream entering each feature layer
        self.programs = cfg.programs(spec.num_layers, spec.feature_layers, self.eagle3)
        self.windows = [program.attention(ops).window for ops in self.programs]
        self.features: dict[int, str] = {}
        self.inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "T"]),
            helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["B", "R"]),
        ]
        if spec.plugins:
            from backend.buildlib import engine_graph

            self.attention = engine_graph.PluginAttention(self.g, cfg, self.inputs)
        else:
            self.inputs.insert(2, helper.make_tensor_value_info("attn_bias", TensorProto.FLOAT, ["B", "T", "S"]))
            if any(self.windows):     # the sliding layers' mask: attn_bias and keys within the window
                self.inputs.insert(3, helper.make_tensor_value_info("attn_bias_local", TensorProto.FLOAT,
                                                                    ["B", "T", "S"]))
        self.outputs = [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "R", cfg.vocab_size]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT,
                                          ["B", "T", cfg.hidden_size * (1 + len(spec.feature_layers))]),
        ]

    def t(self, i: int, name: str) -> SourceTensor:
        return self.ckpt.tensor(f"layers.{i}.{name}")

    def has(self, i: int, name: str) -> bool:
        return f"layers.{i}.{name}" in self.ckpt.tensors

    def rmsnorm(self, v: str, weight: SourceTensor | None) -> str:
        if weight is None:               # an EAGLE-1/2 head: no input norm, no final norm
            return v
        # The exact pattern ORT fuses into SimplifiedLayerNormalization.
        g = self.g
        var = g.reduce_mean(g.op("Pow", [v, g.f32(2.0)]), -1)
        std = g.op("Sqrt", [g.op("Add", [var, g.f32(self.cfg.rms_norm_eps)])])
        return g.op("Mul", [g.op("Div", [v, std]), g.init(g.name(weight.name), weight.float32())])

    def embed(self) -> tuple[str, str | None]:
        """-> the residual stream entering layer 0, and the token embedding an EAGLE-3 head's
        attention reads (None for the others)."""
        g, cfg, spec = self.g, self.cfg, self.spec
        x = g.op("Gather", [g.init("embed", self.ckpt.tensor("embed").float32()), "input_ids"], hint="embeds")
        if cfg.embed_scale != 1.0 and not spec.eagle:
            x = g.op("Mul", [x, g.f32(cfg.embed_scale)])
        if spec.eagle:
            h = cfg.hidden_size
            self.inputs.append(helper.make_tensor_value_info("features", TensorProto.FLOAT, ["B", "T", h]))
        if self.eagle3:
            return "features", x
        if spec.eagle:
            # EAGLE: x = FC([embedding of x_{t+1}, target feature f_t]) (train/eagle_model.py)
            x = self.lin(g.op("Concat", [x, "features"], axis=-1), "fc", self.ckpt.tensor("fc").float32(),
                         self.ckpt.tensor("fc_bias").float32())
        return x, None

    def tables(self) -> _Tables:
        """The rotary tables' rows at position_ids; the standard attention's masks."""
        g, cfg, spec = self.g, self.cfg, self.spec
        cos_t, sin_t = rope_tables(cfg, spec.max_positions)
        cos = g.op("Unsqueeze", [g.op("Gather", [g.init("rope_cos", cos_t), "position_ids"]), g.i64(2)])
        sin = g.op("Unsqueeze", [g.op("Gather", [g.init("rope_sin", sin_t), "position_ids"]), g.i64(2)])
        local_rope = None
        if any(program.Rope("local") in ops for ops in self.programs):       # the sliding layers' own base
            lc, ls = rope_tables(cfg, spec.max_positions, local=True)
            local_rope = tuple(g.op("Unsqueeze", [g.op("Gather", [g.init(nm, tab), "position_ids"]), g.i64(2)])
                               for nm, tab in (("rope_local_cos", lc), ("rope_local_sin", ls)))
        if spec.plugins:
            return _Tables((cos, sin), local_rope, None, None)
        # attn_bias [B,T,S] -> [B,1,G*T,S]: query rows of the grouped layout are g*T + t
        grp = cfg.num_groups
        grouped = lambda nm: g.op("Unsqueeze", [g.op("Concat", [nm] * grp, axis=1) if grp > 1 else nm, g.i64(1)])
        bias = grouped("attn_bias")
        return _Tables((cos, sin), local_rope, bias, grouped("attn_bias_local") if any(self.windows) else None)

    def layer(self, i: int, x: str, embeds: str | None, tables: _Tables) -> str:
        """Layer i's program (backend/program.py), op by op, on the residual stream x -> the next
        x. h, the value worked on, is a tensor's name, or q/k/v heads: (qk, v) or (q, k, v)."""
        h, pending, width = x, None, 0
        for op in self.programs[i]:
            if isinstance(op, program.Features):
                self.features[i] = x
            elif isinstance(op, program.Norm):
                h = self.norm(i, op, h, embeds)
            elif isinstance(op, program.Linear):
                h, width = self.linear(i, op, h), op.out
            elif isinstance(op, program.HeadNorm):
                h = self.head_norm(i, op, self.heads(h))
            elif isinstance(op, program.Rope):
                h = self.rotary(op, self.heads(h), tables)
            elif isinstance(op, program.Attention):
                h = self.attend(i, op, self.heads(h), tables)
            elif isinstance(op, program.Gate):
                h = self.gate(op, h, width // 2)
            else:                                         # Residual (x + norm(h): Gemma's post norms)
                t = self.rmsnorm(h, self.t(i, op.norm)) if op.norm else h
                if op.parallel:
                    pending = t
                else:
                    x = self.g.op("Add", [x if pending is None else self.g.op("Add", [x, pending]), t])
                    pending = None
                h = x
        return x

    def norm(self, i: int, op: program.Norm, h: str, embeds: str | None) -> str:
        """RMSNorm of h by the layer's weight (absent: h itself, an EAGLE-1/2 head's input); an
        EAGLE-3 head's: [norm(embedding), norm(h) by its feature norm]."""
        weight = lambda name: self.t(i, name) if self.has(i, name) else None
        if op.feature:
            return self.g.op("Concat", [self.rmsnorm(embeds, weight(op.weight)), self.rmsnorm(h, weight(op.feature))],
                             axis=-1)
        return self.rmsnorm(h, weight(op.weight))

    def linear(self, i: int, op: program.Linear, h: str) -> str:
        """h W^T (+ b), W the op's parts fused. Attention's q scale is folded into q's rows (and
        bias), or, where q is normed after its projection, into the q norm's weight (head_norm);
        FP8 quantizes the unscaled weights and folds the scale into their scales (rows)."""
        spec, t, ops = self.spec, lambda n: self.t(i, n), self.programs[i]
        q_scale = 1.0 if any(isinstance(o, program.HeadNorm) for o in ops) else program.attention(ops).scale
        scale = {p: q_scale if p == "q" else 1.0 for p in op.parts}
        fold = spec.weights is WeightFormat.FP8 and any(v != 1.0 for v in scale.values())
        parts = [_weight(t(p), spec.weights, 1.0 if fold else scale[p]) for p in op.parts]
        w = parts[0] if len(parts) == 1 else _cat(parts)
        rows = (np.concatenate([np.full(t(p).shape[0], scale[p], np.float32) for p in op.parts]) if fold else None)
        bias = None
        if op.bias and self.has(i, op.bias_parts[0]):
            bias = np.concatenate([t(b).float32() * np.float32(scale[p]) if p == "q" else t(b).float32()
                                   for p, b in zip(op.parts, op.bias_parts)])
        return self.lin(h, f"l{i}.{op.name}", w, bias, rows)

    def heads(self, h) -> tuple:
        """q/k/v rows [B, T, (Hq + 2 Hkv) D] as (q and k [B, T, Hq + Hkv, D], v [B, T, Hkv, D]);
        heads already split as they are."""
        if isinstance(h, tuple):
            return h
        g, cfg = self.g, self.cfg
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        qkv = g.op("Reshape", [h, g.i64(0, 0, nh + 2 * nkv, cfg.head_dim)])
        return tuple(g.op("Split", [qkv, g.i64(nh + nkv, nkv)], n_out=2, axis=2))

    def head_norm(self, i: int, op: program.HeadNorm, heads: tuple) -> tuple:
        """q's and k's heads RMS-normed (q's norm carrying attention's q scale) -> (qk, v)."""
        g, cfg = self.g, self.cfg
        qk, v = heads
        qn, kn = self.t(i, op.q), self.t(i, op.k)
        qh, kh = g.op("Split", [qk, g.i64(cfg.num_heads, cfg.num_kv_heads)], n_out=2, axis=2)
        qw = SourceTensor(qn.name, "F32", qn.shape, qn.float32() * np.float32(program.attention(self.programs[i]).scale))
        return g.op("Concat", [self.rmsnorm(qh, qw), self.rmsnorm(kh, kn)], axis=2), v

    def rotary(self, op: program.Rope, heads: tuple, tables: _Tables) -> tuple:
        """Rotary (HF rotate_half): [x1, x2] -> [x1*cos - x2*sin, x2*cos + x1*sin], q and k at
        once -> (q [B,T,Hq,D], k [B,T,Hkv,D], v)."""
        g, cfg, d = self.g, self.cfg, self.cfg.head_dim
        qk, v = heads
        c, sn = tables.local_rope if op.table == "local" else tables.rope
        x1, x2 = g.op("Split", [qk, g.i64(d // 2, d // 2)], n_out=2, axis=3)
        r1 = g.op("Sub", [g.op("Mul", [x1, c]), g.op("Mul", [x2, sn])])
        r2 = g.op("Add", [g.op("Mul", [x2, c]), g.op("Mul", [x1, sn])])
        q, k = g.op("Split", [g.op("Concat", [r1, r2], axis=3), g.i64(cfg.num_heads, cfg.num_kv_heads)],
                    n_out=2, axis=2)
        return q, k, v

    def attend(self, i: int, op: program.Attention, heads: tuple, tables: _Tables) -> str:
        """Layer i's attention of q [B,T,Hq,D] over the cache and k, v [B,T,Hkv,D] -> [B,T,Hq*D]
        (q's scale is folded into the weights above): a plugin node, or standard ops."""
        if len(heads) == 2:                               # no rotary: q and k apart here
            qk, v = heads
            heads = (*self.g.op("Split", [qk, self.g.i64(self.cfg.num_heads, self.cfg.num_kv_heads)], n_out=2,
                                axis=2), v)
        if self.spec.plugins:
            return self.attention.layer(i, *heads, self.outputs, op)
        return self.standard_attention(i, op, *heads, tables)

    def standard_attention(self, i: int, op: program.Attention, q: str, k: str, v: str, tables: _Tables) -> str:
        """Layer i's attention in standard ops over past_key_i / past_value_i (batch invariant:
        the module docstring) -> [B, T, Hq*D]; declares the layer's cache inputs and outputs."""
        g, cfg = self.g, self.cfg
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        past_k, past_v = f"past_key_{i}", f"past_value_{i}"
        pres_k, pres_v = f"present_key_{i}", f"present_value_{i}"
        for nm in (past_k, past_v):
            self.inputs.append(helper.make_tensor_value_info(nm, TensorProto.FLOAT, ["B", nkv, "P", d]))
        for nm in (pres_k, pres_v):
            self.outputs.append(helper.make_tensor_value_info(nm, TensorProto.FLOAT, ["B", nkv, "S", d]))
        q = g.op("Reshape", [g.op("Transpose", [q], perm=[0, 2, 1, 3]), g.i64(0, nkv, -1, d)])
        k = g.op("Transpose", [k], perm=[0, 2, 1, 3])
        v = g.op("Transpose", [v], perm=[0, 2, 1, 3])
        g.op("Concat", [past_k, k], axis=2, outputs=[pres_k])
        g.op("Concat", [past_v, v], axis=2, outputs=[pres_v])
        scores = g.op("MatMul", [q, g.op("Transpose", [pres_k], perm=[0, 1, 3, 2])])
        if op.softcap:                     # Gemma-2: cap tanh(scores / cap), before the mask
            scores = _softcap(g, scores, op.softcap)
        s = g.op("Add", [scores, tables.bias_local if op.window else tables.bias])   # [B, Hkv, G*T, S]
        e = g.op("Exp", [g.op("Sub", [s, g.op("ReduceMax", [s], axes=[-1], keepdims=1)])])
        e64 = g.op("Cast", [e], to=TensorProto.DOUBLE)
        z = g.op("ReduceSum", [e64, g.i64(-1)], keepdims=1)
        pv = g.op("MatMul", [e64, g.op("Cast", [pres_v], to=TensorProto.DOUBLE)])
        o = g.op("Cast", [g.op("Div", [pv, z])], to=TensorProto.FLOAT)  # [B, Hkv, G*T, D]
        return g.op("Reshape", [g.op("Transpose", [g.op("Reshape", [o, g.i64(0, nh, -1, d)])],
                                     perm=[0, 2, 1, 3]), g.i64(0, 0, nh * d)])

    def gate(self, op: program.Gate, h: str, inter: int) -> str:
        """act(gate) * up of gate_up rows h [B, T, 2 inter] (SwiGLU, or GeGLU with tanh GELU)."""
        g = self.g
        gate, up = g.op("Split", [h, g.i64(inter, inter)], n_out=2, axis=2)
        if op.act == "gelu_tanh":    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            cube = g.op("Mul", [g.op("Mul", [gate, gate]), gate])
            inner = g.op("Mul", [g.op("Add", [gate, g.op("Mul", [cube, g.f32(0.044715)])]),
                                 g.f32(float(np.sqrt(2.0 / np.pi)))])
            a = g.op("Mul", [g.op("Mul", [gate, g.f32(0.5)]), g.op("Add", [g.op("Tanh", [inner]), g.f32(1.0)])])
        else:
            a = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
        return g.op("Mul", [a, up])

    def head(self, x: str, features: list[str]) -> None:
        """The final norm; `hidden` (the final-norm features, then `features`: the residual
        stream entering each of spec.feature_layers); `logits` of the rows logits_index picks,
        soft-capped where the model caps them; with plugins and verify, the rejection_sample tail."""
        g, cfg, spec, ckpt = self.g, self.cfg, self.spec, self.ckpt
        normed = self.rmsnorm(x, ckpt.tensor("norm") if "norm" in ckpt.tensors or not spec.eagle else None)
        if self.eagle3:                   # an EAGLE-3 head's next-level feature is its pre-norm output
            g.op("Identity", [x], outputs=["hidden"])
        elif spec.feature_layers:
            g.op("Concat", [normed] + features, axis=-1, outputs=["hidden"])
        else:
            g.op("Identity", [normed], outputs=["hidden"])
        rows = g.op("GatherND", [normed, g.op("Unsqueeze", ["logits_index", g.i64(-1)])], batch_dims=1)
        head = ckpt.tensors.get("lm_head", ckpt.tensor("embed"))
        logits = self.lin(rows, "lm_head", _head_weight(head, spec.weights))
        if cfg.final_logit_softcap:
            logits = _softcap(g, logits, cfg.final_logit_softcap)
        g.op("Identity", [logits], outputs=["logits"])
        if spec.plugins and spec.verify:
            self.attention.verify_tail(self.inputs, self.outputs)

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.g.nodes, "specdec_decoder", self.inputs, self.outputs, self.g.inits)
        opsets = [helper.make_opsetid("", self.g.opset), helper.make_opsetid("com.microsoft", 1)]
        if self.spec.plugins:
            opsets.append(helper.make_opsetid("specdec", 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="specdec")
        model.ir_version = 10 if self.spec.plugins else 8
        return model


def _head_weight(head: SourceTensor, fmt: WeightFormat):
    """The LM head: float32 (fp32, FP8), else its GGUF blocks where decodable, else 8-bit blocks."""
    if fmt in (WeightFormat.FP32, WeightFormat.FP8):
        return head.float32()
    if quant.decodable(head.qtype):
        return quant.decode_blocks(head.qtype, head.rows())
    return quant.quantize_rtn(head.float32(), bits=8, block_size=32)


def _softcap(g: _Builder, x: str, cap: float) -> str:
    """cap * tanh(x / cap) (Gemma-2's soft-caps of attention scores and of logits)."""
    c = g.f32(cap)
    return g.op("Mul", [g.op("Tanh", [g.op("Div", [x, c])]), c])


GATHERED = ("embed", "rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin")   # initializers a token reads one row of


def weight_bytes_per_token(model: onnx.ModelProto) -> int:
    """Bytes of weights one decode step reads: every initializer, except the tables a token
    gathers a single row of (the embedding, the rotary tables)."""
    from onnx import numpy_helper

    total = 0
    for t in model.graph.initializer:
        if t.name in GATHERED:
            continue
        total += len(t.raw_data) if t.raw_data else numpy_helper.to_array(t).nbytes
    return total


def save_model(model: onnx.ModelProto, path) -> int:
    """Save with weights in one external data file (no 2 GB protobuf limit). Returns bytes."""
    from pathlib import Path

    path = Path(path)
    data = path.with_suffix(".onnx.data")
    if data.exists():
        data.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return path.stat().st_size + data.stat().st_size
