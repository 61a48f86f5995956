"""The request schema (backend/request_schema.py) is the one list of a request's fields: the
models' config.pbtxt are written from it, and every door reads it. Each test fails when a door
or a document disagrees with it, or when a sampling parameter has no line in it."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from backend import request_schema as schema
from backend import triton_io, triton_relay
from backend.builder.templates import fill_repository
from backend.config import SamplingParams
from backend.serve import client, openai_protocol
from backend.serve.dynamo import protocol as dynamo

ROOT = Path(__file__).resolve().parents[1]
TENSOR = re.compile(r'\{ name: "(\w+)" data_type: TYPE_(\w+) dims: \[ ([-\d, ]+) \]( optional: true)? \}')
# a value of each kind, not its default: what a request would send
SAMPLE = {"BYTES": "x", "BOOL": True, "INT32": 3, "UINT64": 9, "FP32": 0.25}
SET_BY_END_ID = ("stop_token_ids", "ignore_eos")     # end_id sets these two


def sample(f: schema.Field):
    return ["x", "y"] if f.is_list else SAMPLE[f.dtype]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("repo")
    values = {"engine_dir": "specdec/engine", "max_batch_size": 8, "default_format": "gguf", "max_seq_len": 64,
              "drafts": "none", "default_drafter": "auto", "instance_kind": "KIND_CPU", "remote_draft": "",
              "remote_draft_kind": "draft-model"}
    return {p.parent.name: p.read_text() for p in fill_repository(out, values)}


def tensors(text: str, block: str) -> dict[str, tuple]:
    body = re.search(rf"^{block} \[\n(.*?)\n\]", text, re.S | re.M).group(1)
    return {m[0]: (m[1], m[2], bool(m[3])) for m in TENSOR.findall(body)}


@pytest.mark.parametrize("model", [*schema.SERVED, "preprocessing"])
def test_each_models_inputs_and_outputs_are_the_schemas(configs, model):
    dtype = lambda d: "STRING" if d == "BYTES" else d
    want = {f.name: (dtype(f.dtype), ", ".join(map(str, f.dims)), model not in f.required_in)
            for f in schema.inputs_of(model)}
    assert tensors(configs[model], "input") == want
    if model != "preprocessing":
        assert tensors(configs[model], "output") == {o.name: (dtype(o.dtype), ", ".join(map(str, o.dims)), False)
                                                     for o in schema.outputs_of(model)}


def test_the_ensemble_maps_every_input_and_statistic(configs):
    steps = re.findall(r'model_name: "(\w+)".*?\n    \}', configs["ensemble"], re.S)
    blocks = dict(zip(steps, re.split(r'model_name: "\w+"', configs["ensemble"])[1:]))
    ins = lambda step: set(re.findall(r'input_map \{ key: "(\w+)"', blocks[step]))
    outs = lambda step: set(re.findall(r'output_map \{ key: "(\w+)"', blocks[step]))
    ensemble = {f.name for f in schema.inputs_of("ensemble")}
    assert ins("preprocessing") == ensemble
    assert ins("generator") == (ensemble - set(schema.PROMPT_FIELDS)) | {"input_ids"}
    assert set(schema.stat_outputs()) <= outs("generator")


def test_the_relay_forwards_every_input_of_specdec_and_the_client_knows_every_datatype():
    assert set(triton_relay.FORWARDED) == {f.name for f in schema.inputs_of("specdec")} - {"stream"}
    assert client._DTYPES == {f.name: f.dtype for f in schema.FIELDS}
    assert set(triton_io.REQUEST_INPUTS) == set(schema.BY_NAME)


def test_every_sampling_parameter_has_a_line_and_every_line_a_parameter():
    """A SamplingParams field nobody can send is a parameter the schema lacks."""
    params = {f.param for f in schema.FIELDS if f.param}
    assert params <= {f.name for f in dataclasses.fields(SamplingParams)}
    assert params | set(SET_BY_END_ID) == {f.name for f in dataclasses.fields(SamplingParams)}


def test_triton_tensors_set_every_parameter_by_its_datatype():
    inputs = {f.name: np.array(sample(f), np.object_ if f.dtype == "BYTES" else None)
              for f in schema.FIELDS if f.param}
    p = triton_io.sampling_params(inputs)
    for f in schema.FIELDS:
        if f.param:
            expected = tuple(sample(f)) if f.is_list else sample(f)
            assert getattr(p, f.param) == pytest.approx(expected), f.name
    absent = triton_io.sampling_params({})
    assert absent == SamplingParams()
    assert [f.default_text for f in schema.FIELDS if f.name in ("max_tokens", "top_p")] == ["128", "1"]


def test_max_tokens_minus_one_is_the_engines_context():
    ids = [5, 6, 7]
    req = triton_io.parse({"max_tokens": np.array([-1])}, ids, context=64).request
    assert req.params.max_tokens == 64
    with pytest.raises(Exception, match="max_tokens"):          # not known here: refused, naming it
        triton_io.parse({"max_tokens": np.array([-1])}, ids).request.params.validate()


def test_the_openai_front_carries_every_field_the_schema_gives_it():
    carried = [f for f in schema.FIELDS if f.openai]
    assert {f.openai for f in carried if f.extension} == set(openai_protocol.EXTENSIONS)
    assert {f.openai for f in carried if not f.extension} <= set(openai_protocol.HONOURED)
    body = {"model": "specdec", "messages": [{"role": "user", "content": "hi"}]}
    for f in carried:
        body[f.openai] = True if f.name == "end_id" else sample(f)
    fields = openai_protocol.parse(body, chat=True).fields
    for f in carried:
        if f.name != "end_id":
            assert fields[f.name] == sample(f), f.name
    assert fields["end_id"] == -1
    assert openai_protocol.parse({k: v for k, v in body.items() if k != "max_tokens"}, True).fields["max_tokens"] == -1


def test_the_dynamo_worker_carries_every_field_the_schema_gives_it():
    request = {"token_ids": [1, 2]}
    for f in schema.FIELDS:
        if f.dynamo and f.name != "input_ids":
            group, key = f.dynamo.split(".", 1)
            value = True if f.name == "end_id" else sample(f)
            if group == "annotations":
                request.setdefault(group, []).append(f"{key}:{value}")
            else:
                request.setdefault(group, {})[key] = value
    fields = dynamo.generator_fields(request)
    for f in schema.FIELDS:
        if f.dynamo and f.name not in ("input_ids", "end_id"):
            assert fields[f.name] == sample(f), f.name
    assert fields["input_ids"] == [1, 2] and fields["end_id"] == -1


def test_a_draft_node_call_carries_every_draft_field():
    from backend.drafters.remote import params_json

    p = SamplingParams(**{f.param: sample(f) for f in schema.DRAFT})
    sent = params_json(p)
    assert set(sent) == {f.param for f in schema.DRAFT}
    assert SamplingParams(**{f.param: f.py_type(sent[f.param]) for f in schema.DRAFT}) == p


def test_specdec_generate_has_a_flag_for_each_flagged_field():
    from backend.cli_args import add_generate_args

    ap = argparse.ArgumentParser()
    add_generate_args(ap)
    flags = [f for f in schema.FIELDS if f.flag]
    argv = ["hi"] + [x for f in flags for x in (f.flag, str(sample(f)))]
    fields = client.request_fields("hi", ap.parse_args(argv))
    assert {f.name: fields[f.name] for f in flags} == {f.name: sample(f) for f in flags}


def test_serving_md_lists_the_inputs_and_outputs_as_the_schema_has_them():
    doc = (ROOT / "docs" / "serving.md").read_text()
    table = doc[doc.index("## Request inputs"):doc.index("Outputs:")]
    rows = {m[0]: (m[1].strip(), m[2].strip().strip("`")) for m in re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", table, re.M)}
    public = schema.inputs_of("specdec")
    assert set(rows) == {f.name for f in public}
    for f in public:
        assert rows[f.name] == (f.dtype + (" [-1]" if f.is_list else ""), f.default_text), f.name
    outputs = doc[doc.index("Outputs:"):doc.index("Errors:", doc.index("Outputs:"))]
    assert set(re.findall(r"`(\w+)`", outputs)) >= {o.name for o in schema.outputs_of("specdec")}


def doors_table() -> str:
    """serving.md's table of which door carries which input, as the schema says."""
    code = lambda v: f"`{v}`" if v else ""
    rows = ["| input | Triton models | OpenAI field | Dynamo request | draft node | `specdec generate` |",
            "|---|---|---|---|---|---|"]
    for f in schema.FIELDS:
        openai = code(f.openai) + (" (ours)" if f.extension else "")
        rows.append(f"| `{f.name}` | {', '.join(f.models)} | {openai} | {code(f.dynamo)} | "
                    f"{'yes' if f.draft else ''} | {code(f.flag)} |")
    return "\n".join(rows)


