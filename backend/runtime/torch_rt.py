"""GPU runtime: the torch model (torch_model.py) over a KV cache preallocated per sequence slot,
attention and verification through the Triton kernels (plugins/kernels.py), CUDA graphs for the
decode step. On a CPU (tests, the FP8 quality measurement) the same code runs with the kernels'
numpy references in their place.

KV: one tensor [layers, 2, S + 1, Hkv, L, D] allocated at load (S = RuntimeOptions.max_sequences;
slot S takes the writes of padding rows; L = max_seq_len + SCRATCH_COLUMNS for tree nodes). A sequence owns a slot while it lives: its committed
tokens at columns [0, length), the nodes of the forwards since its last commit (scratch) right
after them. Joins and leaves cost nothing (no KV groups, unlike the ONNX runtime); commit moves the
accepted nodes' columns down to the committed end (a few columns per row), so no garbage stays.
A forward's tree attention reads each node's committed columns and its path (plugins/reference.py).

CUDA graphs: a decode-sized step (rows <= 64, nodes per row <= 32) is padded to a (batch, width)
bucket and replays the graph captured for it on first use; inputs go through static buffers, so
the same `_compute` runs eagerly, in capture, and on the CPU.
Knows: torch tensors, slots, CUDA graphs. Does not know: sampling rules, drafting, requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from backend.config import RuntimeOptions
from backend.kv_cache import PAD_PARENT
from backend.manifest import ModelConfig
from backend.runtime.base import ForwardOutput, verify_on_host
from backend.runtime.torch_model import TorchModel, load_tensors

SCRATCH_COLUMNS = 96       # columns past max_seq_len: tree nodes of a sequence near the end
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass
class _Seq:
    slot: int
    length: int = 0                                       # committed columns
    paths: list[list[int]] = field(default_factory=list)  # scratch node -> its path (scratch ids)


def _bucket(n: int, sizes: tuple) -> int | None:
    return next((s for s in sizes if n <= s), None)


class TorchRuntime:
    def __init__(self, engine_path, config: ModelConfig, num_layers: int, max_seq_len: int,
                 options: RuntimeOptions = RuntimeOptions(), device: str | None = None,
                 tensors: dict | None = None, dtype: torch.dtype | None = None):
        """engine_path: an engine file of build/torch_engine.py (or `tensors` in its layout,
        for benchmarks on random weights); dtype: compute dtype (bf16 on a GPU, fp32 on CPU)."""
        self.config = config
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if options.threads and self.device.type == "cpu":
            torch.set_num_threads(options.threads)
        self.model = TorchModel(config, tensors if tensors is not None else load_tensors(engine_path),
                                num_layers, self.device, max_seq_len, dtype)
        self.capacity = options.max_sequences or (64 if self.device.type == "cuda" else 16)
        kv_dtype = self.model.dtype
        self.columns = max_seq_len + SCRATCH_COLUMNS
        self.cache = torch.zeros((num_layers, 2, self.capacity + 1, config.num_kv_heads, self.columns,
                                  config.head_dim), dtype=kv_dtype, device=self.device)
        self._free = list(range(self.capacity))
        self._seqs: dict[int, _Seq] = {}
        self._graphs: dict[tuple[int, int], tuple] = {}
        self.use_graphs = self.device.type == "cuda" and options.cuda_graphs

    # --- sequences ---------------------------------------------------------------------------
    def alloc(self, seq_id: int) -> None:
        assert seq_id not in self._seqs, f"sequence {seq_id} already allocated"
        if not self._free:
            raise RuntimeError(f"all {self.capacity} KV slots are taken (RuntimeOptions.max_sequences)")
        self._seqs[seq_id] = _Seq(self._free.pop(0))

    def free(self, seq_id: int) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is not None:
            self._free.append(s.slot)

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def room(self) -> int:
        return len(self._free)

    # --- forward -----------------------------------------------------------------------------
    def forward(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                logits_index: np.ndarray, extra_inputs: dict | None = None) -> ForwardOutput:
        b, t = input_ids.shape
        assert parents.shape == (b, t) and logits_index.shape[0] == b, (parents.shape, logits_index.shape)
        host, new_paths = self._layout(seq_ids, parents)
        host["ids"] = np.asarray(input_ids, np.int64)
        host["index"] = np.asarray(logits_index, np.int64)
        if extra_inputs:
            host["features"] = np.asarray(extra_inputs["features"], np.float32)
        bucket = (_bucket(b, BATCH_BUCKETS), _bucket(t, WIDTH_BUCKETS))
        if (self.use_graphs and None not in bucket and logits_index.shape[1] <= bucket[1]
                and host["paths"].shape[2] <= bucket[1]):
            logits, hidden = self._replay(bucket, host)
            logits, hidden = logits[:b, : logits_index.shape[1]], hidden[:b, :t]
        else:
            logits, hidden = self._compute({k: self._dev(v) for k, v in host.items()})
        for sid, paths in zip(seq_ids, new_paths):
            self._seqs[sid].paths.extend(paths)
        return ForwardOutput(logits, hidden)

    def _layout(self, seq_ids, parents):
        """Host arrays of a forward: rotary positions, the (slot, column) each node's KV is
        written to, and the paths tree attention reads; plus each row's new scratch paths."""
        b, t = parents.shape
        spare, L = self.capacity, self.columns
        pos = np.zeros((b, t), np.int64)
        wslot = np.zeros((b, t), np.int64)
        wcol = np.zeros((b, t), np.int64)
        new_paths = []
        for r, sid in enumerate(seq_ids):
            s = self._seqs[sid]
            n0 = len(s.paths)
            mine = []
            for j in range(t):
                p = int(parents[r, j])
                path = [] if p == PAD_PARENT else ([n0 + j] if p < 0 else
                                                   (s.paths[p] if p < n0 else mine[p - n0]) + [n0 + j])
                assert p < n0 + j, f"parent {p} of scratch node {n0 + j} is not an earlier node"
                mine.append(path)
                col = s.length + n0 + j
                pos[r, j] = s.length + max(len(path) - 1, 0)
                if path and (col >= L or pos[r, j] >= self.max_seq_len):
                    raise ValueError(f"sequence too long: position {pos[r, j]} (column {col}) >= "
                                     f"max_seq_len {self.max_seq_len}")
                wslot[r, j], wcol[r, j] = (s.slot, col) if col < L else (spare, j)
            new_paths.append(mine)
        paths = np.full((b, t, max(1, max(len(p) for m in new_paths for p in m))), -1, np.int32)
        for r, mine in enumerate(new_paths):
            for j, path in enumerate(mine):
                paths[r, j, : len(path)] = path
        ctx = np.array([self._seqs[s].length for s in seq_ids], np.int32)
        slots = np.array([self._seqs[s].slot for s in seq_ids], np.int32)
        return {"pos": pos, "wslot": wslot, "wcol": wcol, "paths": paths, "ctx": ctx,
                "slots": slots}, new_paths

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _compute(self, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward from device inputs -> (logits [B, R, V] float32, hidden [B, T, H])."""
        b, t = x["ids"].shape
        kv = _SlotKV(self, x)
        feats = x["features"].reshape(b * t, -1) if "features" in x else None
        hidden = self.model.forward(x["ids"].reshape(-1), x["pos"].reshape(-1), kv, feats).view(b, t, -1)
        rows = hidden[torch.arange(b, device=self.device)[:, None], x["index"]]
        logits = self.model.logits(rows.reshape(-1, rows.shape[-1])).view(b, x["index"].shape[1], -1)
        return logits, hidden

    def _replay(self, bucket: tuple[int, int], host: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy `host` into the bucket's static buffers (padding rows and nodes write into the
        spare slot and read nothing) and replay its graph, capturing it on first use."""
        bb, tb = bucket
        b, t = host["ids"].shape
        pad = {"ids": np.zeros((bb, tb), np.int64), "pos": np.zeros((bb, tb), np.int64),
               "wslot": np.full((bb, tb), self.capacity, np.int64),
               "wcol": np.broadcast_to(np.arange(tb), (bb, tb)).copy(),
               "paths": np.full((bb, tb, tb), -1, np.int32), "ctx": np.zeros(bb, np.int32),
               "slots": np.full(bb, self.capacity, np.int32), "index": np.zeros((bb, tb), np.int64)}
        if "features" in host:
            pad["features"] = np.zeros((bb, tb, host["features"].shape[-1]), np.float32)
        for k, a in host.items():
            if k == "paths":
                pad[k][:b, :t, : a.shape[2]] = a
            elif a.ndim == 1:
                pad[k][:b] = a
            else:
                pad[k][:b, : a.shape[1]] = a
        if bucket not in self._graphs:
            static = {k: self._dev(v) for k, v in pad.items()}
            self._compute(static)                            # compile the kernels, warm up
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._compute(static)
            self._graphs[bucket] = (graph, static, out)
        graph, static, out = self._graphs[bucket]
        for k, v in pad.items():
            static[k].copy_(torch.from_numpy(v), non_blocking=True)
        graph.replay()
        return out

    # --- commit ------------------------------------------------------------------------------
    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> None:
        """Keep scratch nodes `keep` (increasing; a root-to-node path) of each row: their
        columns move down to the committed end, the rest of the scratch is dropped."""
        moves = [[], [], []]                                  # slots, from, to
        for sid, nodes in zip(seq_ids, keep):
            s = self._seqs[sid]
            nodes = np.asarray(nodes, np.int64)
            assert nodes.size == 0 or (np.all(np.diff(nodes) > 0) and nodes[-1] < len(s.paths)), \
                (nodes.tolist(), len(s.paths))
            src = s.length + nodes
            dst = s.length + np.arange(nodes.size)
            moved = src != dst
            if moved.any():
                moves[0].append(np.full(int(moved.sum()), s.slot))
                moves[1].append(src[moved])
                moves[2].append(dst[moved])
            s.length += int(nodes.size)
            s.paths = []
        if moves[0]:
            sl, src, dst = (self._dev(np.concatenate(m)) for m in moves)
            self.cache[:, :, sl, :, dst] = self.cache[:, :, sl, :, src]

    def truncate(self, seq_id: int, length: int) -> None:
        s = self._seqs[seq_id]
        assert 0 <= length <= s.length, (length, s.length)
        s.length, s.paths = length, []

    # --- verify ------------------------------------------------------------------------------
    def verify(self, out: ForwardOutput, drafts, params, noises, positions):
        """On a GPU, the verify kernel on the device logits (only accepted paths come back);
        elsewhere backend/verify.py on the host (the kernel's reference)."""
        if self.device.type != "cuda":
            return verify_on_host(out, drafts, params, noises, positions)
        from backend.verify import TreeVerdict
        from plugins import kernels

        b = len(drafts)
        t = max(d.tree.num_nodes for d in drafts)
        tokens = np.zeros((b, t), np.int64)
        parents = np.full((b, t), PAD_PARENT, np.int32)
        for r, d in enumerate(drafts):
            tokens[r, : d.tree.num_nodes], parents[r, : d.tree.num_nodes] = d.tokens, d.tree.parents
        col = lambda xs, dt: self._dev(np.array(xs, dt))
        nodes, ids, num = kernels.verify(
            out.device_logits[:, :t], self._dev(tokens), self._dev(parents),
            col([p.temperature for p in params], np.float64), col([p.top_k for p in params], np.int32),
            col([p.top_p for p in params], np.float64), col([p.min_p for p in params], np.float64),
            self._dev(np.array([n.seed for n in noises], np.uint64).view(np.int64)), col(positions, np.int64))
        nodes, ids, num = nodes.cpu().numpy(), ids.cpu().numpy(), num.cpu().numpy()
        return [TreeVerdict(nodes[r, : num[r] + 1].astype(np.int32), ids[r, : num[r] + 1].astype(np.int64),
                            int(num[r]), not d.tree.children[int(nodes[r, num[r]])])
                for r, d in enumerate(drafts)]

    def close(self) -> None:
        self._seqs.clear()
        self._graphs.clear()
        self.cache = None


class _SlotKV:
    """The model's KV callback for one forward: writes to the nodes' (slot, column), attention
    through the kernel (GPU) or its numpy reference (CPU)."""

    def __init__(self, rt: TorchRuntime, x: dict):
        self.rt, self.x = rt, x
        self.wslot, self.wcol = x["wslot"].reshape(-1), x["wcol"].reshape(-1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.rt.cache[layer]
        c[0, self.wslot, :, self.wcol] = k.to(c.dtype)
        c[1, self.wslot, :, self.wcol] = v.to(c.dtype)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, t = self.x["ids"].shape
        q = q.view(b, t, q.shape[1], q.shape[2])
        kc, vc = self.rt.cache[layer, 0], self.rt.cache[layer, 1]
        scale = self.rt.model.scale
        if self.rt.device.type == "cuda":
            from plugins.kernels import tree_attention

            o = tree_attention(q.contiguous(), kc, vc, self.x["slots"], self.x["ctx"], self.x["paths"], scale)
        else:
            from plugins.reference import tree_attention_ref

            o = torch.from_numpy(tree_attention_ref(
                q.float().numpy(), kc.float().numpy(), vc.float().numpy(), self.x["slots"].numpy(),
                self.x["ctx"].numpy(), self.x["paths"].numpy(), scale))
        return o.view(b * t, q.shape[2], q.shape[3])
