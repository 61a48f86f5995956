"""Fixed text for the draft head, labelled by the target (teacher forcing, prefill passes only).

EAGLE (Li et al. 2024, arXiv:2401.15077, section 4.3.2) found that a head trained on a fixed
dataset, with the target's own distributions as labels, is nearly as good as one trained on the
target's generated answers. Generating answers on these CPUs runs at ~180 tokens/s; a teacher-
forced prefill runs at ~1000 tokens/s, so fixed text buys ~5x more tokens per hour.

The text is what every installation has offline: the docstrings of the Python standard library
and of the installed packages (read with `ast`, nothing is imported) and the language reference
topics of `pydoc_data`. Each document becomes a single-turn chat: a question about the object
(templated) and the document as the assistant's answer, in the target's chat template. No
benchmark prompt is used; the validation prompts are general chat questions generated from a
different seed (prompts.validation_prompts) and answered by the target itself.

Records are the same as data.generate_responses's ({"i", "prompt_ids", "output_ids"}), so the
feature extraction and training code paths are shared.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from pathlib import Path

_SKIP_PARTS = {"tests", "test", "testing", "_vendor", "vendor", "idlelib", "lib2to3", "turtledemo",
               "site-packages"}

_Q_FUNCTION = [
    "What does `{qual}` do?",
    "Explain `{qual}` from the `{pkg}` package.",
    "How do I use `{qual}`?",
    "Can you describe the function `{name}` in `{mod}`?",
    "I came across `{qual}`. What is it for?",
]
_Q_CLASS = [
    "Describe the `{qual}` class.",
    "What is `{name}` in `{mod}` and when would I use it?",
    "Explain the class `{qual}`.",
]
_Q_MODULE = [
    "What is the `{mod}` module for?",
    "Give me an overview of `{mod}`.",
    "Explain what the Python module `{mod}` provides.",
]
_Q_TOPIC = [
    "Explain {topic} in Python.",
    "How does {topic} work in Python?",
    "Tell me about {topic}.",
]


def _docstrings(root: Path, package_prefix: str = "") -> list[dict]:
    """Module, class and public function docstrings of the .py files under `root`."""
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in _SKIP_PARTS for p in rel.parts[:-1]) or rel.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError, RecursionError):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts:
            continue
        mod = package_prefix + ".".join(parts)
        for node in ast.walk(tree):
            if isinstance(node, ast.Module):
                kind, name = "module", mod
            elif isinstance(node, ast.ClassDef):
                kind, name = "class", node.name
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind, name = "function", node.name
            else:
                continue
            if kind != "module" and name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc and 300 <= len(doc) and sum(c.isalpha() for c in doc) > 0.55 * len(doc):
                docs.append({"kind": kind, "name": name, "mod": mod, "pkg": parts[0], "text": doc[:4000]})
    return docs


def _topics() -> list[dict]:
    try:
        from pydoc_data import topics
    except ImportError:
        return []
    out = []
    for key, text in sorted(topics.topics.items()):
        for a in range(0, len(text), 3000):
            chunk = text[a: a + 3000].strip()
            if len(chunk) > 300:
                out.append({"kind": "topic", "name": key, "mod": "", "pkg": "pydoc_data", "text": chunk})
    return out


def default_roots() -> list[str]:
    paths = sysconfig.get_paths()
    return [paths["stdlib"], paths["purelib"]]


def documents(seed: int = 0, max_package_share: float = 0.12, roots: list[str] | None = None) -> list[dict]:
    """Every usable document, deduplicated, in a seeded order, no package above its share of
    the characters (torch and sympy alone would otherwise be most of the text). `roots`:
    directories of .py files (default: the standard library, then the installed packages;
    with the default, pydoc_data's language reference topics too)."""
    docs = []
    for k, root in enumerate(roots or default_roots()):
        docs += _docstrings(Path(root))
        if k == 0 and not roots:
            docs += _topics()
    seen, unique = set(), []
    for d in docs:
        h = hashlib.sha1(d["text"].encode()).hexdigest()
        if h not in seen:
            seen.add(h)
            unique.append(d)
    random.Random(seed).shuffle(unique)
    total = sum(len(d["text"]) for d in unique)
    cap = total * max(max_package_share, 1.0 / len({d["pkg"] for d in unique} or {""}))
    used: dict[str, int] = {}
    out = []
    for d in unique:
        if d["pkg"] in used and used[d["pkg"]] + len(d["text"]) > cap:
            continue
        used[d["pkg"]] = used.get(d["pkg"], 0) + len(d["text"])
        out.append(d)
    return out


def _question(d: dict, rng: random.Random) -> str:
    tpl = rng.choice({"function": _Q_FUNCTION, "class": _Q_CLASS, "module": _Q_MODULE,
                      "topic": _Q_TOPIC}[d["kind"]])
    qual = f"{d['mod']}.{d['name']}" if d["kind"] in ("function", "class") else d["mod"]
    return tpl.format(qual=qual, name=d["name"], mod=d["mod"], pkg=d["pkg"],
                      topic=d["name"].replace("-", " "))


def corpus_records(tok, num_tokens: int, out_path: Path, seed: int = 0, max_len: int = 512,
                   roots: list[str] | None = None) -> list[dict]:
    """Token records of documents as chats until `num_tokens` tokens (cached in `out_path`)."""
    if out_path.exists():
        recs = [json.loads(line) for line in out_path.read_text().splitlines() if line.strip()]
        if sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in recs) >= num_tokens:
            return recs
    rng = random.Random(seed)
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    recs, total = [], 0
    for i, d in enumerate(documents(seed, roots=roots)):
        if total >= num_tokens:
            break
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": _question(d, rng)}]),
                            add_special_tokens=False)
        answer = tok.encode(d["text"], add_special_tokens=False) + ([eos] if eos is not None else [])
        answer = answer[: max(0, max_len - len(prompt))]
        if len(answer) < 32:
            continue
        recs.append({"i": i, "prompt_ids": prompt, "output_ids": answer})
        total += len(prompt) + len(answer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs
