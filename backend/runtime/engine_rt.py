"""Engine runtime: the TensorRT engine graph (buildlib/engine_graph.py) executed whole, once per
step, behind the Runtime protocol, so the decoder, drafters, controller and Triton models are
the same as on the other runtimes.

An executor runs the graph: `TrtExecutor` (runtime/trt_exec.py: a TensorRT execution context
with its KV buffers bound to the engine's cache inputs) where TensorRT and a GPU are, and
`OrtExecutor` (below: ONNX Runtime's CPU provider with the specdec:: ops by their numpy
references, plugins/ort_ops.py), the proof of the same graph and of this runtime on a CPU.

One execution per step: `forward` only lays the step out (kv_slots.SlotTable) and returns an
output that runs the graph when first needed. `verify` runs it with the rows' sampling
parameters, so the graph's own `rejection_sample` decides the step and only the accepted paths
cross to the host; reading logits or hidden first (prefill, draft engines) runs it greedily.
The graph samples with float32 temperature / top-p / min-p (TensorRT has no float64 tensors):
this runtime rounds the parameters to float32 for every verification, the host fallback included,
so plain and speculative decoding sample the same distribution, at those values.
KV: the executor's caches [S + 1, Hkv, L, D] per layer (slot S takes padding rows); after an
execution it writes the new nodes' KV (the graph's present_* outputs) to their columns, and
commit moves accepted columns down (SlotTable.commit), as the torch runtime does.
Knows: slots, the engine graph's inputs and outputs. Does not know: TensorRT (trt_exec.py),
sampling rules, drafting.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from backend.config import RuntimeOptions, SamplingParams
from backend.kv_cache import PAD_PARENT
from backend.kv_slots import SCRATCH_COLUMNS, SlotSequences, SlotTable
from backend.manifest import ModelConfig
from backend.runtime.base import ForwardOutput, sampling_arrays, verdicts_from_arrays, verify_on_host
from backend.runtime.host import HostSide
from backend.runtime.slot_blocks import SlotBlocks

MAX_VERIFY_NODES = 64     # plugins/kernels.PLUGIN_MAX_NODES: wider trees are verified on the host
VERIFY_INPUTS = ("parents", "temperature", "top_k", "top_p", "min_p", "seeds", "out_positions")


def float32_params(params: list) -> list:
    """The rows' SamplingParams at the float32 values the engine graph samples with."""
    f = lambda x: float(np.float32(x))
    return [replace(p, temperature=f(p.temperature), top_p=f(p.top_p), min_p=f(p.min_p)) for p in params]


class _StepOutput(ForwardOutput):
    """A laid-out step; the graph runs when its logits, hidden or verdict are first needed."""

    def __init__(self, rt: "EngineRuntime", feeds: dict, parents: np.ndarray, wslot: np.ndarray, wcol: np.ndarray):
        super().__init__(None, None)
        self.rt, self.feeds, self.parents, self.wslot, self.wcol = rt, feeds, parents, wslot, wcol
        self.verdict = None

    def resolve(self, res: dict) -> None:
        ForwardOutput.__init__(self, res["logits"], res["hidden"])
        if "num_accepted" in res:
            self.verdict = tuple(_host(res[k]) for k in ("accepted_nodes", "output_ids", "num_accepted"))

    @property
    def logits(self) -> np.ndarray:
        self.rt.run_pending(self)
        return super().logits

    @property
    def hidden(self) -> np.ndarray:
        self.rt.run_pending(self)
        return super().hidden


class _NoNoise:
    seed = 0                          # an unverified step's rows: greedy, the noise is never read


_NO_NOISE = _NoNoise()


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.cpu().numpy()


