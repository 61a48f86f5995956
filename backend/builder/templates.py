"""Fill the `config.pbtxt.template` files of a model repository (TensorRT-LLM fill_template.py
idea): `${name}` placeholders are substituted from values derived from the manifest, and the
build fails if a template names a value we do not have or if any `${` is left over. A model's
`${inputs}` and `${outputs}` (and the ensemble's step maps) are written from the request schema
(backend/request_schema.py), so its fields are listed once.
"""
from __future__ import annotations

import re
import shutil
import string
from pathlib import Path

from backend import request_schema as schema
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


def _dims(dims: tuple[int, ...]) -> str:
    return f"[ {', '.join(str(d) for d in dims)} ]"


def _tensor(item, optional: bool = False) -> str:
    dtype = "STRING" if item.dtype == "BYTES" else item.dtype
    return (f'  {{ name: "{item.name}" data_type: TYPE_{dtype} dims: {_dims(item.dims)}'
            f'{" optional: true" if optional else ""} }}')


def _maps(kind: str, names) -> str:
    return "\n".join(f'      {kind} {{ key: "{n}" value: "{n}" }}' for n in names)


def schema_values(model: str) -> dict[str, str]:
    """A model's inputs and outputs as config.pbtxt lists (every input optional but where the schema
    requires it), and the ensemble's maps: every ensemble input to `preprocessing`, those the
    generator takes besides the prompt to `generator`, the generator's statistics back out."""
    inputs = schema.inputs_of(model)
    values = {"inputs": ",\n".join(_tensor(f, model not in f.required_in) for f in inputs),
              "outputs": ",\n".join(_tensor(o) for o in schema.outputs_of(model))}
    if model == schema.ENSEMBLE:
        to_generator = [f.name for f in inputs if schema.GENERATOR in f.models and f.name not in schema.PROMPT_FIELDS]
        values.update(to_preprocessing=_maps("input_map", (f.name for f in inputs)),
                      to_generator=_maps("input_map", to_generator),
                      from_generator=_maps("output_map", (o.name for o in schema.outputs_of(model) if o.stat)))
    return values


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
        model_values = {**values, **schema_values(tpl.parent.name)}
        out.write_text(fill(tpl.read_text(), model_values, str(tpl)))
        written.append(out)
    if not written:
        raise TemplateError(f"{output}: no config.pbtxt{TEMPLATE_SUFFIX} files found")
    return written
