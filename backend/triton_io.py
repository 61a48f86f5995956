"""dict[str, ndarray] <-> Request / StepOutput at the Triton boundary: conversion both ways.

Names follow the TensorRT-LLM ensemble (text_input, max_tokens, temperature, top_k, top_p,
random_seed, stop_words, end_id, stream, num_draft_tokens, text_output), so existing clients
and genai-perf work unchanged; TensorRT-LLM conventions hold too: top_p = 0 means "off", empty
stop words mean "none", end_id = -1 means "do not stop at EOS". Ours (the request schema lists
them): max_tokens = -1 means "up to the engine's context" (an OpenAI request without max_tokens),
apply_chat_template (text_input is one user message, or a JSON list of {"role","content"}
messages), the drafter's inputs, more sampling parameters, and the per-response statistics
outputs, the prompt's token count among them.
Its public functions are the boundary: tensors in -> `parse` (a Request, converted but not yet
validated: sequence.validate_request is the one validator, run where the server's limits are
known) -> tensors out. The fields themselves (names, datatypes, defaults, which model takes
which) are the request schema's (backend/request_schema.py); here they are read by datatype.
Knows: conversion. Does not know: Triton's Python API (no pb_utils).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from backend import request_schema as schema
from backend.config import DrafterKind, RequestError, SamplingParams
from backend.errors import NoChatTemplate
from backend.sequence import Request, StepOutput

TEXT_INPUT = "text_input"
INPUT_IDS = "input_ids"             # ensemble: preprocessing -> generator
TEXT_OUTPUT = "text_output"
OUTPUT_IDS = "output_ids"           # ensemble: generator -> postprocessing (cumulative ids)
TEXT_START, TEXT_END = "text_start", "text_end"
SEQUENCE_KEY = "sequence_key"
STOP = "stop"                       # generator: stop the request with this sequence_key
STAT_OUTPUTS = schema.stat_outputs()
REQUEST_INPUTS = tuple(f.name for f in schema.FIELDS)
UNAVAILABLE = "unavailable"         # the message prefix of an overload error (Overloaded)
RELAY_KEY_PREFIX = "specdec-relay-"  # request ids of the `specdec` relay's BLS requests
UP_TO_CONTEXT = -1                  # max_tokens: as many as the engine's context leaves (llama.cpp's n_predict -1)
NO_CHAT_TEMPLATE = ("this model has no chat template (a base model): send the prompt as plain text "
                    "to continue, with apply_chat_template=false (`specdec generate --raw`)")


@dataclass(frozen=True)
class Parsed:
    request: Request
    stream: bool
    batched: bool       # inputs carried a leading batch dimension (max_batch_size > 0)


def _one(inputs: dict, name: str):
    arr = inputs.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise RequestError(name, f"expected exactly one value, got shape {list(arr.shape)} "
                                 "(send one prompt per request)")
    return arr.reshape(-1)[0]


def _str(v, name: str) -> str:
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(name, f"not valid UTF-8: {exc}") from None
    return str(v)


def _int(inputs, name, default):
    v = _one(inputs, name)
    if v is None:
        return default
    if isinstance(v, (bytes, str, np.bytes_, np.str_)) or not float(v).is_integer():
        raise RequestError(name, f"expected an integer, got {v!r}")
    return int(v)


def _float(inputs, name, default):
    v = _one(inputs, name)
    if v is None:
        return default
    if isinstance(v, (bytes, str, np.bytes_, np.str_)):
        raise RequestError(name, f"expected a number, got {v!r}")
    return float(v)


def _bool(inputs, name, default):
    v = _one(inputs, name)
    return default if v is None else bool(v)


def messages_from_text(text: str) -> list[dict]:
    """apply_chat_template: a JSON list of messages, or the text as one user message."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            msgs = json.loads(stripped)
        except json.JSONDecodeError:
            msgs = None
        if isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            return msgs
    return [{"role": "user", "content": text}]


def prompt_text(inputs: dict, chat_template_fn) -> str:
    """The prompt's text; with `apply_chat_template`, rendered by chat_template_fn (the
    tokenizer's), which raises NoChatTemplate for a model without one: refused, naming the input."""
    v = _one(inputs, TEXT_INPUT)
    if v is None:
        raise RequestError(TEXT_INPUT, "missing (a BYTES tensor with the prompt)")
    text = _str(v, TEXT_INPUT)
    if not text.strip():
        raise RequestError(TEXT_INPUT, "empty prompt")
    if _bool(inputs, "apply_chat_template", False):
        try:
            text = chat_template_fn(messages_from_text(text))
        except NoChatTemplate:
            raise RequestError("apply_chat_template", NO_CHAT_TEMPLATE) from None
    return text


def _strings(inputs, name) -> tuple[str, ...]:
    arr = inputs.get(name)
    return () if arr is None else tuple(s for s in (_str(x, name) for x in np.asarray(arr).reshape(-1)) if s)


_READ = {"FP32": _float, "INT32": _int, "UINT64": _int, "BOOL": _bool}


def _value(inputs: dict, f: schema.Field):
    if f.is_list:
        return _strings(inputs, f.name)
    if f.dtype == "BYTES":
        v = _one(inputs, f.name)
        return None if v is None else _str(v, f.name)
    return _READ[f.dtype](inputs, f.name, None)