class EngineRuntime(HostSide, SlotSequences):
    ragged = False
    def __init__(self, executor, config: ModelConfig, num_layers: int, max_seq_len: int,
                 options: RuntimeOptions = RuntimeOptions()):
        self.config, self.num_layers, self.max_seq_len = config, num_layers, max_seq_len
        self.capacity = options.max_sequences or 16
        self.slots = SlotTable(self.capacity, max_seq_len + SCRATCH_COLUMNS, max_seq_len)
        self.ex = executor
        self.ex.allocate(self.capacity + 1, self.slots.columns)
        self.verifies = all(n in self.ex.inputs for n in VERIFY_INPUTS)
        self._pending: _StepOutput | None = None

    def free(self, seq_id: int) -> None:
        self.run_pending()
        super().free(seq_id)

    # --- one step ----------------------------------------------------------------------------
    def forward(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                logits_index: np.ndarray, extra_inputs: dict | None = None) -> ForwardOutput:
        self.run_pending()
        b, t = input_ids.shape
        assert parents.shape == (b, t) and logits_index.shape[0] == b, (parents.shape, logits_index.shape)
        host, new_paths = self.slots.layout(seq_ids, parents)
        feeds = {"input_ids": np.asarray(input_ids, np.int64), "position_ids": host["pos"],
                 "logits_index": np.asarray(logits_index, np.int64), "slots": host["slots"],
                 "ctx_len": host["ctx"], "n_prior": host["n_prior"], "paths": host["paths"]}
        if extra_inputs:
            feeds["features"] = np.asarray(extra_inputs["features"], np.float32)
        self.slots.extend(seq_ids, new_paths)     # their KV is written when the graph runs, before
        self._pending = _StepOutput(self, feeds, np.asarray(parents, np.int32), host["wslot"], host["wcol"])
        return self._pending                                                    # (anything reads it)

    def run_pending(self, out: _StepOutput | None = None, sampling: dict | None = None) -> None:
        """Run the laid-out step (greedy unless `sampling` gives the verification's inputs)."""
        p = self._pending
        if p is None or (out is not None and out is not p):
            return
        feeds = dict(p.feeds)
        if self.verifies:                 # unverified: each row's root alone (no logits past row 0)
            b, t = feeds["input_ids"].shape
            feeds.update(sampling or {
                **sampling_arrays([SamplingParams()] * b, [_NO_NOISE] * b, [0] * b, np.float32),
                "parents": np.c_[np.full((b, 1), -1, np.int32), np.full((b, t - 1), PAD_PARENT, np.int32)]})
        self._pending = None
        p.resolve(self.ex.run(feeds, p.wslot, p.wcol))

    def verify(self, out: ForwardOutput, drafts, params, noises, positions):
        """The graph's rejection_sample when `out` is the step still to run and gathered the
        logits of every node in order (the decoder's verify forward: its inputs are the drafts,
        the Runtime contract); backend/verify.py on the host otherwise. Both with float32
        parameters."""
        params = float32_params(params)
        index = out.feeds["logits_index"] if out is self._pending else None
        if not (self.verifies and index is not None and index.shape[1] <= MAX_VERIFY_NODES
                and np.array_equal(index, np.broadcast_to(np.arange(index.shape[1]), index.shape))):
            return verify_on_host(out, drafts, params, noises, positions)
        self.run_pending(out, {"parents": out.parents, **sampling_arrays(params, noises, positions, np.float32)})
        return verdicts_from_arrays(drafts, *out.verdict)

    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> None:
        self.run_pending()
        sl, src, dst = self.slots.commit(seq_ids, keep)
        if sl.size:
            self.ex.move(sl, src, dst)

    def truncate(self, seq_id: int, length: int) -> None:
        self.run_pending()
        self.slots.truncate(seq_id, length)

    def block_storage(self) -> SlotBlocks:
        """The executor's per-layer caches [S + 1, Hkv, L, D]; its stream sees each copy done."""
        return SlotBlocks(lambda: [c for kv in self.ex.cache for c in kv], 0, self.slots,
                          getattr(self.ex, "synchronize", None))

    def close(self) -> None:
        self._pending = None
        self.slots.clear()
        self.prefix_cache = None
        self.ex.close()


class OrtExecutor:
    """The engine graph on ONNX Runtime's CPU provider, its specdec:: ops by the numpy
    references; caches are numpy arrays. For proofs and tests: the references are slow."""

    def __init__(self, path: Path, config: ModelConfig, num_layers: int, threads: int = 1):
        import onnxruntime as ort

        from backend.runtime.ort import session_options
        from plugins import ort_ops

        self.session = ort.InferenceSession(str(path), ort_ops.register(session_options(threads, spinning=False)),
                                            providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.config, self.num_layers = config, num_layers
        self.cache: list[tuple[np.ndarray, np.ndarray]] = []

    def allocate(self, slots: int, columns: int) -> None:
        shape = (slots, self.config.num_kv_heads, columns, self.config.head_dim)
        self.cache = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(self.num_layers)]

    def run(self, feeds: dict, wslot: np.ndarray, wcol: np.ndarray) -> dict:
        feeds = dict(feeds)
        for i, (kc, vc) in enumerate(self.cache):
            feeds[f"k_cache_{i}"], feeds[f"v_cache_{i}"] = kc, vc
        out = dict(zip(self.outputs, self.session.run(self.outputs, feeds)))
        for i, (kc, vc) in enumerate(self.cache):        # what the TensorRT runtime does on the device
            kc[wslot, :, wcol] = out.pop(f"present_key_{i}")
            vc[wslot, :, wcol] = out.pop(f"present_value_{i}")
        return out

    def move(self, slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        for kc, vc in self.cache:
            for c in (kc, vc):
                c[slots, :, dst] = c[slots, :, src]

    def close(self) -> None:
        self.cache = []


