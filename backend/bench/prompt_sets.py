"""The benchmark prompt sets: JSON lines of chat messages (benchmarks/prompts/*.jsonl), and how
one becomes a prompt: through the model's chat template, or for a model without one (a base
model) its messages' text as a plain continuation.
Knows: the file format. Used by the CLI, the benches and benchmarks/ scripts."""
from __future__ import annotations

import json
from pathlib import Path

PUBLIC = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "public.jsonl"
CHAT_TEMPLATE = "chat template"
PLAIN_CONTINUATION = "plain continuation (no chat template)"


def load_prompts(path: str | Path) -> list[dict]:
    """The prompts of a file, or of several given comma separated (in that order)."""
    return [json.loads(line) for p in str(path).split(",") if p
            for line in Path(p).read_text().splitlines() if line.strip()]


def default_prompts() -> str:
    return str(PUBLIC)


def prompt_format(tok) -> str:
    """How `prompt_ids` turns this tokenizer's prompts into ids (for the reports)."""
    return CHAT_TEMPLATE if tok.chat_template else PLAIN_CONTINUATION


def plain_text(messages: list[dict]) -> str:
    """The messages' text, for a model that continues text instead of answering a chat."""
    return "\n\n".join(m["content"] for m in messages)


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """One prompt's ids: the chat template's text (which writes any BOS itself), or without a
    template the plain text with the tokenizer's special tokens (BOS), as the server tokenizes a
    request with `apply_chat_template=false`."""
    if tok.chat_template:
        return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    return tok.encode(plain_text(messages), add_special_tokens=True)
