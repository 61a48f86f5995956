"""CPU runtime: one ONNX Runtime session over a decoder graph from buildlib/graph.py.

KV storage lives here as numpy arrays that ORT reads and writes in place through IOBinding:
a batch group (kv_groups.py: which sequences share arrays, and when to copy) keeps, per layer,
two flat buffers; the past is a view of one, and ORT's Concat writes the present (past + T new
columns) straight into a view of the other, which becomes the next past. No KV is copied
between steps except by that Concat; garbage columns of rejected tree nodes are masked
(kv_cache.py) and squeezed out now and then.
Knows: ORT sessions, IOBinding, KV buffers. Does not know: sampling, drafting, requests.
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np

from backend import program
from backend.config import RuntimeOptions
from backend.kv_cache import PAD_PARENT
from backend.kv_groups import KVGroups, spread_rows
from backend.manifest import ModelConfig
from backend.runtime.base import ForwardOutput, Grow, default_threads, verify_on_host
from backend.runtime.host import HostSide


_GLOBAL_POOL_THREADS: int | None = None


def _use_global_pool(threads: int) -> bool:
    """All sessions of this process share one ORT thread pool when possible: the target and its
    draft run one after the other, and two pools of spinning threads on the same 2 cores slow
    both (measured ~1.7x on verify forwards). Must be set before ORT's environment exists.
    Once the process has a global pool, every session must use it (ORT refuses per-session
    threads then), whatever thread count it asked for."""
    global _GLOBAL_POOL_THREADS
    if _GLOBAL_POOL_THREADS is None:
        try:
            from onnxruntime.capi import _pybind_state

            _pybind_state.set_global_thread_pool_sizes(threads, 1)
            _GLOBAL_POOL_THREADS = threads
        except Exception:
            _GLOBAL_POOL_THREADS = 0
    return bool(_GLOBAL_POOL_THREADS)


def session_options(threads: int, spinning: bool):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if _use_global_pool(threads):
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.log_severity_level = 3
    return so


_SHARED: dict | None = None      # engine file -> session, inside shared_sessions()


@contextlib.contextmanager
def shared_sessions():
    """Runtimes made inside this block share one ORT session (its weights) per engine file; each
    keeps its own IOBinding and KV groups. The paired bench's decoders then differ in state only,
    not in where their weights lie in memory (two loaded copies differed by up to ~2% in speed)."""
    global _SHARED
    outer = _SHARED
    _SHARED = {} if outer is None else outer
    try:
        yield
    finally:
        _SHARED = outer


class _PingPong:
    """One group's KV: per layer K and V, two flat buffers each; `kv` are the current past views
    [B, Hkv, L, D], and the forward's present is written into views of the other buffers."""

    def __init__(self, num_arrays: int):
        self.store = [(Grow(), Grow()) for _ in range(num_arrays)]
        self.cur = 0
        self.kv: list[np.ndarray] = []

    def next_views(self, shape) -> list[np.ndarray]:
        return [pair[1 - self.cur].view(shape) for pair in self.store]

    def swap(self, presents: list[np.ndarray]) -> None:
        self.kv = presents
        self.cur = 1 - self.cur

    def past_views(self, shape) -> list[np.ndarray]:
        """The current past reshaped to `shape` (more rows), keeping the existing rows."""
        keep = int(np.prod(self.kv[0].shape)) if self.kv else 0
        return [pair[self.cur].view(shape, keep) for pair in self.store]


class _Storage:
    """kv_groups.GroupStorage over numpy ping-pong buffers."""

    def __init__(self, num_arrays: int, num_kv_heads: int, head_dim: int):
        self.num_arrays, self.hkv, self.d = num_arrays, num_kv_heads, head_dim

    def new(self, rows: int, cols: int) -> _PingPong:
        kv = _PingPong(self.num_arrays)
        views = kv.next_views((rows, self.hkv, cols, self.d))
        for v in views:
            v.fill(0.0)
        kv.swap(views)
        return kv

    def add_row(self, kv: _PingPong) -> _PingPong:
        b, hkv, cols, d = kv.kv[0].shape
        kv.kv = kv.past_views((b + 1, hkv, cols, d))
        return kv

    def copy_row(self, dst: _PingPong, row: int, src: _PingPong, src_row: int, cols: np.ndarray) -> None:
        n = cols.size
        for a, b in zip(dst.kv, src.kv):
            a[row, :, :n] = b[src_row][:, cols]
            a[row, :, n:] = 0.0


