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

CUDA graphs (step_graph.py): a decode-sized step (rows <= 64, nodes per row <= 32) is padded to a
(batch, width) bucket and replays the graph captured for it on first use; inputs go through
static buffers, so the same `_compute` runs eagerly, in capture, and on the CPU. A speculative
step (`forward_verify`) replays one graph of forward, LM head and verification: the host copies
its inputs in once, launches once and reads back only the verdicts.
Knows: torch tensors, slots, CUDA graphs. Does not know: sampling rules, drafting, requests.
"""
from __future__ import annotations

import numpy as np
import torch

from backend.config import RuntimeOptions
from backend.kv_cache import PAD_PARENT
from backend.kv_slots import SCRATCH_COLUMNS, SlotSequences, SlotTable
from backend.manifest import ModelConfig
from backend.runtime import step_graph
from backend.runtime.base import ForwardOutput, sampling_arrays, verdicts_from_arrays, verify_on_host
from backend.runtime.host import HostSide
from backend.runtime.slot_blocks import SlotBlocks
from backend.runtime.torch_model import TorchModel, load_recipe, load_tensors, load_w8a8_from


class TorchRuntime(HostSide, SlotSequences):
    ragged = False
    def __init__(self, engine_path, config: ModelConfig, num_layers: int, max_seq_len: int,
                 options: RuntimeOptions = RuntimeOptions(), device: str | None = None,
                 tensors: dict | None = None, dtype: torch.dtype | None = None,
                 feature_layers: tuple[int, ...] = (), fp8_recipe=None):
        """engine_path: an engine file of devices/cuda/export.py (or `tensors` in its layout,
        for benchmarks on random weights, with their `fp8_recipe`, runtime/fp8.py); dtype:
        compute dtype (bf16 on a GPU, fp32 on CPU)."""
        self.config = config
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if options.threads and self.device.type == "cpu":
            torch.set_num_threads(options.threads)
        w8a8_from = None
        if tensors is None:
            tensors, fp8_recipe = load_tensors(engine_path), load_recipe(engine_path)
            w8a8_from = load_w8a8_from(engine_path)
        self.model = TorchModel(config, tensors, num_layers, self.device, max_seq_len, dtype, feature_layers,
                                fp8_recipe)
        self.model.w8a8_from = w8a8_from
        self.capacity = options.max_sequences or (64 if self.device.type == "cuda" else 16)
        kv_dtype = self.model.dtype
        self.columns = max_seq_len + SCRATCH_COLUMNS
        self.cache = torch.zeros((num_layers, 2, self.capacity + 1, config.num_kv_heads, self.columns,
                                  config.head_dim), dtype=kv_dtype, device=self.device)
        self.slots = SlotTable(self.capacity, self.columns, max_seq_len)
        self._graphs: dict[tuple, tuple] = {}     # (batch, width, step function, features) -> graph, buffers
        self.use_graphs = self.device.type == "cuda" and options.cuda_graphs
        # attention by the Triton kernel (a GPU), else by its numpy reference; a test may set it
        # on a CPU, where the kernel runs in Triton's interpreter (TRITON_INTERPRET=1)
        self.kernels = self.device.type == "cuda"
        # verify() by the kernel (a GPU); the GPU check's dry run sets it on a CPU, where the kernel
        # runs in the interpreter (tests compare the graphs' kernel to the host's verification)
        self.device_verify = self.device.type == "cuda"

    # --- forward -----------------------------------------------------------------------------
    def forward(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                logits_index: np.ndarray, extra_inputs: dict | None = None) -> ForwardOutput:
        host, new_paths = self._layout(seq_ids, input_ids, parents, logits_index, extra_inputs)
        return self._forward(seq_ids, host, new_paths)

    def _forward(self, seq_ids: list[int], host: dict, new_paths) -> ForwardOutput:
        b, t = host["ids"].shape
        bucket = self._graph_bucket(host)
        if bucket is not None:
            logits, hidden = self._replay(bucket, host, self._compute)
            logits, hidden = logits[:b, : host["index"].shape[1]], hidden[:b, :t]
        else:
            logits, hidden = self._compute({k: self._dev(v) for k, v in host.items()})
        self.slots.extend(seq_ids, new_paths)
        return ForwardOutput(logits, hidden)

    def forward_verify(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                       logits_index: np.ndarray, drafts, params, noises, positions):
        """forward, then verify (runtime/base.forward_verify): where the step fits a graph bucket
        and the kernels run, one replay of forward, LM head and verification together (one input
        copy, one launch, the verdicts back in one copy); else the two calls."""
        host, new_paths = self._layout(seq_ids, input_ids, parents, logits_index)
        bucket = self._graph_bucket(host) if self.kernels else None
        if bucket is None:
            fwd = self._forward(seq_ids, host, new_paths)
            return fwd, self.verify(fwd, drafts, params, noises, positions)
        host.update(self._verify_inputs(drafts, params, noises, positions, input_ids.shape[1]))
        logits, hidden, packed = self._replay(bucket, host, self._step)
        self.slots.extend(seq_ids, new_paths)
        b, t = input_ids.shape
        nodes, ids, num = step_graph.unpack_verdicts(packed.cpu().numpy(), *bucket)
        verdicts = verdicts_from_arrays(drafts, nodes[:b], ids[:b], num[:b])
        return ForwardOutput(logits[:b, : logits_index.shape[1]], hidden[:b, :t]), verdicts

    def _layout(self, seq_ids, input_ids, parents, logits_index, extra_inputs=None) -> tuple[dict, list]:
        """A forward's host inputs (slots' layout, ids, logits index, features) and its new paths."""
        b, t = input_ids.shape
        assert parents.shape == (b, t) and logits_index.shape[0] == b, (parents.shape, logits_index.shape)
        host, new_paths = self.slots.layout(seq_ids, parents)
        del host["n_prior"]                  # the attention reads scratch from the cache
        host["ids"] = np.asarray(input_ids, np.int64)
        host["index"] = np.asarray(logits_index, np.int64)
        if extra_inputs:
            host["features"] = np.asarray(extra_inputs["features"], np.float32)
        return host, new_paths

    def _graph_bucket(self, host: dict) -> tuple[int, int] | None:
        if not self.use_graphs:
            return None
        b, t = host["ids"].shape
        return step_graph.bucket_of(b, t, host["index"].shape[1], host["paths"].shape[2])

    def _verify_inputs(self, drafts, params, noises, positions, t: int) -> dict[str, np.ndarray]:
        """Verification's host inputs: the drafts' tokens and parents [B, T] (PAD_PARENT padded)
        and the rows' sampling arrays (runtime/base.sampling_arrays, float64)."""
        b = len(drafts)
        tokens = np.zeros((b, t), np.int64)
        parents = np.full((b, t), PAD_PARENT, np.int32)
        for r, d in enumerate(drafts):
            tokens[r, : d.tree.num_nodes], parents[r, : d.tree.num_nodes] = d.tokens, d.tree.parents
        return {"tokens": tokens, "parents": parents, **sampling_arrays(params, noises, positions, np.float64)}

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _compute(self, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward from device inputs -> (logits [B, R, V] float32, hidden [B, T, H])."""
        b, t = x["ids"].shape
        kv = _SlotKV(self, x)
        feats = x["features"].reshape(b * t, -1) if "features" in x else None
        wide = self.model.w8a8_from is not None and t >= self.model.w8a8_from     # a prefill chunk's
        hidden, normed = self.model.forward(x["ids"].reshape(-1), x["pos"].reshape(-1), kv, feats, wide)
        hidden, normed = hidden.view(b, t, -1), normed.view(b, t, -1)
        return self.model.head(normed, x["index"]), hidden

    def _step(self, x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A speculative step from device inputs, all on the device (what a graph captures): the
        forward, then the verify kernel on its logits -> (logits, hidden, the verdicts packed)."""
        from plugins import kernels

        logits, hidden = self._compute(x)
        nodes, ids, num = kernels.verify(logits, x["tokens"], x["parents"], x["temperature"], x["top_k"], x["top_p"],
                                         x["min_p"], x["seeds"], x["out_positions"])
        return logits, hidden, step_graph.pack_verdicts(nodes, ids, num)

    def _replay(self, bucket: tuple[int, int], host: dict, fn) -> tuple:
        """Copy `host` (padded to `bucket`: step_graph.padded) into the static buffers of `fn`'s
        graph for the bucket in one transfer and replay it, capturing it on first use."""
        arrays = step_graph.padded(host, bucket, self.capacity)
        key = (*bucket, fn.__name__, "features" in host)
        if key not in self._graphs:
            packed = step_graph.Packed(arrays, self.device)
            packed.load(arrays)
            self._graphs[key] = (step_graph.capture(fn, packed.tensors, self.device), packed)
        graph, packed = self._graphs[key]
        packed.load(arrays)
        graph.replay()
        return graph.out

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
        """On a GPU (`device_verify`), the verify kernel on the device logits (only accepted
        paths come back); elsewhere backend/verify.py on the host (the kernel's reference)."""
        if not self.device_verify:
            return verify_on_host(out, drafts, params, noises, positions)
        from plugins import kernels

        x = {k: self._dev(v) for k, v in self._verify_inputs(drafts, params, noises, positions,
                                                               max(d.tree.num_nodes for d in drafts)).items()}
        nodes, ids, num = kernels.verify(out.device_logits[:, : x["tokens"].shape[1]], x["tokens"], x["parents"],
                                         x["temperature"], x["top_k"], x["top_p"], x["min_p"], x["seeds"],
                                         x["out_positions"])
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
        op = self.rt.model.layers[layer].attention       # q's multiplier, the window, the scores' soft-cap
        scale, window, cap = op.scale, op.window, op.softcap
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
