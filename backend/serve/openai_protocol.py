"""OpenAI completions and chat completions, translated to and from the `specdec` Triton model.

A request body becomes a `Call`: the Triton inputs (the request schema's names,
backend/request_schema.py) and how to answer (chat or text, streamed or not, usage in the stream).
Every field is one of three kinds: honoured (`HONOURED`), our extension (`EXTENSIONS`, vLLM's names
where vLLM has one), or refused unless it has its neutral value (`REFUSED`); a few request-metadata
fields are accepted and have no effect on the output (`METADATA`). Anything else is refused with
OpenAI's error object naming the field (HTTP 400), never silently dropped. The request schema says
which OpenAI field carries which input; each is read by its input's datatype, and its values are
the model's to refuse (named for this door). A chat's messages travel as JSON text with
`apply_chat_template`, the path Triton's own clients use, so both doors render the same prompt; a
chat without `max_tokens` asks for the rest of the context (max_tokens = -1), so nothing here counts
tokens.
Knows: the OpenAI request fields and response shapes. Does not know: HTTP (on either side), tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from backend import request_schema as schema
from backend import triton_io

MODEL_ID = "specdec"
COMPLETION_DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
INT32_MAX = 2**31 - 1

_CARRIED = tuple(f for f in schema.FIELDS if f.openai)     # the inputs an OpenAI field carries
HONOURED = ("model", "messages", "prompt", "max_completion_tokens", "n", "stream", "stream_options",
            *(f.openai for f in _CARRIED if not f.extension))
EXTENSIONS = tuple(f.openai for f in _CARRIED if f.extension)
METADATA = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier")
# field -> the values that mean "not used" (anything else is refused)
REFUSED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
           "best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "repetition_penalty": (None, 1), "tools": (None, []), "tool_choice": (None, "none"),
           "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
           "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
           "verbosity": (None,), "web_search_options": (None,)}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# a Triton input named by an error -> the request field the client sent
TRITON_TO_FIELD = {f.name: f.openai for f in _CARRIED}
# read apart: max_tokens (max_completion_tokens too, and the completions' default), end_id (ignore_eos: a flag)
_OWN_READS = ("max_tokens", "end_id")
_VALUE = {"top_k": lambda v: 0 if v == -1 else v}        # vLLM's top_k=-1: off
FINISH = {"stop": "stop", "length": "length"}


class ApiError(Exception):
    """An answer other than 200: OpenAI's error object (`param` names the request field)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.retry_after = status, message, param, kind, retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


@dataclass(frozen=True)
class Call:
    chat: bool
    model: str
    fields: dict                       # Triton inputs by name (backend/serve/client.py's dtypes)
    stream: bool
    include_usage: bool
    max_tokens_field: str              # what the client called it (errors name it)


# ---- typed reads: each names the field it refuses ----

