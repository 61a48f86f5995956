"""Shared fixtures: the embedded default model built once per session, HF reference model."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = Path(os.environ.get("SPECDEC_PROMPTS", ROOT / "benchmarks" / "prompts" / "public.jsonl"))


def load_prompts(path: Path = PROMPTS) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from backend.build.embedded import default_gguf

    return default_gguf()


@pytest.fixture(scope="session")
def built_repo(tmp_path_factory, gguf_path) -> Path:
    """The embedded default built into a fresh model repository (fp32 + q4 + self:4 draft)."""
    from backend.build.pipeline import BuildConfig, build

    out = tmp_path_factory.mktemp("model_repository")
    build(BuildConfig(target=str(gguf_path), output=out, drafts=("self:4",), quiet=True))
    return out


@pytest.fixture(scope="session")
def manifest(built_repo):
    from backend.build.pipeline import ENGINE_SUBDIR
    from backend.manifest import EngineManifest

    return EngineManifest.load(built_repo / ENGINE_SUBDIR)


@pytest.fixture(scope="session")
def tokenizer(manifest):
    from backend.tokenizer import Tokenizer

    return Tokenizer.from_manifest(manifest)


@pytest.fixture(scope="session")
def fp32_runtime(manifest):
    from backend.runtime import load_runtime

    rt = load_runtime(manifest, "fp32")
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    model.eval()
    return model


def chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)[None]


def prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
