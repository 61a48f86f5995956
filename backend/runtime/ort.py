"""CPU runtime: one ONNX Runtime session over a decoder graph from build/graph.py.

KV storage lives here as numpy arrays that ORT reads and writes in place through IOBinding:
a batch group keeps, per layer, two flat buffers; the past is a view of one, and ORT's Concat
writes the present (past + T new columns) straight into a view of the other, which becomes the
next past. No KV is copied between steps except by that Concat; garbage columns of rejected
tree nodes are masked (kv_cache.py) and squeezed out now and then. Sequences that are run
together share a group. Continuous batching changes the set every time a request joins or
leaves, and copying the whole cache then costs 3-7 decode steps at 16 x 450 tokens (measured
offline), so a group changes in place where it can: a finished sequence leaves an idle row
(fed padding, its output dropped) that the next joining sequence takes over, or a row is
appended; only when a joiner is longer than the group, idle rows pass a quarter of the group,
or garbage grows, are the sequences copied into a new group.
Knows: ORT sessions, IOBinding, KV storage. Does not know: sampling, drafting, requests.
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import numpy as np

from backend.kv_cache import PAD_PARENT, KVLayout
from backend.manifest import ModelConfig
from backend.runtime.base import ForwardOutput


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


def default_threads() -> int:
    return int(os.environ.get("SPECDEC_THREADS", "0")) or min(2, os.cpu_count() or 1)


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


class _Grow:
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


class _Group:
    """Sequences that share KV arrays, in row order."""

    def __init__(self, seq_ids: list[int], layout: KVLayout, num_arrays: int):
        self.seq_ids = list(seq_ids)
        self.layout = layout
        self.store = [(_Grow(), _Grow()) for _ in range(num_arrays)]   # ping-pong per array
        self.cur = 0
        self.kv: list[np.ndarray] = []      # [2 * layers] current past views [B, Hkv, L, D]
        self.dead: set[int] = set()

    def next_views(self, shape) -> list[np.ndarray]:
        """Views of the spare buffers, where the next present is written."""
        return [pair[1 - self.cur].view(shape) for pair in self.store]

    def swap(self, presents: list[np.ndarray]) -> None:
        self.kv = presents
        self.cur = 1 - self.cur

    def row(self, seq_id: int) -> int:
        return self.seq_ids.index(seq_id)

    def past_views(self, shape) -> list[np.ndarray]:
        """The current past reshaped to `shape` (more rows), keeping the existing rows."""
        keep = int(np.prod(self.kv[0].shape)) if self.kv else 0
        return [pair[self.cur].view(shape, keep) for pair in self.store]

    def live_ids(self) -> list[int]:
        return [s for s in self.seq_ids if s not in self.dead]


class OrtRuntime:
    def __init__(self, engine_path: str | Path, config: ModelConfig, num_layers: int,
                 max_seq_len: int, threads: int | None = None, spinning: bool = True,
                 pad_single_token: bool = False):
        import onnxruntime as ort

        self.config = config
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.pad_single_token = pad_single_token
        threads = threads or default_threads()
        key = (str(Path(engine_path).resolve()), threads, spinning)
        if _SHARED is not None and key in _SHARED:
            self.session = _SHARED[key]
        else:
            self.session = ort.InferenceSession(str(engine_path), session_options(threads, spinning),
                                                providers=["CPUExecutionProvider"])
            if _SHARED is not None:
                _SHARED[key] = self.session
        self._io = self.session.io_binding()
        self._groups: list[_Group] = []
        self._where: dict[int, _Group] = {}
        self._logits = _Grow()
        self._hidden = _Grow()
        self._lock = threading.Lock()   # one forward at a time; state is not thread safe
        self._kv_shape = (config.num_kv_heads, config.head_dim)

    # --- sequences ---------------------------------------------------------------------------
    def alloc(self, seq_id: int) -> None:
        assert seq_id not in self._where, f"sequence {seq_id} already allocated"
        hkv, d = self._kv_shape
        g = _Group([seq_id], KVLayout(1), 2 * self.num_layers)
        g.swap(g.next_views((1, hkv, 0, d)))
        self._groups.append(g)
        self._where[seq_id] = g

    def free(self, seq_id: int) -> None:
        g = self._where.pop(seq_id, None)
        if g is None:
            return
        g.dead.add(seq_id)
        if not g.live_ids():
            self._groups.remove(g)

    def length(self, seq_id: int) -> int:
        g = self._where[seq_id]
        return int(g.layout.lengths[g.row(seq_id)])

    def num_sequences(self) -> int:
        return len(self._where)

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
            g = self._group_for(seq_ids)
            rows = [g.row(sid) for sid in seq_ids]
            full = rows == list(range(len(g.seq_ids)))
            if not full:                  # idle rows of the group: padding in, output dropped
                input_ids, parents, logits_index, extra_inputs = _spread(
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
            self._bind_in(io, "logits_index", np.ascontiguousarray(logits_index, np.int64))
            for name, arr in (extra_inputs or {}).items():
                self._bind_in(io, name, np.ascontiguousarray(arr))
            presents = g.next_views((b, hkv, cols + t, d))
            for j, pres in enumerate(presents):
                kind, layer = ("key" if j % 2 == 0 else "value"), j // 2
                self._bind_in(io, f"past_{kind}_{layer}", g.kv[j])
                self._bind_out(io, f"present_{kind}_{layer}", pres)
            logits = self._logits.view((b, logits_index.shape[1], self.config.vocab_size))
            hidden = self._hidden.view((b, t, self.config.hidden_size))
            self._bind_out(io, "logits", logits)
            self._bind_out(io, "hidden", hidden)
            self.session.run_with_iobinding(io)
            g.swap(presents)                           # the present is the next past
            g.layout.append(t)
            if not full:
                return ForwardOutput(logits[rows], hidden[rows])
            return ForwardOutput(logits, hidden)

    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> None:
        with self._lock:
            g = self._where[seq_ids[0]]
            nodes_of = {}
            for sid, nodes in zip(seq_ids, keep):
                assert self._where[sid] is g, "commit must follow a forward over the same sequences"
                nodes_of[sid] = nodes
            empty = np.zeros(0, np.int64)
            for r, sid in enumerate(g.seq_ids):        # idle rows drop their scratch
                g.layout.commit(r, nodes_of.get(sid, empty))
            if g.layout.needs_compaction() or len(g.dead) > len(g.seq_ids) // 4:
                self._regroup(g.live_ids())

    def truncate(self, seq_id: int, length: int) -> None:
        with self._lock:
            g = self._where[seq_id]
            g.layout.truncate(g.row(seq_id), length)

    # --- grouping ----------------------------------------------------------------------------
    def _group_for(self, seq_ids: list[int]) -> _Group:
        """The group to run seq_ids in: the largest group holding any of them, with the others
        moved into its idle rows (or appended) when that is cheap, else a new group."""
        for s in seq_ids:
            if s not in self._where:
                raise KeyError(f"sequence {s} is not allocated")
        g = max({id(self._where[s]): self._where[s] for s in seq_ids}.values(), key=lambda x: len(x.seq_ids))
        joiners = [s for s in seq_ids if self._where[s] is not g]
        if not joiners:
            if g.seq_ids == list(seq_ids) and not g.dead:
                return g
            idle = len(g.seq_ids) - len(seq_ids)
            if idle <= len(g.seq_ids) // 4 or g.layout.has_scratch():
                return g                               # run the other rows idle
            return self._regroup(list(seq_ids))
        free_rows = [r for r, sid in enumerate(g.seq_ids) if sid in g.dead]
        rows_after = len(g.seq_ids) + max(0, len(joiners) - len(free_rows))
        cheap = (rows_after - len(seq_ids) <= rows_after // 4
                 and all(self.length(s) <= g.layout.num_cols for s in joiners)
                 and not g.layout.has_scratch()
                 and not any(self._where[s].layout.has_scratch() for s in joiners))
        if not cheap:
            return self._regroup(list(seq_ids))
        for s in joiners:
            self._move_in(g, s, free_rows.pop(0) if free_rows else len(g.seq_ids))
        return g

    def _move_in(self, g: _Group, seq_id: int, row: int) -> None:
        """Copy seq_id's committed KV into row `row` of g (an idle row, or a new last row)."""
        src = self._where[seq_id]
        sr = src.row(seq_id)
        cols = src.layout.columns(sr)
        n = cols.size
        if row == len(g.seq_ids):
            b, hkv, L, d = g.kv[0].shape
            g.kv = g.past_views((b + 1, hkv, L, d))
            g.seq_ids.append(seq_id)
        else:
            g.dead.discard(g.seq_ids[row])
            g.seq_ids[row] = seq_id
        for dst, old in zip(g.kv, src.kv):
            dst[row, :, :n] = old[sr][:, cols]
            dst[row, :, n:] = 0.0                      # garbage must be finite: 0 * v == 0
        g.layout.place_row(row, n)
        src.dead.add(seq_id)
        if not src.live_ids() and src in self._groups:
            self._groups.remove(src)
        self._where[seq_id] = g

    def _regroup(self, seq_ids: list[int]) -> _Group:
        """Copy the committed columns of seq_ids (from wherever they live) into a new group."""
        assert not any(self._where[s].layout.has_scratch() for s in seq_ids), \
            "regrouping sequences with uncommitted tokens"
        lengths = np.array([self.length(s) for s in seq_ids], np.int64)
        layout = KVLayout(len(seq_ids), lengths)
        ncols = layout.num_cols
        src = []
        for s in seq_ids:
            g = self._where[s]
            r = g.row(s)
            src.append((g, r, g.layout.columns(r)))
        hkv, d = self._kv_shape
        new = _Group(seq_ids, layout, 2 * self.num_layers)
        kv = new.next_views((len(seq_ids), hkv, ncols, d))
        for j, dst in enumerate(kv):
            dst.fill(0.0)                     # padding must be finite: masked weight 0 * v == 0
            for r, (g, gr, cols) in enumerate(src):
                dst[r, :, : cols.size] = g.kv[j][gr][:, cols]
        new.swap(kv)
        for s in seq_ids:
            old = self._where[s]
            old.dead.add(s)
            if not old.live_ids() and old in self._groups:
                self._groups.remove(old)
            self._where[s] = new
        self._groups.append(new)
        return new

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
        self._groups.clear()
        self._where.clear()
        self.session = None


def _spread(rows: list[int], b: int, input_ids, parents, logits_index, extra):
    """Inputs of len(rows) sequences -> inputs of all b rows of their group; the other rows get
    one padding node each (attends to itself only, never committed)."""
    t = input_ids.shape[1]
    ids = np.zeros((b, t), np.int64)
    par = np.full((b, t), PAD_PARENT, np.int32)
    idx = np.zeros((b, logits_index.shape[1]), np.int64)
    ids[rows], par[rows], idx[rows] = input_ids, parents, logits_index
    ext = None
    if extra:
        ext = {}
        for k, a in extra.items():
            full = np.zeros((b,) + a.shape[1:], a.dtype)
            full[rows] = a
            ext[k] = full
    return ids, par, idx, ext
