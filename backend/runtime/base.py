"""The Runtime protocol: what the decoder and drafters may ask of an engine.

A runtime runs one decoder graph (target or draft) over batches of sequences it keeps KV for.
Everything above this line (decoder, drafters, scheduler) is device-agnostic and only handles
small host arrays: token ids, tree parents, accepted node lists.

    alloc(seq_id) / free(seq_id)      a sequence's KV storage; room(): how many more fit
    forward(seq_ids, input_ids, parents, logits_index)
                                      one pass over T new tokens per sequence (a token tree per
                                      row); their KV is pending until commit. Parents may also
                                      name nodes of earlier forwards since the last commit
                                      (a drafter growing a tree level by level)
    verify(out, drafts, params, noises, positions)
                                      the accepted path of each row's draft under the forward
                                      `out` (backend/verify.py); a device runtime runs it where
                                      the logits are, so only the accepted paths cross to the host
    commit(seq_ids, keep)             keep the accepted nodes' KV, drop the rest
    truncate(seq_id, length)          forget committed tokens beyond `length` (draft rollback)
    kernel_path                       the path its matrix products run on, for the serving metrics'
                                      specdec_kernel_info label (the native kernel's ISA), or None
    host_matmul(w)                    x -> x W^T between its forwards, on the host, the way this
                                      runtime's threads would have it (an EAGLE-3 head's fc:
                                      drafters/eagle.py); so serving never imports a device's runtime
    prefix_cache                      optional (runtimes of slots, once engine.enable_prefix_caches
                                      made one; else absent or None): prefix_cache.PrefixCache, which
                                      starts a new sequence with the cached blocks of its prompt
"""
from __future__ import annotations

import os
from typing import Callable, Protocol

import numpy as np

from backend.manifest import ModelConfig
from backend.verify import TreeVerdict, verify_tree


class ForwardOutput:
    """A forward's outputs; valid until the next forward. `logits` [B, R, V] float32 (rows chosen
    by logits_index) and `hidden` [B, T, H] float32 final-norm features of every new token, as
    host arrays; a device runtime's outputs stay on the device (`device_logits`) and cross to
    the host only if read."""

    def __init__(self, logits, hidden):
        self.device_logits, self._device_hidden = logits, hidden
        self._logits = logits if isinstance(logits, np.ndarray) else None
        self._hidden = hidden if isinstance(hidden, np.ndarray) else None

    @property
    def logits(self) -> np.ndarray:
        if self._logits is None:
            self._logits = self.device_logits.detach().float().cpu().numpy()
        return self._logits

    @property
    def hidden(self) -> np.ndarray:
        if self._hidden is None:
            self._hidden = self._device_hidden.detach().float().cpu().numpy()
        return self._hidden


def verify_on_host(out: ForwardOutput, drafts, params, noises, positions) -> list[TreeVerdict]:
    """Runtime.verify for runtimes whose logits live on the host: backend/verify.py per row."""
    return [verify_tree(d.tree, d.tokens, out.logits[b, : d.tree.num_nodes], p,
                        None if p.greedy else (lambda dd, n=nz, pos=pos: n.at(pos + dd)))
            for b, (d, p, nz, pos) in enumerate(zip(drafts, params, noises, positions))]


def forward_verify(rt, seq_ids, input_ids, parents, logits_index, drafts, params, noises, positions):
    """A speculative step's forward and verification -> (ForwardOutput, [TreeVerdict]): the
    runtime's own `forward_verify` where it has one (the torch runtime: one CUDA graph of both),
    else its forward, then its verify."""
    fused = getattr(rt, "forward_verify", None)
    if fused is not None:
        return fused(seq_ids, input_ids, parents, logits_index, drafts, params, noises, positions)
    fwd = rt.forward(seq_ids, input_ids, parents, logits_index)
    return fwd, rt.verify(fwd, drafts, params, noises, positions)


def verdicts_from_arrays(drafts, nodes: np.ndarray, ids: np.ndarray, num: np.ndarray) -> list[TreeVerdict]:
    """A device verification's outputs (accepted_nodes [B, T], output_ids [B, T], num_accepted
    [B], -1 padded: plugins/reference.py `verify`) as the rows' TreeVerdicts."""
    return [TreeVerdict(nodes[r, : num[r] + 1].astype(np.int32), ids[r, : num[r] + 1].astype(np.int64),
                        int(num[r]), not d.tree.children[int(nodes[r, num[r]])])
            for r, d in enumerate(drafts)]


def sampling_arrays(params, noises, positions, float_dtype) -> dict[str, np.ndarray]:
    """A device verification's per-row inputs (plugins/reference.py `verify`): temperature,
    top_k, top_p, min_p (floats in `float_dtype`), seeds (uint64 bits as int64), out_positions."""
    return {"temperature": np.array([p.temperature for p in params], float_dtype),
            "top_k": np.array([p.top_k for p in params], np.int32),
            "top_p": np.array([p.top_p for p in params], float_dtype),
            "min_p": np.array([p.min_p for p in params], float_dtype),
            "seeds": np.array([n.seed for n in noises], np.uint64).view(np.int64),
            "out_positions": np.array(positions, np.int64)}


def default_threads() -> int:
    """The CPU runtimes' thread count where the options give none (SPECDEC_THREADS, else up to 2)."""
    return int(os.environ.get("SPECDEC_THREADS", "0")) or min(2, os.cpu_count() or 1)


class Grow:
    """A flat float32 buffer that is reshaped into views; grows by reallocating (content lost,
    unless `keep`: then the old prefix is copied, which keeps leading rows of a row-major view)."""

    __slots__ = ("flat",)

    def __init__(self):
        self.flat = np.empty(0, np.float32)

    def view(self, shape, keep: int = 0) -> np.ndarray:
        n = int(np.prod(shape))
        if self.flat.size < n:
            old = self.flat
            self.flat = np.empty(n + n // 4 + 4096, np.float32)
            if keep:
                self.flat[:keep] = old[:keep]
        return self.flat[:n].reshape(shape)


class Runtime(Protocol):
    config: ModelConfig
    num_layers: int
    max_seq_len: int
    ragged: bool             # a forward computes each row's own nodes only (padding costs nothing)
    kernel_path: str | None  # where its matrix products run, when the device names one

    def alloc(self, seq_id: int) -> None: ...

    def free(self, seq_id: int) -> None: ...

    def room(self) -> int: ...

    def length(self, seq_id: int) -> int: ...

    def forward(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                logits_index: np.ndarray, extra_inputs: dict | None = None) -> ForwardOutput: ...

    def verify(self, out: ForwardOutput, drafts: list, params: list, noises: list,
               positions: list[int]) -> list[TreeVerdict]: ...

    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> None: ...

    def truncate(self, seq_id: int, length: int) -> None: ...

    def host_matmul(self, w: np.ndarray) -> Callable[[np.ndarray], np.ndarray]: ...

    def close(self) -> None: ...
