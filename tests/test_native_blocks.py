"""The native kernel's weight kinds against GGUF's own dequantization (gguf.quants, the reference
SourceTensor.float32 uses): every GGUF type the kernel reads as it is (Q4_0, Q4_1, Q8_0, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K) becomes a matrix of the GGUF tensor's own size (rows padded to 16 aside)
whose products are those of the dequantized weights with the int8-quantized activations, whose
rows dequantize bit for bit, and whose outputs do not depend on the batch or the thread count."""
import ctypes

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
native = pytest.importorskip("backend.runtime.native")

from backend.buildlib.checkpoint import SourceTensor  # noqa: E402
from backend.devices.native.blocks import kind_of, matrix  # noqa: E402
from backend.engine_format import BLOCK_BYTES, BLOCK_ELEMS, KINDS, LANES  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
KIND = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8", "Q5_0": "q5_0", "Q5_1": "q5_1",
        "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
QUANTIZABLE = {"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"}     # what gguf 0.19's numpy quantize writes
ROWS, COLS = 40, 512                                         # 40 rows: 48 in the kernel, the last 8 padding


def _f16(rng, shape, lo, hi):
    return rng.uniform(lo, hi, shape).astype(np.float16).view(np.uint8).reshape(shape + (2,))


def _random_k_blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    """Valid random raw blocks [n, bytes per row] of a K-quant (gguf 0.19 cannot quantize them):
    random integers and packed scales, sane f16 scales."""
    nb = k // 256
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    raw = rng.integers(0, 256, (n, nb, size), dtype=np.uint8)
    if qtype == "Q6_K":
        raw[..., 208:210] = _f16(rng, (n, nb), 2e-4, 2e-3)                    # d, after ql, qh, scales
    else:
        raw[..., 0:2] = _f16(rng, (n, nb), 1e-3, 1e-2)                        # d
        raw[..., 2:4] = _f16(rng, (n, nb), 1e-3, 1e-2)                        # dmin
    return raw.reshape(n, nb * size)


def _tensor(qtype: str, n: int = ROWS, k: int = COLS, seed: int = 0) -> SourceTensor:
    rng = np.random.default_rng(seed + TYPES.index(qtype))
    if qtype in QUANTIZABLE:
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05,
                                   gguf.GGMLQuantizationType[qtype])
    else:
        raw = _random_k_blocks(qtype, n, k, rng)
    return SourceTensor(f"w.{qtype}", qtype, (n, k), np.ascontiguousarray(raw, np.uint8))


def _quantized(x: np.ndarray) -> np.ndarray:
    """The kernel's int8 activation blocks of x, back in float64 (plugins/reference.py)."""
    from plugins.reference import quantize_rows_ref

    q, dx = quantize_rows_ref(x)
    return (q.astype(np.float64).reshape(x.shape[0], -1, 32) * dx.astype(np.float64)[..., None]).reshape(x.shape)


def _dequant_row(kind: str, data: np.ndarray, rows: int, cols: int, n: int) -> np.ndarray:
    lib = native.library()
    lib.sd_dequant_row.argtypes = [ctypes.POINTER(native._Matrix), ctypes.c_int, ctypes.c_void_p]
    lib.sd_dequant_row.restype = ctypes.c_int
    out = np.empty(cols, np.float32)
    mat = native._Matrix(data.ctypes.data, KINDS[kind], rows, cols, 0)
    assert lib.sd_dequant_row(ctypes.byref(mat), n, out.ctypes.data) == 0
    return out


@pytest.fixture(scope="module", params=TYPES)
def case(request):
    t = _tensor(request.param)
    kind, data, rows, cols = matrix([t])
    return t, t.float32(), kind, data, rows, cols


def test_kind_and_size_are_the_gguf_tensor_s_own(case):
    t, _, kind, data, rows, cols = case
    assert kind == KIND[t.qtype] == kind_of(t)
    assert (rows, cols) == (48, COLS) and data.dtype == np.uint8
    assert data.nbytes == rows // LANES * cols // BLOCK_ELEMS[kind] * BLOCK_BYTES[kind]
    if t.qtype != "Q4_0":                             # Q4_0 is read as Q4_1 (m = -8d): 2 bytes more per 32
        assert data.nbytes == t.raw.nbytes * rows // ROWS
        full = _tensor(t.qtype, n=32)                 # rows a multiple of 16: exactly the GGUF's bytes
        assert matrix([full])[1].nbytes == full.raw.nbytes


def test_rows_dequantize_exactly_as_gguf(case):
    t, w, kind, data, rows, cols = case
    for n in (0, 7, 16, 39):
        assert np.array_equal(_dequant_row(kind, data, rows, cols, n), w[n]), n
    assert not _dequant_row(kind, data, rows, cols, 47).any()       # a padding row is zero


def test_matmul_matches_the_dequantized_weights(case):
    t, w, kind, data, rows, cols = case
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    x[2, 64:96] = 0.0                                                  # an all-zero block: scale 0
    y = native.blocked_matmul(kind, data, rows, cols, x, threads=2)
    assert not y[:, ROWS:].any()                                       # padding rows
    ref = _quantized(x) @ w.astype(np.float64).T
    assert np.abs(y[:, :ROWS] - ref).max() <= 2e-6 * np.abs(ref).max(), np.abs(y[:, :ROWS] - ref).max()
    # activations the int8 blocks hold exactly (integers, each block's amax 127): x W^T itself
    xi = rng.integers(-127, 128, (3, cols)).astype(np.float32)
    xi[:, ::32] = 127.0
    yi = native.blocked_matmul(kind, data, rows, cols, xi, threads=1)[:, :ROWS]
    refi = xi.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(yi - refi).max() <= 2e-6 * np.abs(refi).max(), np.abs(yi - refi).max()


def test_rows_do_not_depend_on_the_batch_or_the_threads(case):
    _, _, kind, data, rows, cols = case
    x = np.random.default_rng(3).standard_normal((7, cols)).astype(np.float32)
    batch = native.blocked_matmul(kind, data, rows, cols, x, threads=2)
    assert np.array_equal(batch, native.blocked_matmul(kind, data, rows, cols, x, threads=1))
    for r in (0, 3, 6):
        alone = native.blocked_matmul(kind, data, rows, cols, x[r:r + 1], threads=1)[0]
        assert np.array_equal(alone, batch[r]), r


def test_wide_activations_match_the_dequantized_weights_and_keep_rows_independent(case):
    """Wide activations (the int8 blocks plus their residual's): the products of the dequantized
    weights with what the two int8 rows hold, far closer to x W^T itself than int8 alone, and a
    row's bits independent of the batch and the thread count as ever."""
    from plugins.reference import wide_rows_ref

    t, w, kind, data, rows, cols = case
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    x[:, 3] *= 60.0                                                    # an outlier column, as Gemma's
    x[2, 64:96] = 0.0                                                  # an all-zero block
    wd = w.astype(np.float64)
    y = native.blocked_matmul(kind, data, rows, cols, x, threads=2, wide=True)[:, :ROWS]
    ref = wide_rows_ref(x) @ wd.T
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max(), np.abs(y - ref).max()
    exact = x.astype(np.float64) @ wd.T
    narrow = native.blocked_matmul(kind, data, rows, cols, x, threads=2)[:, :ROWS]
    assert np.abs(y - exact).max() * 50 < np.abs(narrow - exact).max()
    for r in (0, 2, 5):
        alone = native.blocked_matmul(kind, data, rows, cols, x[r:r + 1], threads=1, wide=True)[0, :ROWS]
        assert np.array_equal(alone, y[r]), r


def test_parts_of_one_kind_concatenate_and_mixed_kinds_become_q8():
    a, b = _tensor("Q4_K", n=16, seed=1), _tensor("Q4_K", n=24, seed=2)
    kind, data, rows, cols = matrix([a, b])
    w = np.concatenate([a.float32(), b.float32()])
    assert kind == "q4_k" and rows == 48
    assert all(np.array_equal(_dequant_row(kind, data, rows, cols, n), w[n]) for n in (0, 15, 16, 39))
    c = _tensor("Q6_K", n=16, seed=3)
    kind, data, rows, cols = matrix([a, c])
    assert kind == "q8" and rows == 32
