"""Every path of the native kernel this machine can run, against each other, bit for bit: AMX tiles
(forced on every row count), AVX-512 VNNI, and the 256-bit builds setup.py compiles beside the
main one where the CPU has more: AVX-VNNI, and AVX2 without VNNI, the path of AVX2-only CPUs
(AMD Zen 1-3: its integer dot by maddubs + madd, Q8_0's offset bytes split in two, perf-notes
section 34), so an AVX-512 machine runs that path too. Each path in a process of its own (a
process loads one library, SPECDEC_ISA): the quantized matmul of every weight kind the kernel
reads (wide activations on and off, 1-64 rows, 1 and 2 threads) and a whole engine's logits
(tiny_native_build: prefills, a tree per row, a plain step, wide families), each equal to the
first path's. And SPECDEC_ISA's refusals, everywhere."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

native = pytest.importorskip("backend.runtime.native")
if not native.compiled():
    pytest.skip("the native kernel is not compiled", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
# the vector paths each SPECDEC_ISA value must load where the CPU has them (a build missing there
# is a failure); amx wherever `auto` finds tiles (the CPU and the OS: kernels.h tiles_select)
EXPECTED = {"avx512": "avx512_vnni" in FLAGS, "avx-vnni": "avx_vnni" in FLAGS, "avx2": "avx2" in FLAGS}

# run in each path's process: the matmuls and the engine's logits into an .npz
WORKER = r'''
import sys
sys.path.insert(0, "tests")
import numpy as np
from backend.manifest import EngineManifest
from backend.runtime import native
from backend.devices.native.blocks import matrix
from conftest import tiny_engine_logits
from test_native_blocks import TYPES, _tensor

if native.isa() == "amx":
    native.use_tiles(True, always=True)          # tiles for every row count, not only 10+
out = {}
for qtype in TYPES:
    kind, data, rows, cols = matrix([_tensor(qtype, n=48, k=512)])
    rng = np.random.default_rng(TYPES.index(qtype))
    x = (rng.standard_normal((64, cols)) * rng.uniform(0.1, 3.0, (64, 1))).astype(np.float32)
    x[:, 7] *= 40.0                              # an outlier column: wide rows' residuals matter
    for wide in (False, True):
        for t in (1, 3, 8, 9, 17, 64):
            for threads in ((1, 2) if t in (1, 64) else (2,)):
                out[f"{qtype} wide={wide} rows={t} threads={threads}"] = native.blocked_matmul(
                    kind, data, rows, cols, x[:t], threads=threads, wide=wide)
for i, logits in enumerate(tiny_engine_logits(EngineManifest.load(sys.argv[2]))):
    out[f"engine forward {i}"] = logits
np.savez(sys.argv[1], isa=native.isa(), **out)
'''


def _in_process(value: str, *args: str, code: str = "from backend.runtime import native; print(native.isa())"):
    env = {"SPECDEC_ISA": value, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    """SPECDEC_ISA value -> the path it loads, for every value this machine runs; the values the
    CPU supports must load."""
    auto = _in_process("auto")
    assert auto.returncode == 0, auto.stderr
    expected = {**EXPECTED, "amx": auto.stdout.strip() == "amx"}
    got = {}
    for value in ("amx", "avx512", "avx-vnni", "avx2"):
        r = _in_process(value)
        if r.returncode == 0:
            got[value] = r.stdout.strip()
        assert r.returncode == 0 or not expected[value], (value, r.stderr[-2000:])
    return got


def test_specdec_isa_loads_each_path_or_refuses_clearly(paths):
    auto = _in_process("auto")
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.strip() == paths.get("amx", paths.get("avx512", paths.get("avx-vnni", "avx2")))
    for value, isa in paths.items():
        assert isa == {"avx512": "avx512-vnni"}.get(value, value), (value, isa)
    bad = _in_process("sse2")
    assert bad.returncode != 0 and "SPECDEC_ISA='sse2': expected one of auto, amx, avx512, avx-vnni, avx2" in bad.stderr
    for value in {"amx", "avx512", "avx-vnni"} - set(paths):
        r = _in_process(value)
        assert r.returncode != 0 and f"SPECDEC_ISA={value}" in r.stderr.splitlines()[-1], r.stderr


def test_every_path_gives_the_same_bits_for_every_kind_and_engine(paths, tiny_native_build, tmp_path):
    if len(paths) < 2:
        pytest.skip(f"this CPU runs one path ({', '.join(paths.values())}): nothing to compare it with")
    runs = {}
    for value in paths:
        out = tmp_path / f"{value}.npz"
        r = _in_process(value, str(out), str(tiny_native_build.root), code=WORKER)
        assert r.returncode == 0, (value, r.stderr[-3000:])
        runs[value] = np.load(out)
        assert str(runs[value]["isa"]) == paths[value]
    first, *others = runs
    keys = [k for k in runs[first].files if k != "isa"]
    assert sum(k.startswith("engine") for k in keys) == 4 and len(keys) > 100
    differ = {value: [k for k in keys if not np.array_equal(runs[first][k].view(np.uint32), runs[value][k].view(np.uint32))]
              for value in others}
    assert not any(differ.values()), json.dumps({v: d[:8] for v, d in differ.items()}) + f" differ from {first}"
