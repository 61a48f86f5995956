"""Training prompts built from text available offline: the Python standard library's module and
function docstrings and names. Never the benchmark prompts. Instructions vary in style (explain,
summarize, rewrite, list, compare, chat, story) so the draft head sees the kinds of answers a
chat model gives, not only code.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import random
import re
import sys
import warnings

_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtledemo", "lib2to3", "test", "ensurepip",
         "venv", "pydoc_data", "turtle"}

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


def build_prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """n single-turn chat conversations ([{"role": "user", "content": ...}])."""
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
