"""GPU runtime: the torch model (torch_model.py) over a KV cache preallocated per sequence slot,
attention and verification through the Triton kernels (plugins/kernels.py), CUDA graphs for the
decode step. On a CPU (tests, the FP8 quality measurement) the same code runs with the kernels'
numpy references in their place.

KV: one tensor [layers, 2, S + 1, Hkv, L, D] allocated at load (S = RuntimeOptions.max_sequences;
slot S takes the writes of padding rows; L = max_seq_len + SCRATCH_COLUMNS for tree nodes), its
bookkeeping in kv_slots.py: joins and leaves cost nothing (no KV groups, unlike the ONNX
runtime); commit moves the accepted nodes' columns down to the committed end (a few columns per
row), so no garbage stays.
A forward's tree attention reads each node's committed columns and its path (plugins/reference.py),
on a sliding layer only the entries within the layer's window of the node's position, the scores
soft-capped where the model caps them.

CUDA graphs: a decode-sized step (rows <= 64, nodes per row <= 32) is padded to a (batch, width)
bucket and replays the graph captured for it on first use; inputs go through static buffers, so
the same `_compute` runs eagerly, in capture, and on the CPU.
Knows: torch tensors, slots, CUDA graphs. Does not know: sampling rules, drafting, requests.
"""
from __future__ import annotations

import numpy as np
import torch

from backend.config import RuntimeOptions
from backend.kv_cache import PAD_PARENT
from backend.kv_slots import SCRATCH_COLUMNS, SlotSequences, SlotTable
from backend.manifest import ModelConfig
from backend.runtime.base import ForwardOutput, sampling_arrays, verdicts_from_arrays, verify_on_host
from backend.runtime.slot_blocks import SlotBlocks
from backend.runtime.torch_model import TorchModel, load_recipe, load_tensors

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32)


def _bucket(n: int, sizes: tuple) -> int | None:
    return next((s for s in sizes if n <= s), None)