def sampling_params(inputs: dict, context: int | None = None) -> SamplingParams:
    """The request's SamplingParams: each schema field that sets one, absent ones at its default;
    `context`: the engine's length, what max_tokens = -1 asks for."""
    values = {f.param: v for f in schema.FIELDS if f.param and (v := _value(inputs, f)) is not None}
    if values.get("top_p") == 0.0:
        values["top_p"] = 1.0
    if values.get("max_tokens") == UP_TO_CONTEXT and context is not None:
        values["max_tokens"] = context
    end_id = _int(inputs, "end_id", None)
    if end_id is not None:
        values["stop_token_ids"] = (end_id,) if end_id >= 0 else ()
        values["ignore_eos"] = True        # an explicit end_id replaces the model's EOS ids
    return SamplingParams(**values)


def parse(inputs: dict, prompt_ids, request_id: str = "", context: int | None = None) -> Parsed:
    """Full request from tensors; prompt_ids: the tokenized prompt (from text or input_ids);
    context: the engine's length (None: not known here, and max_tokens = -1 is refused). Refuses
    values of the wrong kind; whether the values can be served is validate_request's."""
    drafter = _one(inputs, "drafter")
    kind = DrafterKind.AUTO
    if drafter is not None:
        name = _str(drafter, "drafter").strip() or "auto"
        try:
            kind = DrafterKind(name)
        except ValueError:
            raise RequestError("drafter", f"unknown drafter {name!r}; one of "
                                          f"{[k.value for k in DrafterKind]}") from None
    k = _int(inputs, "num_draft_tokens", None)
    req = Request(tuple(int(t) for t in prompt_ids), sampling_params(inputs, context), kind, k, request_id)
    first = next(iter(inputs.values()))
    return Parsed(req, _bool(inputs, "stream", False), np.asarray(first).ndim >= 2)


def stop_key(inputs: dict) -> str | None:
    """The ensemble's cancellation: the sequence key to stop if this is a `stop` request."""
    if not _bool(inputs, STOP, False):
        return None
    return _str(_one(inputs, SEQUENCE_KEY) or b"", SEQUENCE_KEY)


def input_ids(inputs: dict) -> list[int]:
    arr = inputs.get(INPUT_IDS)
    if arr is None:
        raise RequestError(INPUT_IDS, "missing")
    arr = np.asarray(arr)
    if arr.ndim == 2 and arr.shape[0] != 1:
        raise RequestError(INPUT_IDS, f"one sequence per request, got batch {arr.shape[0]}")
    return [int(t) for t in arr.reshape(-1)]


def error_code(message: str) -> str:
    """The Triton error code of one of our error messages (which BLS delivers without its code):
    client errors name an input first (`top_p: ...`), overload says `unavailable: ...`."""
    head = message.split(":", 1)[0].strip()
    if head == UNAVAILABLE:
        return "UNAVAILABLE"
    return "INVALID_ARG" if head in REQUEST_INPUTS else "INTERNAL"


def finished(out: dict | None) -> bool:
    """Whether a generator response says its request finished (stop, length or cancelled)."""
    if out is None or "finish_reason" not in out:
        return False
    return bool(np.asarray(out["finish_reason"]).reshape(-1)[0])


def relay_outputs(out: dict) -> dict[str, np.ndarray]:
    """The specdec model's outputs from a generator response (text + statistics)."""
    return {k: np.asarray(out[k]).reshape(1) for k in (TEXT_OUTPUT, *STAT_OUTPUTS)}


def stats_outputs(out: StepOutput, prompt_tokens: int) -> dict[str, np.ndarray]:
    st = out.stats
    return {
        "output_token_count": np.array([out.num_output_tokens], np.int32),
        "total_draft_tokens": np.array([st.num_draft_tokens], np.int32),
        "total_accepted_draft_tokens": np.array([st.num_accepted_tokens], np.int32),
        "acceptance_rate": np.array([st.acceptance_rate], np.float32),
        "mean_accepted_tokens": np.array([st.mean_accepted_tokens], np.float32),
        "finish_reason": np.array([(out.finish_reason or "").encode()], np.object_),
        "cached_prompt_tokens": np.array([out.cached_prompt_tokens], np.int32),
        "prompt_token_count": np.array([prompt_tokens], np.int32),
    }


def generator_outputs(out: StepOutput, output_ids: list[int], text: str, key: str,
                      prompt_tokens: int) -> dict[str, np.ndarray]:
    """One generator response: cumulative ids and the character range of the new text (for
    clients of ids), the new text itself, the sequence key and the statistics (the prompt's
    token count among them, so a client that sent text needs no tokenizer to report usage)."""
    return {OUTPUT_IDS: np.asarray(output_ids, np.int32).reshape(-1),
            TEXT_START: np.array([out.text_start], np.int32),
            TEXT_END: np.array([out.text_end], np.int32),
            TEXT_OUTPUT: np.array([text.encode("utf-8")], np.object_),
            SEQUENCE_KEY: np.array([key.encode()], np.object_), **stats_outputs(out, prompt_tokens)}


def prompt_ids(inputs: dict, tokenizer) -> list[int]:
    """The request's prompt as token ids: `input_ids` as given, else `text_input` tokenized
    (through the chat template with `apply_chat_template`)."""
    if INPUT_IDS in inputs:
        return input_ids(inputs)
    text = prompt_text(inputs, tokenizer.apply_chat_template)
    return tokenizer.encode(text, add_special_tokens=True)


def flags(inputs: dict) -> tuple[bool, bool]:
    """(stream, batched) of a request, before its values are read."""
    first = next(iter(inputs.values()))
    return _bool(inputs, "stream", False), np.asarray(first).ndim >= 2


def with_batch_dim(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v[None] for k, v in tensors.items()}
