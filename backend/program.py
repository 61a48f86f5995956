"""The decoder layer as a program: the op kinds a layer is written in, in their order (issue 51).

`ModelConfig.program(i)` (manifest.py) is the one place that knows which steps a layer has and in
which order; a family that places a norm elsewhere, drops one, or runs attention and MLP side by
side is another tuple there (plus its weights' names in buildlib/checkpoint.py). Every engine
interprets the tuple: the torch model (runtime/torch_model.py: a loop over the ops, and the fused
GPU step a peephole pass over the same ops), the ONNX graph (buildlib/graph.py, also the TensorRT
engine graph), the native kernel (plugins/native/forward.c: a switch over the op records that
runtime/native.py fills), and the head trainer (train/eagle_model.py).

The machine has two values: x, the residual stream, and h, the value being worked on. At a layer's
start and after every Residual, h is x itself.

    Features()               x here is one of the forward's feature outputs (the engine's feature
                             layers, EAGLE-3: the stream entering the layer)
    Norm(weight, feature)    h = RMSNorm(h) w, w the layer's tensor `weight` (absent from an engine
                             file: h as it is, an EAGLE-1/2 head's input); with `feature` (an
                             EAGLE-3 head): h = [RMSNorm(embedding) w, RMSNorm(h) w_feature]
    Linear(name, parts, bias, out)   h = h W^T (+ b): W the rows of tensors `parts` one after the
                             other (an engine may fuse them, named `name`), b their `<part>_bias`
    HeadNorm(q, k)           h's q heads and k heads (h: q/k/v rows) each RMS-normed over the head
    Rope(table)              h's q and k heads rotated at the node's position ("global": the
                             model's table; "local": the sliding layers' own base)
    Attention(window, softcap, scale)   h (q/k/v rows) -> each node's attention over the cache and
                             its tree path, q times `scale`, scores soft-capped (0: none), keys
                             within `window` (0: all); its k and v are written to the cache
    Gate(act)                h = act(h[:, :I]) * h[:, I:] ("silu": SwiGLU, "gelu_tanh": GeGLU)
    Residual(norm, parallel) x = x + h (h RMS-normed by the tensor `norm` first, where named);
                             parallel: x is left as it is and this branch's value waits for the
                             next Residual, which adds both, (x + this) + that (a parallel
                             attention and MLP block)

Knows: the op kinds and their meaning. Does not know: any engine, any checkpoint format.
"""
from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Features:
    pass


@dataclass(frozen=True)
class Norm:
    weight: str
    feature: str | None = None


@dataclass(frozen=True)
class Linear:
    name: str                     # "qkv" | "o" | "gate_up" | "down": the fused matrix's name
    parts: tuple[str, ...]        # the checkpoint's tensors, their rows in this order
    out: int                      # outputs per row
    bias: bool = False

    @property
    def bias_parts(self) -> tuple[str, ...]:
        return tuple(f"{p}_bias" for p in self.parts)


@dataclass(frozen=True)
class HeadNorm:
    q: str = "q_norm"
    k: str = "k_norm"


@dataclass(frozen=True)
class Rope:
    table: str = "global"         # "global" | "local"


@dataclass(frozen=True)
class Attention:
    window: int = 0
    softcap: float = 0.0
    scale: float = 1.0


@dataclass(frozen=True)
class Gate:
    act: str = "silu"


@dataclass(frozen=True)
class Residual:
    norm: str | None = None
    parallel: bool = False


Op = Features | Norm | Linear | HeadNorm | Rope | Attention | Gate | Residual
KINDS = (Features, Norm, Linear, HeadNorm, Rope, Attention, Gate, Residual)   # forward.c SD_OP_*, in order
ACTIVATIONS = ("silu", "gelu_tanh")


def check(ops: tuple[Op, ...], norms: tuple[str, ...]) -> tuple[Op, ...]:
    """`ops` if every engine can run it: known kinds, norm weights among `norms`, one attention, a
    Rope or HeadNorm only before it (a HeadNorm before any Rope), a parallel Residual followed by
    another Residual."""
    assert all(type(op) in KINDS for op in ops), ops
    attention = [j for j, op in enumerate(ops) if isinstance(op, Attention)]
    assert len(attention) == 1, f"a layer has one Attention: {ops}"
    assert all(j < attention[0] for j, op in enumerate(ops) if isinstance(op, (Rope, HeadNorm))), ops
    rope = [j for j, op in enumerate(ops) if isinstance(op, Rope)]
    assert all(j < r for j, op in enumerate(ops) if isinstance(op, HeadNorm) for r in rope), f"q/k norms before rotary: {ops}"
    for j, op in enumerate(ops):
        if isinstance(op, Norm):
            assert op.weight in norms and (op.feature is None or op.feature in norms), op
        elif isinstance(op, Residual):
            assert op.norm is None or op.norm in norms, op
            assert not op.parallel or any(isinstance(o, Residual) and not o.parallel for o in ops[j + 1:]), ops
        elif isinstance(op, HeadNorm):
            assert op.q in norms and op.k in norms, op
        elif isinstance(op, Gate):
            assert op.act in ACTIVATIONS, op
    return ops


def attention(ops: tuple[Op, ...]) -> Attention:
    """The layer's attention (its window, soft-cap and q's scale)."""
    return next(op for op in ops if isinstance(op, Attention))


def norms(ops: tuple[Op, ...]) -> set[str]:
    """The norm weights a program reads."""
    out = set()
    for op in ops:
        if isinstance(op, Norm):
            out |= {op.weight} | ({op.feature} if op.feature else set())
        elif isinstance(op, HeadNorm):
            out |= {op.q, op.k}
        elif isinstance(op, Residual) and op.norm:
            out.add(op.norm)
    return out
