"""One CUDA graph per step bucket (issue 41, point 4): the torch runtime's decode / verify step,
forward, LM head and verification captured together, so the host launches once per step: one
host-to-device copy of every input (packed in one buffer, `Packed`), one replay, one
device-to-host copy of the verdicts (packed inside the graph by one cat).

A step of B rows of T nodes is padded to a (batch, width) bucket (BATCH_BUCKETS x WIDTH_BUCKETS):
padding rows write their KV into the spare slot and read nothing; padding nodes have parent
PAD_PARENT, never a child, so the verify walk never reaches them; padding rows verify greedily
over their own (unused) logits. The invariant kernels give a row the same bits at any M, so the
padded bucket's rows are the eager step's (tests/test_step_graph.py).

Sampling inside the graph: the verify kernel makes a row's noise from (seed, output position) by
Philox (docs/architecture.md, decision 8), both plain device inputs: counter-based, no generator
state to advance or capture, so a replay samples what eager seeded sampling samples, token for
token, and what plain decoding samples at that position.

On a CPU (tests, the dry run) `EagerGraph` stands in for torch.cuda.CUDAGraph: the capture runs
the step function on the static buffers, a replay runs it again and copies its outputs into the
captured ones, as a graph's kernels rewrite the same memory.
Knows: buckets, static buffers, graphs. Does not know: the model, the kernels' math, requests.
"""
from __future__ import annotations

import numpy as np
import torch

from backend.kv_cache import PAD_PARENT

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32)
# verification's inputs, per row (runtime/base.sampling_arrays) and per node; a padding row's
VERIFY_PAD = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seeds": 0, "out_positions": 0}
_ALIGN = 8


def _bucket(n: int, sizes: tuple) -> int | None:
    return next((s for s in sizes if n <= s), None)


def bucket_of(b: int, t: int, rows: int, path: int) -> tuple[int, int] | None:
    """The (batch, width) bucket of a step of `b` rows of `t` nodes reading `rows` logits per row
    along paths of up to `path` nodes, or None (too large for a graph: eager)."""
    bucket = (_bucket(b, BATCH_BUCKETS), _bucket(t, WIDTH_BUCKETS))
    if None in bucket or rows > bucket[1] or path > bucket[1]:
        return None
    return bucket


def padded(host: dict[str, np.ndarray], bucket: tuple[int, int], spare_slot: int) -> dict[str, np.ndarray]:
    """A step's host inputs (torch_rt's layout, + verification's: runtime/base.sampling_arrays,
    tokens and parents [B, T]) padded to `bucket`."""
    bb, tb = bucket
    b, t = host["ids"].shape
    pad = {"ids": np.zeros((bb, tb), np.int64), "pos": np.zeros((bb, tb), np.int64),
           "wslot": np.full((bb, tb), spare_slot, np.int64),
           "wcol": np.broadcast_to(np.arange(tb), (bb, tb)).copy(),
           "paths": np.full((bb, tb, tb), -1, np.int32), "ctx": np.zeros(bb, np.int32),
           "slots": np.full(bb, spare_slot, np.int32), "index": np.zeros((bb, tb), np.int64)}
    if "features" in host:
        pad["features"] = np.zeros((bb, tb, host["features"].shape[-1]), np.float32)
    if "tokens" in host:
        pad["tokens"] = np.zeros((bb, tb), np.int64)
        pad["parents"] = np.full((bb, tb), PAD_PARENT, np.int32)
        pad.update((k, np.full(bb, v, host[k].dtype)) for k, v in VERIFY_PAD.items())
    for k, a in host.items():
        if k == "paths":
            pad[k][:b, :t, : a.shape[2]] = a
        elif a.ndim == 1:
            pad[k][:b] = a
        else:
            pad[k][:b, : a.shape[1]] = a
    return pad


class Packed:
    """Arrays of fixed shapes and dtypes in one byte buffer on the device (`tensors`: views into
    it, the graph's static inputs) and its twin on the host (pinned on a GPU): `load` fills the
    twin and copies it over in one transfer."""

    def __init__(self, specs: dict[str, np.ndarray], device: torch.device):
        offsets, total = {}, 0
        for k, a in specs.items():
            offsets[k] = total
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        self.device_buf = torch.zeros(total, dtype=torch.uint8, device=device)
        self.host_buf = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        host = self.host_buf.numpy()
        self.host = {k: host[o: o + a.nbytes].view(a.dtype).reshape(a.shape) for (k, a), o
                     in zip(specs.items(), offsets.values())}
        self.tensors = {k: self.device_buf[o: o + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
                        for (k, a), o in zip(specs.items(), offsets.values())}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        assert arrays.keys() == self.host.keys(), (sorted(arrays), sorted(self.host))
        for k, a in arrays.items():
            self.host[k][...] = a
        self.device_buf.copy_(self.host_buf, non_blocking=True)


def _torch_dtype(dt: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dt)).dtype


class EagerGraph:
    """A CUDA graph's stand-in off the GPU: `out` from running `fn(static)`; replay runs it again
    and writes its results into `out`."""

    def __init__(self, fn, static: dict):
        self.fn, self.static = fn, static
        self.out = fn(static)

    def replay(self) -> None:
        for old, new in zip(self.out, self.fn(self.static)):
            old.copy_(new)


class CudaGraph:
    """`fn(static)` captured once (after a warm-up run that compiles the kernels); `out` its
    outputs, rewritten by each replay."""

    def __init__(self, fn, static: dict, device: torch.device):
        fn(static)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(static)

    def replay(self) -> None:
        self.graph.replay()


def capture(fn, static: dict, device: torch.device):
    return CudaGraph(fn, static, device) if device.type == "cuda" else EagerGraph(fn, static)


def pack_verdicts(nodes: torch.Tensor, ids: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
    """The verify kernel's outputs (accepted_nodes [B, T] int32, output_ids [B, T] int64,
    num_accepted [B] int32) as one int32 vector, so they cross to the host in one copy."""
    return torch.cat([nodes.reshape(-1), ids.view(torch.int32).reshape(-1), num])


def unpack_verdicts(v: np.ndarray, b: int, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pack_verdicts' vector (on the host) -> (accepted_nodes [b, t], output_ids [b, t], num_accepted [b])."""
    n = b * t
    return v[:n].reshape(b, t), v[n: 3 * n].view(np.int64).reshape(b, t), v[3 * n:]
