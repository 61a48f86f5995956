"""The benchmark prompt sets: JSON lines of chat messages (benchmarks/prompts/*.jsonl).
Knows: the file format. Used by the CLI, the benches and benchmarks/ scripts."""
from __future__ import annotations

import json
from pathlib import Path

PUBLIC = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "public.jsonl"


def load_prompts(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def default_prompts() -> str:
    return str(PUBLIC)
