"""Native CPU runtime: the GGUF-block engine (devices/native/export.py) run by our own C decode
step (plugins/native/forward.c over the kernels of kernels.h, compiled by the project's install,
loaded with ctypes).

KV: one float16 array (llama.cpp's default KV type: half the bytes a long context streams per
step) [layers, 2, S + 1, Hkv, L, D] (S = RuntimeOptions.max_sequences, slot S
takes padding rows' writes, L = max_seq_len + SCRATCH_COLUMNS), its bookkeeping in kv_slots.py
as in the torch runtime: a forward writes its nodes' KV in place and commit moves the accepted
columns down, so no step copies the cache (the ONNX graph's Concat copied all of it each step).
The array is allocated zeroed and lazily by the OS: memory grows with the columns in use.
The prefix cache's block pool sits beside it (runtime/slot_blocks.py, the same float16 bits).
Scratch: one sd_workspace per runtime, grown by the kernel to the largest forward so far and
freed by close() (a steady decode step allocates nothing).
Knows: the C entry points and their structs, slots. Does not know: sampling, drafting, requests.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import importlib.util
import re
import threading
import weakref
from pathlib import Path

import numpy as np

from backend import program
from backend.engine_format import KINDS, kernel_abi, read_native
from backend.config import RuntimeOptions
from backend.errors import UserError
from backend.kv_cache import PAD_PARENT
from backend.kv_slots import SCRATCH_COLUMNS, SlotSequences, SlotTable
from backend.manifest import ModelConfig
from backend.runtime.base import ForwardOutput, Grow, default_threads, verify_on_host
from backend.runtime.cores import CoreGovernor
from backend.runtime.slot_blocks import SlotBlocks

_P = ctypes.c_void_p
_I32, _I64, _F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Matrix(ctypes.Structure):
    _fields_ = [("data", _P), ("type", _I32), ("rows", _I32), ("cols", _I32), ("pad_", _I32)]


MAX_OPS = 16         # forward.c SD_MAX_OPS: a layer's program (backend/program.py) as op records


class _Op(ctypes.Structure):
    """forward.c sd_op: one op of a layer's program (its kind's fields set, the rest zero)."""
    _fields_ = [(n, _I32) for n in ("kind", "out", "wide", "window", "act", "parallel")] + \
               [("scale", _F32), ("softcap", _F32)] + [(n, _P) for n in ("w", "w2", "cos", "sin", "bias")] + \
               [("mat", _Matrix * 3)]


class _Layer(ctypes.Structure):
    _fields_ = [("num_ops", _I32), ("pad_", _I32), ("ops", _Op * MAX_OPS)]


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}      # forward.c SD_SILU, SD_GELU_TANH
# forward.c SD_WIDE_*: the matrix families that can take wide activations (kernels.h act_q.wide);
# a layer's Linear ops are named after theirs
WIDE_FAMILIES = {"qkv": 1, "o": 2, "gate_up": 4, "down": 8, "lm_head": 16}


class _Model(ctypes.Structure):
    _fields_ = [(n, _I32) for n in ("hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab",
                                    "max_pos")] + \
               [("eps", _F32), ("embed_scale", _F32), ("final_softcap", _F32), ("wide", _I32),
                ("norm", _P), ("embed", _Matrix), ("lm_head", _Matrix), ("layers", ctypes.POINTER(_Layer)),
                ("fc", _Matrix), ("fc_bias", _P)]


# sd_forward's refusals (forward.c check_step): it checks every index it follows before writing
_REFUSED = {-9: "the KV cache", -10: "row_start", -11: "a row's KV slot", -12: "a row's context length",
            -13: "an input id", -14: "a position (the rope tables)", -15: "a node's write slot",
            -16: "a node's write column", -17: "a tree path (a scratch column)",
            -18: "a logit row", -19: "a feature layer"}


def wide_mask(wide: tuple[str, ...]) -> int:
    """forward.c's sd_model.wide bits for these families (KeyError: not one of WIDE_FAMILIES)."""
    return sum(WIDE_FAMILIES[f] for f in set(wide))


