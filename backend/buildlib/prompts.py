"""Prompts built from text available offline: the Python standard library's module and function
docstrings and names, read by the build's calibration (calibration.py) and by the EAGLE head's
training (train/). Never the benchmark prompts. Instructions vary in style (explain,
summarize, rewrite, list, compare, chat, story) so the draft head sees the kinds of answers a
chat model gives, not only code.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import random
import json
import re
import sys
import warnings

# crypt: importing it calls the C library's crypt() to probe its methods, which crashes under the
# sanitizer's preloaded runtime (plugins/native/sanitize.sh: every native build reads these
# prompts to choose its wide activations); deprecated since 3.11, gone in 3.13
_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtledemo", "lib2to3", "test", "ensurepip",
         "venv", "pydoc_data", "turtle", "crypt"}

_TEMPLATES_DOC = [
    "Explain in simple terms what this Python documentation says:\n\n{doc}",
    "Summarize the following text in two or three sentences.\n\n{doc}",
    "Rewrite this text so that a beginner can understand it.\n\n{doc}",
    "List the key points of this documentation as bullet points.\n\n{doc}",
    "What are common mistakes when using `{name}`? Base your answer on this description:\n\n{doc}",
    "Write a short example that uses `{name}` from the `{module}` module. Here is its documentation:\n\n{doc}",
    "Translate this technical description into plain English and give one everyday analogy.\n\n{doc}",
]
_TEMPLATES_NAME = [
    "What is the Python `{module}` module used for?",
    "Give me three tips for using `{name}` in Python.",
    "How would you explain `{name}` to a friend who is new to programming?",
    "Write a short story in which a programmer discovers the `{module}` module.",
    "Compare `{name}` with a similar feature in another programming language.",
    "Write a haiku about the word '{word}'.",
    "Tell me an interesting fact related to '{word}'.",
    "What is the difference between a {word} and a {word2}?",
    "Write a friendly email inviting a colleague to a talk about {word}.",
    "Give step-by-step instructions for a beginner who wants to learn about {word}.",
    "Describe a {word} to a five-year-old.",
    "Write a short dialogue between two friends talking about {word}.",
]


def _docs(max_modules: int = 400) -> list[tuple[str, str, str]]:
    """(module, name, docstring) triples from the standard library."""
    out = []
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names)
    for mod_name in names[:max_modules]:
        if mod_name in _SKIP or mod_name.startswith("_"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mod = importlib.import_module(mod_name)
            except Exception:
                continue
        if mod.__doc__:
            out.append((mod_name, mod_name, inspect.cleandoc(mod.__doc__)))
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != mod_name:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                out.append((mod_name, f"{mod_name}.{attr}", doc))
    return out


_TEMPLATES_GENERAL = [
    "Explain how {w} works in simple terms.",
    "What is the difference between {w} and {w2}?",
    "Write a short story about {w}.",
    "Give me five practical tips about {w}.",
    "What are the pros and cons of {w}?",
    "Write a short poem about {w}.",
    "How do I get started with {w}?",
    "Briefly describe the history of {w}.",
    "Why is {w} important in everyday life?",
    "Explain {w} to a ten-year-old.",
    "Write a short speech about {w} and {w2}.",
    "List the steps someone should follow to learn about {w}.",
    "What are common misconceptions about {w}?",
    "Write a friendly message to a friend about {w}.",
    "Compare {w} and {w2} in a few sentences.",
]
GENERAL_FROM = 800    # prompts beyond this index are general chat topics (the first 800 are doc based)


def _topics(common_words: list[str] | None = None) -> list[str]:
    """Topic words: English words of the standard library's docs (docstrings and the language
    reference in pydoc_data); when `common_words` (e.g. the target tokenizer's whole-word tokens,
    most frequent first) is given, the first 3000 of those that also occur in the docs."""
    import collections

    counts = collections.Counter()
    for _, _, doc in _docs():
        counts.update(w.lower() for w in re.findall(r"\b[a-z]{5,12}\b", doc))
    try:
        from pydoc_data import topics as pydoc_topics

        for text in pydoc_topics.topics.values():
            counts.update(w.lower() for w in re.findall(r"\b[a-z]{5,12}\b", text))
    except ImportError:
        pass
    if common_words:
        nounish = [w for w in common_words[150:] if counts.get(w, 0) >= 1
                   and not re.search(r"(ed|ing|ly|ive|ous|ful|able|ible|ize|ise)$", w)]
        return nounish[:2000]
    return sorted(w for w, c in counts.items() if c >= 3)


def build_prompts(n: int, seed: int = 0, common_words: list[str] | None = None) -> list[list[dict]]:
    """n single-turn chat conversations ([{"role": "user", "content": ...}]): documentation
    tasks first, then (from index GENERAL_FROM on) general chat questions about common words."""
    prompts = _doc_prompts(min(n, GENERAL_FROM), seed)
    if n > GENERAL_FROM:
        prompts += _general_prompts(n - GENERAL_FROM, random.Random(seed + 1), common_words)
    return prompts


def _general_prompts(n: int, rng: random.Random, common_words: list[str] | None) -> list[list[dict]]:
    words = _topics(common_words) or _topics()
    return [[{"role": "user", "content": rng.choice(_TEMPLATES_GENERAL).format(w=rng.choice(words),
                                                                               w2=rng.choice(words))}]
            for _ in range(n)]


def _doc_prompts(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    docs = _docs()
    words = sorted({w.lower() for _, _, d in docs for w in re.findall(r"[A-Za-z]{5,12}", d)})
    rng.shuffle(docs)
    prompts = []
    for i in range(n):
        mod, name, doc = docs[i % len(docs)]
        if rng.random() < 0.55:
            tpl = rng.choice(_TEMPLATES_DOC)
            text = tpl.format(doc=doc[: rng.randint(200, 900)], name=name, module=mod)
        else:
            tpl = rng.choice(_TEMPLATES_NAME)
            text = tpl.format(name=name, module=mod, word=rng.choice(words), word2=rng.choice(words))
        prompts.append([{"role": "user", "content": text}])
    return prompts


def tokenizer_words(tokenizer_json: str) -> list[str]:
    """Whole lower-case word tokens of a byte-level BPE vocabulary, most frequent merge first."""
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    words = [(i, t[1:]) for t, i in vocab.items() if t.startswith("\u0120") and re.fullmatch(r"[a-z]{5,12}", t[1:])]
    return [w for _, w in sorted(words)]


def validation_prompts(n: int = 48, common_words: list[str] | None = None) -> list[list[dict]]:
    """Held-out open-chat questions for selecting a head: the general templates with topics
    drawn from a seed no training prompt uses (never the benchmark prompts)."""
    return _general_prompts(n, random.Random(10_007), common_words)