def test_serving_md_says_which_door_carries_which_input():
    assert doors_table() in (ROOT / "docs" / "serving.md").read_text(), doors_table()


def files_naming(word: str) -> list[str]:
    """The code and template files of backend/, plugins/ and model_repository/ that name `word`."""
    pattern = re.compile(rf"\b{word}\b")
    return sorted(str(p.relative_to(ROOT)) for d in ("backend", "plugins", "model_repository")
                  for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix in (".py", ".c", ".h", ".template") and pattern.search(p.read_text(errors="replace")))


def test_a_sampling_parameter_is_named_where_architecture_md_counts_it():
    """min_p, a sampling parameter like any: its meaning, the device sampler, the schema's line
    (and one check's sampling case); architecture.md's "where a change goes" says how many."""
    named = files_naming("min_p")
    doc = (ROOT / "docs" / "architecture.md").read_text()
    said = int(re.search(r"`min_p` is\s+named in (\d+) code and template files", doc).group(1))
    assert len(named) == said, named
    assert "backend/request_schema.py" in named and not any(p.startswith(("backend/serve", "model_repository"))
                                                            or "triton" in p for p in named if "plugins" not in p), named



def _module_constant(path: Path, name: str) -> ast.expr:
    """The expression a module-level `name = ...` assigns (read, not imported: the Dynamo worker
    imports Dynamo's runtime at import time)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    raise AssertionError(f"{path} assigns no {name}")


def test_architecture_md_flow_draws_each_door_and_each_calls_the_schemas_generator(configs):
    """The flow's doors are the modules that exist, each sends to the model the schema names
    `generator` (the relay and the OpenAI front by value, the Dynamo worker by the schema's
    name, the ensemble by its step), and no door is drawn that this test does not know."""
    from backend.serve import openai_api

    doc = (ROOT / "docs" / "architecture.md").read_text()
    flow = doc[doc.index("## Flow"):doc.index("## Modules")]
    drawn = [line.split("►", 1)[1].split("(")[0].strip() for line in flow.splitlines() if "►" in line]
    doors = {"specdec": ("backend.triton_relay", "backend/triton_relay.py"),
             "serve/openai_api": ("serve/openai_api", "backend/serve/openai_api.py"),
             "serve/dynamo/worker": ("serve/dynamo/worker", "backend/serve/dynamo/worker.py"),
             "ensemble: preprocessing": ("ensemble: preprocessing", "model_repository/preprocessing/1/model.py")}
    assert drawn == list(doors), drawn
    for said, path in doors.values():
        assert said in flow and (ROOT / path).is_file(), path
    assert triton_relay.GENERATOR == openai_api.TRITON_MODEL == schema.GENERATOR
    worker = ROOT / "backend/serve/dynamo/worker.py"
    assert ast.dump(_module_constant(worker, "MODEL")) == ast.dump(ast.Name("GENERATOR", ast.Load()))
    assert "from backend.request_schema import GENERATOR" in worker.read_text()
    steps = re.findall(r'model_name: "(\w+)"', configs["ensemble"])
    assert steps == ["preprocessing", schema.GENERATOR, "postprocessing"], steps