class _Cache(ctypes.Structure):
    _fields_ = [("cache", _P), ("slots", _I64), ("cols", _I64)]


class _Step(ctypes.Structure):
    _fields_ = [(n, _I32) for n in ("batch", "rows", "path_len", "num_logits", "threads", "num_features")] + \
               [(n, _P) for n in ("row_start", "ids", "pos", "wslot", "wcol", "paths", "ctx", "slots",
                                  "logit_rows", "feature_layers", "features", "hidden", "logits")]


class _Workspace(ctypes.Structure):
    """The kernel's scratch memory, owned here, grown there (forward.c sd_workspace)."""
    _fields_ = [("data", _P), ("capacity", _I64)]


_LIB = None


# SPECDEC_ISA: the path the quantized matmul runs on. auto (unset): AMX tiles where the CPU and the
# OS have them (for matmuls of 10+ int8 rows, kernels.c tile_min_rows), else the build's vector
# path; amx: tiles or an error; avx512: the build's AVX-512 VNNI path without tiles; avx-vnni and
# avx2: the 256-bit builds setup.py compiles beside the main one where the CPU has more (avx2:
# without VNNI, the path of AVX2-only CPUs), or the main build where that is its path; each
# refuses to load anything else. The matmul gives the same bits on every path, the whole forward
# on paths of one width (tests/test_native_isa.py, tests/test_native_amx.py).
ISAS = ("auto", "amx", "avx512", "avx-vnni", "avx2")
LOWER = {"avx-vnni": "plugins._native_avx_vnni", "avx2": "plugins._native_avx2"}   # setup.py's builds


def compiled() -> bool:
    """Whether the install compiled the decode step (plugins/_native*.so, setup.py)."""
    spec = importlib.util.find_spec("plugins._native")
    return spec is not None and spec.origin is not None


def _isa_wanted() -> str:
    want = os.environ.get("SPECDEC_ISA", "auto").strip().lower() or "auto"
    if want not in ISAS:
        raise UserError(f"SPECDEC_ISA={want!r}: expected one of {', '.join(ISAS)}")
    return want


def _library_path(want: str) -> str:
    override = os.environ.get("SPECDEC_NATIVE_LIB")
    if override and not os.path.isfile(override):
        raise RuntimeError(f"SPECDEC_NATIVE_LIB={override}: no such file")
    if not override and not compiled():
        raise RuntimeError("the native CPU engine is not compiled (plugins/_native*.so missing): "
                           "it needs a C compiler with OpenMP at install time; reinstall with "
                           "`.venv/bin/pip install -e '.[all]'` where gcc is present, or serve "
                           "the fp32 / q4 engines (--weights fp32,q4)")
    if override:
        return override
    if want in LOWER:
        spec = importlib.util.find_spec(LOWER[want])
        if spec is not None and spec.origin is not None:
            return spec.origin
    return importlib.util.find_spec("plugins._native").origin


def library() -> ctypes.CDLL:
    """The compiled decode step, loaded once, on the path SPECDEC_ISA asks for (ISAS).
    SPECDEC_NATIVE_LIB names another build of the same source to load instead (the
    AddressSanitizer/UBSan build, plugins/native/sanitize.sh)."""
    global _LIB
    if _LIB is None:
        want = _isa_wanted()
        _LIB = _load(_library_path(want), want)
    return _LIB


