"""AMX tiles (plugins/native/amx.h) give the VNNI path's bits: for every weight kind the kernel
reads, wide activations on and off, 1..64 rows, ragged tiles and 1 and 2 threads, the matmul on
tiles equals the matmul without them bit for bit; a whole engine's logits (batch of rows, trees,
wide families) likewise. On a CPU without AMX these tests skip and say so. The other paths
(AVX-512 VNNI, AVX-VNNI, AVX2) against each other, and SPECDEC_ISA: tests/test_native_isa.py."""
import numpy as np
import pytest

native = pytest.importorskip("backend.runtime.native")
if not native.compiled():
    pytest.skip("the native kernel is not compiled", allow_module_level=True)

from test_native_blocks import TYPES, _tensor  # noqa: E402

from backend.devices.native.blocks import matrix  # noqa: E402

HAS_TILES = native.use_tiles(True) == "amx"
needs_tiles = pytest.mark.skipif(not HAS_TILES, reason="this CPU/OS gives no AMX tiles: the tile path is "
                                                       "not exercised here (it runs on Sapphire Rapids and later)")


@pytest.fixture(autouse=True)
def _default_path():
    """Every test leaves the library on the default path (tiles where there are any)."""
    yield
    native.use_tiles(True)


def _both(kind, data, rows, cols, x, threads, wide):
    native.use_tiles(False)
    vnni = native.blocked_matmul(kind, data, rows, cols, x, threads=threads, wide=wide)
    assert native.use_tiles(True, always=True) == "amx"
    tiles = native.blocked_matmul(kind, data, rows, cols, x, threads=threads, wide=wide)
    return vnni, tiles


@needs_tiles
@pytest.mark.parametrize("qtype", TYPES)
def test_tiles_give_the_vnni_bits_for_every_kind_width_and_row_count(qtype):
    kind, data, rows, cols = matrix([_tensor(qtype, n=48, k=512)])
    rng = np.random.default_rng(TYPES.index(qtype))
    x = (rng.standard_normal((64, cols)) * rng.uniform(0.1, 3.0, (64, 1))).astype(np.float32)
    x[:, 7] *= 40.0                                      # an outlier column: wide rows' residuals matter
    for wide in (False, True):
        for t in (1, 2, 3, 7, 8, 9, 16, 17, 31, 33, 64):
            for threads in ((1, 2) if t in (1, 9, 64) else (2,)):
                vnni, tiles = _both(kind, data, rows, cols, x[:t], threads, wide)
                assert np.array_equal(vnni.view(np.uint32), tiles.view(np.uint32)), (qtype, wide, t, threads)


@needs_tiles
def test_tiles_keep_rows_independent_of_the_batch():
    native.use_tiles(True, always=True)
    kind, data, rows, cols = matrix([_tensor("Q4_K", n=32, k=256)])
    x = np.random.default_rng(5).standard_normal((20, cols)).astype(np.float32)
    batch = native.blocked_matmul(kind, data, rows, cols, x, threads=2)
    for r in (0, 15, 16, 19):
        assert np.array_equal(batch[r], native.blocked_matmul(kind, data, rows, cols, x[r:r + 1], threads=1)[0]), r


@needs_tiles
def test_an_engine_s_logits_on_tiles_equal_the_vnni_path_s(tiny_native_engine):
    """Batches of rows, a tree and wide families through sd_forward: the same logits on both paths."""
    run = tiny_native_engine
    native.use_tiles(False)
    vnni = run()
    native.use_tiles(True, always=True)
    tiles = run()
    native.use_tiles(True)
    auto = run()
    for a, b, c in zip(vnni, tiles, auto):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert np.array_equal(a.view(np.uint32), c.view(np.uint32))