def _number(body: dict, name: str, integer: bool = False, lo: float | None = None, hi: float | None = None):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise bad(name, f"expected {'an integer' if integer else 'a number'}, got {json.dumps(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"must be in [{lo}, {hi}], got {v}")
    return int(v) if integer else float(v)


def _flag(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(name, f"expected true or false, got {json.dumps(v)}")
    return v


def _strings(body: dict, name: str) -> list[str] | None:
    v = body.get(name)
    if v is None:
        return None
    strings = [v] if isinstance(v, str) else v
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise bad(name, f"expected a string or a list of strings, got {json.dumps(v)}")
    return [s for s in strings if s] or None


def _string(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(name, f"expected a string, got {json.dumps(v)}")
    return v


def _read(body: dict, f: schema.Field):
    """The value of the OpenAI field that carries input `f`, typed by f's datatype (an integer
    within its range: what Triton could not convert is refused here, naming the field)."""
    if f.is_list:
        return _strings(body, f.openai)
    if f.dtype == "BYTES":
        return _string(body, f.openai)
    if f.dtype == "BOOL":
        return _flag(body, f.openai)
    lo, hi = schema.INT_RANGES.get(f.dtype, (None, None))
    return _number(body, f.openai, integer=f.dtype != "FP32", lo=lo, hi=hi)


def _message_text(i: int, msg) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad(where, "expected an object with role and content")
    extra = set(msg) - {"role", "content"}
    if extra:
        raise bad(f"{where}.{sorted(extra)[0]}", "not supported (tool calls and names are refused)")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise bad(f"{where}.role", f"one of {sorted(CHAT_ROLES)}, got {json.dumps(role)}")
    content = msg.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content", f"only text parts are supported, got {json.dumps(kind)}")
            parts.append(part["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise bad(f"{where}.content", f"expected a string or a list of text parts, got {json.dumps(content)}")
    return {"role": CHAT_ROLES[role], "content": content}


def _prompt(body: dict, chat: bool) -> str:
    """text_input: the completion's prompt, or the chat's messages as JSON (apply_chat_template)."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad("messages", "expected a non-empty list of messages")
        return json.dumps([_message_text(i, m) for i, m in enumerate(msgs)], ensure_ascii=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "expected one string (token-id prompts and batches of prompts are not supported)")
    return prompt


def _check_fields(body: dict, chat: bool) -> None:
    known = set(HONOURED) | set(EXTENSIONS) | set(METADATA) | set(REFUSED)
    for name in body:
        if name not in known or name == ("prompt" if chat else "messages"):
            raise bad(name, "unrecognized request argument")
    for name, neutral in REFUSED.items():
        if name in body and body[name] not in neutral:
            raise bad(name, f"not supported by this server (leave it out), got {json.dumps(body[name])}")
    n = _number(body, "n", integer=True)
    if n not in (None, 1):
        raise bad("n", f"only n=1 is supported, got {n}")


def _sampling(body: dict, fields: dict) -> None:
    for f in _CARRIED:
        if f.name not in _OWN_READS and (v := _read(body, f)) is not None:
            fields[f.name] = _VALUE.get(f.name, lambda x: x)(v)
    if _flag(body, "ignore_eos"):
        fields["end_id"] = -1


def parse(body, chat: bool, model_ids: tuple[str, ...] = (MODEL_ID,)) -> Call:
    """A request body -> the Triton call (raises ApiError naming the field)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, chat)
    model = body.get("model")
    if model not in model_ids:
        raise ApiError(400, f"model: unknown model {json.dumps(model)}; "
                       f"this server serves {list(model_ids)}", "model")
    fields = {"text_input": _prompt(body, chat), "apply_chat_template": chat, "stream": True,
              "temperature": 1.0}                        # OpenAI's default temperature
    _sampling(body, fields)
    mt_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, mt_field, integer=True, lo=1, hi=INT32_MAX)
    if max_tokens is None:                               # completions: OpenAI's 16; chat: the rest of the context
        max_tokens = triton_io.UP_TO_CONTEXT if chat else COMPLETION_DEFAULT_MAX_TOKENS
    fields["max_tokens"] = max_tokens
    stream = bool(_flag(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}):
        raise bad("stream_options", f"expected {{\"include_usage\": bool}}, got {json.dumps(opts)}")
    include_usage = bool(_flag(opts, "include_usage")) if opts else False
    return Call(chat, model, fields, stream, include_usage, mt_field)


def field_of(triton_input: str, call: Call) -> str:
    """The request field a Triton input came from (an error about it names this one)."""
    if triton_input in (triton_io.TEXT_INPUT, "apply_chat_template"):
        return "messages" if call.chat else "prompt"
    if triton_input == "max_tokens":
        return call.max_tokens_field
    return TRITON_TO_FIELD.get(triton_input, triton_input)


def triton_error(message: str, call: Call) -> ApiError:
    """A Triton error message -> the HTTP answer: a refused input 400 naming its field, overload
    503 with Retry-After, anything else 500 with the message."""
    code = triton_io.error_code(message)
    if code == "UNAVAILABLE":
        return ApiError(503, f"the server is busy: {message}", kind="server_busy", retry_after=1)
    if code == "INVALID_ARG":
        name, _, rest = message.partition(":")
        param = field_of(name.strip(), call)
        return ApiError(400, f"{param}:{rest}", param)
    return ApiError(500, f"internal error: {message}", kind="server_error")


# ---- responses ----

def usage(stats: dict) -> dict:
    """OpenAI's usage from the model's statistics (it counted the prompt, chat template included)."""
    prompt_tokens, completion = int(stats.get("prompt_token_count", 0)), int(stats.get("output_token_count", 0))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_prompt_tokens", 0))}}


def spec_stats(stats: dict) -> dict:
    """Our extension object: what speculation did for this request."""
    return {"drafted_tokens": int(stats.get("total_draft_tokens", 0)),
            "accepted_tokens": int(stats.get("total_accepted_draft_tokens", 0)),
            "acceptance_rate": round(float(stats.get("acceptance_rate", 0.0)), 6),
            "tokens_per_target_forward": round(float(stats.get("mean_accepted_tokens", 0.0)), 6)}


def finish_reason(stats: dict) -> str:
    return FINISH.get(str(stats.get("finish_reason", "")), "stop")


def _choice(call: Call, text: str | None, finish: str | None, first: bool = False) -> dict:
    if call.chat and call.stream:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if call.chat:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


def _head(call: Call, rid: str, created: int) -> dict:
    kind = "chat.completion" if call.chat else "text_completion"
    return {"id": rid, "object": kind + (".chunk" if call.chat and call.stream else ""), "created": created,
            "model": call.model}


def response(call: Call, rid: str, created: int, text: str, stats: dict) -> dict:
    """The whole answer of a non-streaming request."""
    return {**_head(call, rid, created), "choices": [_choice(call, text, finish_reason(stats))],
            "usage": usage(stats), "specdec": spec_stats(stats)}


def chunk(call: Call, rid: str, created: int, text: str | None, stats: dict | None = None,
          first: bool = False) -> dict:
    """One stream event; the one with `stats` carries the finish reason and our statistics."""
    out = {**_head(call, rid, created),
           "choices": [_choice(call, text, finish_reason(stats) if stats else None, first)]}
    if stats:
        out["specdec"] = spec_stats(stats)
    if call.include_usage:
        out["usage"] = None
    return out


def usage_chunk(call: Call, rid: str, created: int, stats: dict) -> dict:
    return {**_head(call, rid, created), "choices": [], "usage": usage(stats)}


def models_list(model_ids: tuple[str, ...], created: int) -> dict:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "specdec"}
                                       for m in model_ids]}