def _load(path: str, want: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    check_abi(lib, path)
    check_op_names(lib, path)
    lib.sd_forward.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Cache), ctypes.POINTER(_Step),
                               ctypes.POINTER(_Workspace)]
    lib.sd_forward.restype = ctypes.c_int
    lib.sd_workspace_free.argtypes, lib.sd_workspace_free.restype = [ctypes.POINTER(_Workspace)], None
    lib.sd_isa.restype = ctypes.c_char_p
    lib.sd_use_tiles.argtypes, lib.sd_use_tiles.restype = [ctypes.c_int], ctypes.c_int
    lib.sd_matmul.argtypes = [ctypes.POINTER(_Matrix), _P, ctypes.c_int, _P, ctypes.c_int, ctypes.c_int]
    lib.sd_matmul.restype = ctypes.c_int
    on = lib.sd_use_tiles(TILES_AUTO if want in ("auto", "amx") else TILES_OFF)
    if want == "amx" and not on:
        raise UserError("SPECDEC_ISA=amx: this CPU or OS gives no AMX tiles (CPUID AMX-TILE/AMX-INT8, "
                        "XCR0 and the Linux permission request); unset it to run the vector path")
    got = lib.sd_isa().decode()
    if want == "avx512" and not got.startswith("avx512"):
        raise UserError(f"SPECDEC_ISA=avx512: this build's vector path is {got} (no AVX-512 here)")
    if want in LOWER and got != want:
        raise UserError(f"SPECDEC_ISA={want}: {path} runs {got}, and no {want} build was compiled beside it "
                        f"(setup.py builds one where this CPU has {want} and more)")
    return lib


_BUILDS: dict[str, ctypes.CDLL] = {}


@contextlib.contextmanager
def build_at(path: str):
    """Another build of the kernel (a library compiled from other sources with this ABI) as the
    process's library inside the block: A/B runs of two builds in one process (`specdec
    bench-engine --builds`). Runtimes made inside keep it; use_tiles inside sets its mode."""
    global _LIB
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise UserError(f"--builds: {path}: no such file")
    if path not in _BUILDS:
        _BUILDS[path] = _load(path, "auto")
    saved, _LIB = _LIB, _BUILDS[path]
    try:
        yield _LIB
    finally:
        _LIB = saved


TILES_OFF, TILES_AUTO, TILES_ALWAYS = 0, 1, 2      # kernels.h tiles_select's modes


def use_tiles(on: bool, always: bool = False) -> str:
    """Tiles on (where they measured faster; always: for every kind and row count, the bitwise
    tests) or off for the loaded library, between forwards; the path now in use. For A/B runs in
    one process (`specdec bench-engine --isa`, the tests)."""
    library().sd_use_tiles(TILES_OFF if not on else TILES_ALWAYS if always else TILES_AUTO)
    return isa()


class NativeABIError(UserError, RuntimeError):
    """The compiled kernel was built from other sources than this Python side mirrors."""


def expected_abi() -> dict[str, int]:
    """What this side was written against, in sd_abi's order (forward.c)."""
    return {"abi version": 7, "sizeof sd_matrix": ctypes.sizeof(_Matrix), "sizeof sd_op": ctypes.sizeof(_Op),
            "sizeof sd_layer": ctypes.sizeof(_Layer), "sizeof sd_model": ctypes.sizeof(_Model),
            "sizeof sd_cache": ctypes.sizeof(_Cache), "sizeof sd_step": ctypes.sizeof(_Step),
            "sizeof sd_workspace": ctypes.sizeof(_Workspace), "ops per layer": MAX_OPS,
            "op kinds": len(program.KINDS), **kernel_abi()}


def check_abi(lib, path: str, expected: dict[str, int] | None = None) -> None:
    """Refuse a library whose structs, block layout or weight kinds differ from ours."""
    expected = expected or expected_abi()
    how = "reinstall to recompile it: .venv/bin/pip install -e '.[all]'"
    if not hasattr(lib, "sd_abi"):
        raise NativeABIError(f"the native kernel {path} predates the ABI check (a stale build); {how}")
    lib.sd_abi.argtypes, lib.sd_abi.restype = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int], ctypes.c_int
    got = (ctypes.c_int64 * len(expected))()
    count = lib.sd_abi(got, len(expected))
    wrong = [f"{name} {got[i]} there, {want} here" for i, (name, want) in enumerate(expected.items())
             if i >= count or got[i] != want]
    if count != len(expected):
        wrong.append(f"{count} ABI fields there, {len(expected)} here")
    if wrong:
        raise NativeABIError(f"the native kernel {path} does not match this specdec ({'; '.join(wrong)}); {how}")