class TorchRuntime(SlotSequences):
    ragged = False
    def __init__(self, engine_path, config: ModelConfig, num_layers: int, max_seq_len: int,
                 options: RuntimeOptions = RuntimeOptions(), device: str | None = None,
                 tensors: dict | None = None, dtype: torch.dtype | None = None,
                 feature_layers: tuple[int, ...] = (), fp8_recipe=None):
        """engine_path: an engine file of build/torch_engine.py (or `tensors` in its layout,
        for benchmarks on random weights, with their `fp8_recipe`, runtime/fp8.py); dtype:
        compute dtype (bf16 on a GPU, fp32 on CPU)."""
        self.config = config
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if options.threads and self.device.type == "cpu":
            torch.set_num_threads(options.threads)
        if tensors is None:
            tensors, fp8_recipe = load_tensors(engine_path), load_recipe(engine_path)
        self.model = TorchModel(config, tensors, num_layers, self.device, max_seq_len, dtype, feature_layers,
                                fp8_recipe)
        self.capacity = options.max_sequences or (64 if self.device.type == "cuda" else 16)
        kv_dtype = self.model.dtype
        self.columns = max_seq_len + SCRATCH_COLUMNS
        self.cache = torch.zeros((num_layers, 2, self.capacity + 1, config.num_kv_heads, self.columns,
                                  config.head_dim), dtype=kv_dtype, device=self.device)
        self.slots = SlotTable(self.capacity, self.columns, max_seq_len)
        self._graphs: dict[tuple[int, int], tuple] = {}
        self.use_graphs = self.device.type == "cuda" and options.cuda_graphs
        # attention by the Triton kernel (a GPU), else by its numpy reference; a test may set it
        # on a CPU, where the kernel runs in Triton's interpreter (TRITON_INTERPRET=1)
        self.kernels = self.device.type == "cuda"

    # --- forward -----------------------------------------------------------------------------
    def forward(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                logits_index: np.ndarray, extra_inputs: dict | None = None) -> ForwardOutput:
        b, t = input_ids.shape
        assert parents.shape == (b, t) and logits_index.shape[0] == b, (parents.shape, logits_index.shape)
        host, new_paths = self.slots.layout(seq_ids, parents)
        del host["n_prior"]                  # the attention reads scratch from the cache
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
        self.slots.extend(seq_ids, new_paths)
        return ForwardOutput(logits, hidden)

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _compute(self, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward from device inputs -> (logits [B, R, V] float32, hidden [B, T, H])."""
        b, t = x["ids"].shape
        kv = _SlotKV(self, x)
        feats = x["features"].reshape(b * t, -1) if "features" in x else None
        hidden, normed = self.model.forward(x["ids"].reshape(-1), x["pos"].reshape(-1), kv, feats)
        hidden, normed = hidden.view(b, t, -1), normed.view(b, t, -1)
        return self.model.head(normed, x["index"]), hidden

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
        """Keep scratch nodes `keep` of each row: their columns move down to the committed end."""
        sl, src, dst = self.slots.commit(seq_ids, keep)
        if sl.size:
            sl, src, dst = self._dev(sl), self._dev(src), self._dev(dst)
            self.cache[:, :, sl, :, dst] = self.cache[:, :, sl, :, src]

    def truncate(self, seq_id: int, length: int) -> None:
        self.slots.truncate(seq_id, length)

    def block_storage(self) -> SlotBlocks:
        return SlotBlocks(lambda: [self.cache], 2, self.slots)    # prefix cache blocks, on the device

    # --- verify ------------------------------------------------------------------------------
    def verify(self, out: ForwardOutput, drafts, params, noises, positions):
        """On a GPU, the verify kernel on the device logits (only accepted paths come back);
        elsewhere backend/verify.py on the host (the kernel's reference)."""
        if self.device.type != "cuda":
            return verify_on_host(out, drafts, params, noises, positions)
        from plugins import kernels

        b = len(drafts)
        t = max(d.tree.num_nodes for d in drafts)
        tokens = np.zeros((b, t), np.int64)
        parents = np.full((b, t), PAD_PARENT, np.int32)
        for r, d in enumerate(drafts):
            tokens[r, : d.tree.num_nodes], parents[r, : d.tree.num_nodes] = d.tokens, d.tree.parents
        s = {k: self._dev(v) for k, v in sampling_arrays(params, noises, positions, np.float64).items()}
        nodes, ids, num = kernels.verify(
            out.device_logits[:, :t], self._dev(tokens), self._dev(parents), s["temperature"], s["top_k"],
            s["top_p"], s["min_p"], s["seeds"], s["out_positions"])
        return verdicts_from_arrays(drafts, nodes.cpu().numpy(), ids.cpu().numpy(), num.cpu().numpy())

    def close(self) -> None:
        self.slots.clear()
        self._graphs.clear()
        self.cache = None
        self.prefix_cache = None


class _SlotKV:
    """The model's KV callback for one forward: writes to the nodes' (slot, column), attention
    (the model's scale and soft-cap, the layer's sliding window) through the kernel (GPU) or its
    numpy reference (CPU)."""

    def __init__(self, rt: TorchRuntime, x: dict):
        self.rt, self.x = rt, x
        self.wslot, self.wcol = x["wslot"].reshape(-1), x["wcol"].reshape(-1)
        self.fused = rt.kernels              # the model's fused kernels write the cache (cache())

    def cache(self, layer: int) -> tuple:
        """(k cache, v cache) [S + 1, Hkv, L, D] of `layer` and the new tokens' (slot, column) [N]."""
        return self.rt.cache[layer, 0], self.rt.cache[layer, 1], self.wslot, self.wcol

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.rt.cache[layer]
        c[0, self.wslot, :, self.wcol] = k.to(c.dtype)
        c[1, self.wslot, :, self.wcol] = v.to(c.dtype)

    def attend(self, layer: int, q: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> [N, Hq, D] float32, or `dtype` (the kernel rounds its output as .to(dtype) does)."""
        b, t = self.x["ids"].shape
        q = q.view(b, t, q.shape[1], q.shape[2])
        kc, vc = self.rt.cache[layer, 0], self.rt.cache[layer, 1]
        scale, window, cap = self.rt.model.scale, self.rt.model.windows[layer], self.rt.model.softcap
        if self.rt.kernels:
            from plugins.kernels import tree_attention

            o = tree_attention(q.contiguous(), kc, vc, self.x["slots"], self.x["ctx"], self.x["paths"], scale,
                               window, cap, dtype)
        else:
            from plugins.reference import tree_attention_ref

            o = torch.from_numpy(tree_attention_ref(
                q.float().numpy(), kc.float().numpy(), vc.float().numpy(), self.x["slots"].numpy(),
                self.x["ctx"].numpy(), self.x["paths"].numpy(), scale, window, cap))
        return o.view(b * t, q.shape[2], q.shape[3]) if dtype is None else o.view(b * t, q.shape[2], q.shape[3]).to(dtype)
