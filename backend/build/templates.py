"""Fill the `config.pbtxt.template` files of a model repository (TensorRT-LLM fill_template.py
idea): `${name}` placeholders are substituted from values derived from the manifest, and the
build fails if a template names a value we do not have or if any `${` is left over.
"""
from __future__ import annotations

import re
import shutil
import string
from pathlib import Path

from backend.errors import UserError

TEMPLATE_SUFFIX = ".template"
SOURCE_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


class TemplateError(UserError, ValueError):
    pass


def fill(text: str, values: dict[str, object], where: str) -> str:
    names = set(re.findall(r"\$\{(\w+)\}", text))
    missing = sorted(names - set(values))
    if missing:
        raise TemplateError(f"{where}: no value for placeholder(s) {missing}")
    out = string.Template(text).substitute({k: str(v) for k, v in values.items()})
    if "${" in out:
        raise TemplateError(f"{where}: unfilled placeholder left: {out[out.index('${'):][:40]!r}")
    return out


def fill_repository(output: Path, values: dict[str, object]) -> list[Path]:
    """Copy the model repository skeleton to `output` (if it is elsewhere) and fill templates."""
    output = Path(output).resolve()
    if output != SOURCE_REPOSITORY.resolve():
        for model_dir in sorted(p for p in SOURCE_REPOSITORY.iterdir() if p.is_dir()):
            dst = output / model_dir.name
            for src in model_dir.rglob("*"):
                if src.is_file() and "__pycache__" not in src.parts and "engine" not in src.relative_to(model_dir).parts[:1]:
                    target = dst / src.relative_to(model_dir)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)
            (dst / "1").mkdir(parents=True, exist_ok=True)   # ensembles need an empty version dir
    written = []
    for tpl in sorted(output.glob(f"*/config.pbtxt{TEMPLATE_SUFFIX}")):
        out = tpl.with_name("config.pbtxt")
        out.write_text(fill(tpl.read_text(), values, str(tpl)))
        written.append(out)
    if not written:
        raise TemplateError(f"{output}: no config.pbtxt{TEMPLATE_SUFFIX} files found")
    return written