def check_op_names(lib, path: str) -> None:
    """Refuse a library whose op kinds (forward.c sd_op_names, SD_OP_*) are not backend/program.py's
    KINDS in order: each op record's kind is its index there."""
    lib.sd_op_names.restype = ctypes.c_char_p
    names = lib.sd_op_names().decode().split(",")
    ours = [re.sub(r"(?<!^)([A-Z])", r"_\1", k.__name__).lower() for k in program.KINDS]
    if names != ours:
        raise NativeABIError(f"the native kernel {path} names its op kinds {names}, this specdec {ours}; "
                             "reinstall to recompile it: .venv/bin/pip install -e '.[all]'")


def isa() -> str:
    """The path the quantized matmul runs on: amx | avx512-vnni | avx-vnni | avx2."""
    return library().sd_isa().decode()


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def blocked_matmul(kind: str, data: np.ndarray, rows: int, cols: int, x: np.ndarray, threads: int = 1,
                   wide: bool = False) -> np.ndarray:
    """The kernel alone: x [R, cols] float32 @ a repacked matrix (devices/native/export.repack) -> [R, rows]
    (wide: x as wide activations)."""
    x = np.ascontiguousarray(x, np.float32)
    y = np.empty((x.shape[0], rows), np.float32)
    mat = _Matrix(_ptr(data), KINDS[kind], rows, cols, 0)
    assert library().sd_matmul(ctypes.byref(mat), _ptr(x), x.shape[0], _ptr(y), threads, int(wide)) == 0, (rows, cols)
    return y


class BlockedMatrix:
    """y = x W^T for a float matrix W [N, K] held in Q8_0 blocks, run by the kernel alone (on the
    calling thread, or on the kernel's OpenMP pool, the engine's own): host-side products between
    engine steps (an EAGLE-3 head's fc, drafters/eagle.py), where numpy's OpenBLAS would start threads of its own that fight the
    engine's OpenMP threads for the cores (perf-notes §13)."""

    def __init__(self, w: np.ndarray):
        from backend.engine_format import blocked

        self.n_out = w.shape[0]
        self.kind, self.data, self.rows, self.cols = blocked(w)

    def __call__(self, x: np.ndarray, threads: int = 1) -> np.ndarray:
        return blocked_matmul(self.kind, self.data, self.rows, self.cols, x, threads)[:, : self.n_out]