class OrtRuntime(HostSide):
    ragged = False
    def __init__(self, engine_path: str | Path, config: ModelConfig, num_layers: int,
                 max_seq_len: int, options: RuntimeOptions = RuntimeOptions(),
                 pad_single_token: bool = False):
        import onnxruntime as ort

        self.config = config
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.pad_single_token = pad_single_token
        threads, spinning = options.threads or default_threads(), options.spinning
        key = (str(Path(engine_path).resolve()), threads, spinning)
        if _SHARED is not None and key in _SHARED:
            self.session = _SHARED[key]
        else:
            self.session = ort.InferenceSession(str(engine_path), session_options(threads, spinning),
                                                providers=["CPUExecutionProvider"])
            if _SHARED is not None:
                _SHARED[key] = self.session
        self._io = self.session.io_binding()
        # final-norm features, then any EAGLE-3 layer features (graph.py GraphSpec.feature_layers)
        self.feature_width = next(o.shape[-1] for o in self.session.get_outputs() if o.name == "hidden")
        self.groups = KVGroups(_Storage(2 * num_layers, config.num_kv_heads, config.head_dim))
        self._logits = Grow()
        self._hidden = Grow()
        self._lock = threading.Lock()   # one forward at a time; state is not thread safe
        self._kv_shape = (config.num_kv_heads, config.head_dim)
        # the sliding layers' window, where the graph has them (graph.py attn_bias_local)
        has_local = any(i.name == "attn_bias_local" for i in self.session.get_inputs())
        self._window = max(program.attention(ops).window for ops in config.programs(num_layers)) if has_local else 0

    # --- sequences ---------------------------------------------------------------------------
    def alloc(self, seq_id: int) -> None:
        self.groups.alloc(seq_id)

    def free(self, seq_id: int) -> None:
        self.groups.free(seq_id)

    def length(self, seq_id: int) -> int:
        return self.groups.length(seq_id)

    def num_sequences(self) -> int:
        return self.groups.num_sequences()

    def room(self) -> int:
        return 2 ** 31 - 1                  # KV grows with the groups: bounded by memory only

    # --- forward / commit --------------------------------------------------------------------
    def forward(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                logits_index: np.ndarray, extra_inputs: dict[str, np.ndarray] | None = None) -> ForwardOutput:
        b, t = input_ids.shape                           # [B, T] int64
        assert parents.shape == (b, t), (parents.shape, (b, t))
        assert logits_index.ndim == 2 and logits_index.shape[0] == b, logits_index.shape
        if self.pad_single_token and b * t == 1:
            # keep 4-bit kernels on their M >= 2 path (cpu-engine.md §7): add one padding node
            extra = {k: np.concatenate([v, v], 1) for k, v in (extra_inputs or {}).items()}
            out = self.forward(seq_ids, np.concatenate([input_ids, input_ids], 1),
                               np.array([[parents[0, 0], PAD_PARENT]], np.int32), logits_index, extra)
            return ForwardOutput(out.logits, out.hidden[:, :1])
        with self._lock:
            g, rows = self.groups.group_for(seq_ids)
            full = rows == list(range(len(g.seq_ids)))
            if not full:                  # idle rows of the group: padding in, output dropped
                input_ids, parents, logits_index, extra_inputs = spread_rows(
                    rows, len(g.seq_ids), input_ids, parents, logits_index, extra_inputs)
                b = len(g.seq_ids)
            bias, positions = g.layout.forward_inputs(parents)
            if positions.max() >= self.max_seq_len:
                raise ValueError(f"sequence too long: position {int(positions.max())} >= "
                                 f"max_seq_len {self.max_seq_len}")
            cols = g.layout.num_cols
            hkv, d = self._kv_shape
            io = self._io
            io.clear_binding_inputs()
            io.clear_binding_outputs()
            self._bind_in(io, "input_ids", np.ascontiguousarray(input_ids, np.int64))
            self._bind_in(io, "position_ids", positions)
            self._bind_in(io, "attn_bias", bias)
            if self._window:
                self._bind_in(io, "attn_bias_local", g.layout.window_bias(bias, positions, self._window))
            self._bind_in(io, "logits_index", np.ascontiguousarray(logits_index, np.int64))
            for name, arr in (extra_inputs or {}).items():
                self._bind_in(io, name, np.ascontiguousarray(arr))
            presents = g.kv.next_views((b, hkv, cols + t, d))
            for j, pres in enumerate(presents):
                kind, layer = ("key" if j % 2 == 0 else "value"), j // 2
                self._bind_in(io, f"past_{kind}_{layer}", g.kv.kv[j])
                self._bind_out(io, f"present_{kind}_{layer}", pres)
            logits = self._logits.view((b, logits_index.shape[1], self.config.vocab_size))
            hidden = self._hidden.view((b, t, self.feature_width))
            self._bind_out(io, "logits", logits)
            self._bind_out(io, "hidden", hidden)
            self.session.run_with_iobinding(io)
            g.kv.swap(presents)                        # the present is the next past
            g.layout.append(t)
            if not full:
                return ForwardOutput(logits[rows], hidden[rows])
            return ForwardOutput(logits, hidden)

    def verify(self, out: ForwardOutput, drafts, params, noises, positions):
        return verify_on_host(out, drafts, params, noises, positions)

    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> None:
        with self._lock:
            self.groups.commit(seq_ids, keep)

    def truncate(self, seq_id: int, length: int) -> None:
        with self._lock:
            self.groups.truncate(seq_id, length)

    # --- binding helpers ---------------------------------------------------------------------
    @staticmethod
    def _bind_in(io, name: str, arr: np.ndarray) -> None:
        import onnxruntime as ort

        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))

    @staticmethod
    def _bind_out(io, name: str, arr: np.ndarray) -> None:
        assert arr.flags.c_contiguous and arr.dtype == np.float32, name
        io.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)

    def close(self) -> None:
        self.groups.clear()
        self.session = None
