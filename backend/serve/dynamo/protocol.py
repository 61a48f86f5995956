"""A Dynamo request for a token-in engine -> the `generator` model's inputs, and its responses ->
Dynamo's response chunks.

Dynamo's frontend tokenizes (with the node's own tokenizer and chat template: card.py), and sends
the engine `token_ids`, `sampling_options` (temperature, top_p, top_k, seed, ...),
`stop_conditions` (max_tokens, ignore_eos; stop strings it checks itself) and `annotations`, the
strings a client sends in `nvext.annotations`: ours are `drafter:<kind>` and
`num_draft_tokens:<k>` (a request with unknown top-level fields is refused by the frontend, so
that is where extensions travel). Which of them carries which of the generator's inputs is the
request schema's `dynamo` column (backend/request_schema.py). What the generator cannot honour (penalties, n > 1, beam
search, log probabilities, guided decoding, extra stop token ids) is refused with the field
named, never ignored. A request the frontend migrated arrives with the tokens produced so far
appended to its prompt and max_tokens lowered by as many: nothing to do here, since the noise is
keyed to the sequence position (backend/sampling.py).
Knows: both protocols' field names. Does not know: HTTP, Dynamo's runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from backend import request_schema, triton_io

OPENAI_DEFAULT_TEMPERATURE = 1.0      # what our own OpenAI door assumes when a client sends none
# sampling option -> the values that mean "not used" (anything else is refused, named)
NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "repetition_penalty": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1),
           "guided_decoding": (None,), "include_stop_str_in_output": (None, False)}
OUTPUT_NEUTRAL = {"logprobs": (None, 0), "prompt_logprobs": (None, 0)}
STOP_NEUTRAL = {"min_tokens": (None, 0), "stop_token_ids": (None, [])}
# where a Dynamo request carries each of the generator's inputs (the request schema's `dynamo` column)
_CARRIED = tuple(f for f in request_schema.FIELDS if f.dynamo)
ANNOTATIONS = {f.dynamo.split(".", 1)[1]: f for f in _CARRIED if f.dynamo.startswith("annotations.")}
_OPTIONS = tuple(f for f in _CARRIED if f.dynamo.startswith(("sampling_options.", "stop_conditions.")))
_VALUE = {"top_k": lambda v: max(0, int(v)),                      # vLLM's -1: off
          "end_id": lambda ignore_eos: -1 if ignore_eos else None}  # ignore_eos: never stop at EOS
FINISH = {"stop": "stop", "length": "length", "cancelled": "cancelled"}


class Refused(ValueError):
    """A request field the node cannot honour: `field: why` (Dynamo's InvalidArgument, a 400)."""


def _refuse_unless_neutral(group: dict, neutral: dict, prefix: str) -> None:
    for name, values in neutral.items():
        if group.get(name) not in values:
            raise Refused(f"{prefix}{name}: not supported by specdec (leave it out), got {group.get(name)!r}")


def annotations(values) -> dict:
    """Our extensions among `nvext.annotations` ("key:value" strings; others are not ours)."""
    out = {}
    for item in values or ():
        key, sep, value = str(item).partition(":")
        if not sep or key not in ANNOTATIONS:
            continue
        f = ANNOTATIONS[key]
        try:
            out[f.name] = f.py_type(value.strip())
        except ValueError:
            raise Refused(f"nvext.annotations: {key} expects {f.py_type.__name__}, got {value!r}") from None
    return out


def _option(request: dict, f: request_schema.Field):
    """The value a Dynamo request gives input `f` (None: absent), typed by f's datatype."""
    group, key = f.dynamo.split(".", 1)
    v = (request.get(group) or {}).get(key)
    if v is None or (f.is_list and not v):
        return None
    if f.name in _VALUE:
        return _VALUE[f.name](v)
    return [str(x) for x in v] if f.is_list else f.py_type(v)


def generator_fields(request: dict) -> dict:
    """The generator's inputs (Triton's JSON generate request) for one Dynamo request."""
    ids = request.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise Refused("token_ids: an empty prompt")
    sampling = request.get("sampling_options") or {}
    stops = request.get("stop_conditions") or {}
    _refuse_unless_neutral(sampling, NEUTRAL, "")
    _refuse_unless_neutral(request.get("output_options") or {}, OUTPUT_NEUTRAL, "")
    _refuse_unless_neutral(stops, STOP_NEUTRAL, "")
    fields = {triton_io.INPUT_IDS: [int(t) for t in ids], "stream": True, "temperature": OPENAI_DEFAULT_TEMPERATURE}
    fields.update((f.name, v) for f in _OPTIONS if (v := _option(request, f)) is not None)
    fields.update(annotations(request.get("annotations")))
    return fields


@dataclass
class Stream:
    """The generator's responses of one request -> Dynamo chunks (new token ids, then the last one
    with its finish reason and usage)."""

    prompt_tokens: int
    sent: int = 0
    stats: dict = field(default_factory=dict)

    def chunk(self, event: dict) -> dict:
        ids = event.get(triton_io.OUTPUT_IDS, [])
        ids = [ids] if isinstance(ids, int) else ids       # Triton's JSON writes a 1-element tensor bare
        out = {"token_ids": [int(t) for t in ids[self.sent:]], "index": 0}
        self.sent = max(self.sent, len(ids))
        reason = event.get("finish_reason") or ""
        if reason:
            self.stats = {k: event[k] for k in triton_io.STAT_OUTPUTS if k in event}
            completion = int(event.get("output_token_count", self.sent))
            out["finish_reason"] = FINISH.get(reason, "stop")
            out["completion_usage"] = {
                "prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": int(event.get("cached_prompt_tokens", 0))}}
        return out