class NativeModel:
    """An engine file's tensors and the C model struct over them (kept alive together): each
    layer's program (manifest.ModelConfig.program) as forward.c's op records."""

    def __init__(self, path: str | Path, config: ModelConfig, num_layers: int, wide: tuple[str, ...] = (),
                 feature_layers: tuple[int, ...] = ()):
        """wide: the matrix families that take wide activations (WIDE_FAMILIES); feature_layers:
        the layers whose input is a feature output (their programs' Features op)."""
        header, t = read_native(path)
        self.header, self.tensors = header, t
        assert num_layers <= header["num_layers"], (num_layers, header["num_layers"])   # a self-draft: the first N
        self.eagle = "fc" in t or "layers.0.hidden_norm" in t        # takes `features`
        programs = config.programs(num_layers, feature_layers, eagle3="layers.0.hidden_norm" in t)
        self.layers = (_Layer * num_layers)(*[self._layer(t, i, ops) for i, ops in enumerate(programs)])
        c = config
        self.struct = _Model(c.hidden_size, num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
                             header["max_positions"], c.rms_norm_eps, c.embed_scale, c.final_logit_softcap,
                             wide_mask(wide), _ptr(t.get("norm")), self._matrix("embed"),
                             self._matrix("lm_head" if "lm_head" in t else "embed"), self.layers, self._matrix("fc"),
                             _ptr(t.get("fc_bias")))
        lib = library()
        lib.sd_model_ok.argtypes, lib.sd_model_ok.restype = [ctypes.c_void_p], ctypes.c_int
        if not lib.sd_model_ok(ctypes.addressof(self.struct)):      # checked once here, not per forward
            raise NativeABIError(f"{path}: a matrix or layer program of this engine is one the native kernel "
                                 f"cannot run (a stale or foreign engine file); rebuild it with `specdec build`")
        self.embed_rows = header["tensors"]["embed"]["rows"]     # token ids index the (target's) embedding
        self.num_layers = num_layers

    def _matrix(self, name: str) -> _Matrix:
        """The engine file's blocked matrix `name`; an empty one where the file has none."""
        if name not in self.tensors:
            return _Matrix(None, 0, 0, 0, 0)
        info = self.header["tensors"][name]
        return _Matrix(_ptr(self.tensors[name]), KINDS[info["kind"]], info["rows"], info["cols"], 0)

    def _layer(self, t: dict, i: int, ops: tuple) -> _Layer:
        """Layer i's op records: each op's kind and the fields and tensors its kind reads."""
        assert len(ops) <= MAX_OPS, (len(ops), ops)
        vec = lambda name: _ptr(t.get(f"layers.{i}.{name}")) if name else None     # NULL: none in the file
        records = []
        for op in ops:
            r = _Op(kind=program.KINDS.index(type(op)))
            if isinstance(op, program.Norm):
                r.w, r.w2 = vec(op.weight), vec(op.feature)
            elif isinstance(op, program.Linear):
                fused = f"layers.{i}.{op.name}" in t      # else its parts apart (their block kinds differ)
                mats = [self._matrix(f"layers.{i}.{op.name}")] if fused else \
                    [self._matrix(f"layers.{i}.{p}") for p in op.parts]
                r.mat = (_Matrix * 3)(*mats)
                r.out, r.wide = op.out, WIDE_FAMILIES[op.name]
                r.bias = vec(f"{op.name}_bias") if op.bias else None
            elif isinstance(op, program.HeadNorm):
                r.w, r.w2 = vec(op.q), vec(op.k)
            elif isinstance(op, program.Rope):
                table = "rope_local" if op.table == "local" else "rope"
                r.cos, r.sin = _ptr(t[f"{table}_cos"]), _ptr(t[f"{table}_sin"])
            elif isinstance(op, program.Attention):
                r.window, r.scale, r.softcap = op.window, op.scale, op.softcap
            elif isinstance(op, program.Gate):
                r.act = ACTIVATIONS[op.act]
            elif isinstance(op, program.Residual):
                r.w, r.parallel = vec(op.norm), int(op.parallel)
            records.append(r)
        return _Layer(len(records), 0, (_Op * MAX_OPS)(*records))

    def set_wide(self, wide: tuple[str, ...]) -> None:
        """The families taking wide activations from the next forward on (the build's measure,
        devices/native/wide.py; the workspace is sized per forward)."""
        self.struct.wide = wide_mask(wide)


def _lazy_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros the OS hands out page by page as they are first written, with nothing reserved up
    front (MAP_NORESERVE): np.zeros asks Linux to reserve every slot's columns at once, which its
    overcommit heuristic refuses past the machine's memory (an 8B at 8,192 positions: 65 GB for 64
    slots, on a 24 GB machine: MemoryError at load), while a server only writes the pages of its
    sequences' columns."""
    import mmap

    count = int(np.prod(shape, dtype=np.int64))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)   # Linux's value
    buf = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=flags)
    return np.frombuffer(buf, dtype, count).reshape(shape)        # the array holds the mapping


class NativeRuntime(SlotSequences):
    ragged = True
    def __init__(self, engine_path: str | Path, config: ModelConfig, num_layers: int, max_seq_len: int,
                 options: RuntimeOptions = RuntimeOptions(), feature_layers: tuple[int, ...] = (),
                 wide: tuple[str, ...] = ()):
        """feature_layers: EAGLE-3's, appended to `hidden` (EngineFile.feature_layers); wide: the
        matrix families that take wide activations (the choice the build recorded for this engine)."""
        self.config, self.num_layers, self.max_seq_len = config, num_layers, max_seq_len
        assert all(0 <= f < num_layers for f in feature_layers), (feature_layers, num_layers)
        self.feature_layers = np.array(feature_layers, np.int32)
        self.feature_width = config.hidden_size * (1 + len(feature_layers))
        self.lib = library()
        self.model = NativeModel(engine_path, config, num_layers, wide, feature_layers)
        self.threads = options.threads or default_threads()
        self.governor = CoreGovernor(self.threads)     # fewer threads while other processes hold cores
        self.capacity = options.max_sequences or 64
        self.columns = max_seq_len + SCRATCH_COLUMNS
        self.cache = _lazy_zeros((num_layers, 2, self.capacity + 1, config.num_kv_heads, self.columns,
                                  config.head_dim), np.float16)
        self._cache = _Cache(self.cache.ctypes.data, self.capacity + 1, self.columns)
        self.slots = SlotTable(self.capacity, self.columns, max_seq_len)
        self._logits, self._hidden, self._packed, self._packed_logits = Grow(), Grow(), Grow(), Grow()
        self._lock = threading.Lock()      # one forward at a time; state is not thread safe
        self._workspace = _Workspace(None, 0)
        # freed by close(), or when the runtime is collected unclosed (never while a forward runs:
        # that holds the runtime); the finalizer holds the library, not the runtime
        self._free_workspace = weakref.finalize(self, self.lib.sd_workspace_free, ctypes.byref(self._workspace))

    @property
    def kernel_path(self) -> str:
        """The path the matmul runs on (isa()): the serving metrics' specdec_kernel_info label."""
        return isa()

    def host_matmul(self, w: np.ndarray):
        """x -> x W^T on the kernel's blocked matmul, on this engine's own OpenMP threads (an
        EAGLE-3 head's fc between steps: numpy's OpenBLAS threads would fight them, perf-notes §13;
        on the pool, 2 threads against 1 cut the fc from 0.17 to 0.10 ms a step, §13e)."""
        blocked, threads = BlockedMatrix(w), self.threads
        return lambda x: blocked(x, threads)

    def forward(self, seq_ids: list[int], input_ids: np.ndarray, parents: np.ndarray,
                logits_index: np.ndarray, extra_inputs: dict | None = None) -> ForwardOutput:
        b, t = input_ids.shape                                   # [B, T] int64
        assert parents.shape == (b, t) and logits_index.ndim == 2 and logits_index.shape[0] == b, \
            (parents.shape, logits_index.shape)
        extra = dict(extra_inputs or {})
        feats = extra.pop("features", None)
        assert not extra and (feats is not None) == self.model.eagle, \
            f"inputs {sorted(extra_inputs or {})}: an EAGLE head takes `features` [B, T, H], a decoder nothing else"
        ids = np.ascontiguousarray(input_ids, np.int64)
        index = np.ascontiguousarray(logits_index, np.int64)
        if index.size and (index.min() < 0 or index.max() >= t):
            raise IndexError(f"native forward: logits_index out of [0, {t}): {index.tolist()}")
        with self._lock:
            if self.cache is None:            # close() freed the KV the kernel's struct points at
                raise RuntimeError("native runtime used after close()")
            host, new_paths = self.slots.layout(seq_ids, parents)
            # Ragged rows: a row's padding nodes (PAD_PARENT, after its nodes) are not computed; their
            # outputs read zero and their scratch columns are never written (nothing reads them).
            real = parents != PAD_PARENT                                  # [B, T]
            counts = real.sum(1)
            if not np.array_equal(real, np.arange(t)[None] < counts[:, None]):
                raise ValueError("native forward: a row's padding (PAD_PARENT) must follow its nodes")
            row_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            wanted = index < counts[:, None]                             # [B, R] logits of real nodes
            logit_rows = (row_start[:-1, None] + index)[wanted].astype(np.int64)
            n, full, all_logits = int(row_start[-1]), bool(real.all()), bool(wanted.all())
            hidden = self._hidden.view((b, t, self.feature_width))
            logits = self._logits.view((b, index.shape[1], self.config.vocab_size))
            # without padding the kernel writes the outputs in place; else packed, then scattered
            packed = hidden.reshape(b * t, -1) if full else self._packed.view((n, self.feature_width))
            packed_logits = (logits.reshape(-1, self.config.vocab_size) if all_logits else
                             self._packed_logits.view((len(logit_rows), self.config.vocab_size)))
            pick = (lambda a: a.reshape((b * t,) + a.shape[2:])) if full else (lambda a: a[real])   # no copies unpadded
            arrays = {"row_start": row_start, "ids": pick(ids), "pos": pick(host["pos"]),
                      "wslot": pick(host["wslot"]), "wcol": pick(host["wcol"]),
                      "paths": np.ascontiguousarray(pick(host["paths"]), np.int32), "ctx": host["ctx"],
                      "slots": host["slots"], "logit_rows": logit_rows,
                      "features": None if feats is None else np.ascontiguousarray(pick(np.asarray(feats, np.float32)))}
            arrays["feature_layers"] = self.feature_layers
            self._check_shapes(arrays, n)
            step = _Step(b, n, host["paths"].shape[2], len(logit_rows), self.governor.threads(), len(self.feature_layers),
                         *(_ptr(arrays[k]) for k in ("row_start", "ids", "pos", "wslot", "wcol", "paths", "ctx",
                                                     "slots", "logit_rows", "feature_layers", "features")),
                         _ptr(packed), _ptr(packed_logits))
            if n:
                rc = self.lib.sd_forward(ctypes.byref(self.model.struct), ctypes.byref(self._cache), ctypes.byref(step),
                                         ctypes.byref(self._workspace))
                if rc in _REFUSED:
                    raise IndexError(f"native forward refused: {_REFUSED[rc]} out of range (B={b}, T={t}, "
                                     f"{self.capacity} slots x {self.columns} columns)")
                if rc != 0:
                    raise MemoryError(f"native forward failed (rc {rc}): out of memory for B={b}, T={t}")
            self.slots.extend(seq_ids, new_paths)
            if not full:
                hidden[~real], hidden[real] = 0.0, packed
            if not all_logits:
                logits[~wanted], logits[wanted] = 0.0, packed_logits
            return ForwardOutput(logits, hidden)

    def _check_shapes(self, a: dict, n: int) -> None:
        """What the kernel cannot see: every per-node array has a row per node and the features
        their width. (The kernel checks every index itself before writing: _REFUSED.)"""
        f = a["features"]
        if f is not None and f.shape != (n, self.config.hidden_size):
            raise ValueError(f"native forward: features {f.shape}, expected {(n, self.config.hidden_size)}")
        for name in ("ids", "pos", "wslot", "wcol", "paths"):
            if len(a[name]) != n:
                raise ValueError(f"native forward: {name} has {len(a[name])} rows for {n} nodes")

    def verify(self, out: ForwardOutput, drafts, params, noises, positions):
        return verify_on_host(out, drafts, params, noises, positions)

    def commit(self, seq_ids: list[int], keep: list[np.ndarray]) -> None:
        """Keep scratch nodes `keep` of each row: their columns move down to the committed end."""
        with self._lock:
            sl, src, dst = self.slots.commit(seq_ids, keep)
            if sl.size:
                self.cache[:, :, sl, :, dst] = self.cache[:, :, sl, :, src]

    def truncate(self, seq_id: int, length: int) -> None:
        with self._lock:
            self.slots.truncate(seq_id, length)

    def block_storage(self) -> SlotBlocks:
        return SlotBlocks(lambda: [self.cache], 2, self.slots)

    def close(self) -> None:
        """Frees the KV cache and the workspace; under the lock, so a forward still running on
        another thread (a server stopping mid-step) finishes before the memory its struct points
        at goes away (AddressSanitizer found the use-after-free, perf-notes §14)."""
        with self._lock:
            self.slots.clear()
            self._cache.cache = None
            self.cache = None
            self.prefix_cache = None
            self._free_workspace()
