"""A Dynamo request for a token-in engine -> the `generator` model's inputs, and its responses ->
Dynamo's response chunks.

Dynamo's frontend tokenizes (with the node's own tokenizer and chat template: card.py), and sends
the engine `token_ids`, `sampling_options` (temperature, top_p, top_k, min_p, seed, ...),
`stop_conditions` (max_tokens, ignore_eos; stop strings it checks itself) and `annotations`, the
strings a client sends in `nvext.annotations`: ours are `drafter:<kind>` and
`num_draft_tokens:<k>` (a request with unknown top-level fields is refused by the frontend, so
that is where extensions travel). What the generator cannot honour (penalties, n > 1, beam
search, log probabilities, guided decoding, extra stop token ids) is refused with the field
named, never ignored. A request the frontend migrated arrives with the tokens produced so far
appended to its prompt and max_tokens lowered by as many: nothing to do here, since the noise is
keyed to the sequence position (backend/sampling.py).
Knows: both protocols' field names. Does not know: HTTP, Dynamo's runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from backend import triton_io

OPENAI_DEFAULT_TEMPERATURE = 1.0      # what our own OpenAI door assumes when a client sends none
# sampling option -> the values that mean "not used" (anything else is refused, named)
NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "repetition_penalty": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1),
           "guided_decoding": (None,), "include_stop_str_in_output": (None, False)}
OUTPUT_NEUTRAL = {"logprobs": (None, 0), "prompt_logprobs": (None, 0)}
STOP_NEUTRAL = {"min_tokens": (None, 0), "stop_token_ids": (None, [])}
ANNOTATIONS = {"drafter": str, "num_draft_tokens": int}
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
        try:
            out[key] = ANNOTATIONS[key](value.strip())
        except ValueError:
            raise Refused(f"nvext.annotations: {key} expects {ANNOTATIONS[key].__name__}, got {value!r}") from None
    return out


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
    fields = {triton_io.INPUT_IDS: [int(t) for t in ids], "stream": True,
              "temperature": OPENAI_DEFAULT_TEMPERATURE if sampling.get("temperature") is None
              else float(sampling["temperature"])}
    for name in ("top_p", "min_p"):
        if sampling.get(name) is not None:
            fields[name] = float(sampling[name])
    if sampling.get("top_k") is not None:
        fields["top_k"] = max(0, int(sampling["top_k"]))            # vLLM's -1: off
    if sampling.get("seed") is not None:
        fields["random_seed"] = int(sampling["seed"])
    if stops.get("max_tokens") is not None:
        fields["max_tokens"] = int(stops["max_tokens"])
    if stops.get("stop"):
        fields["stop_words"] = [str(s) for s in stops["stop"]]
    if stops.get("ignore_eos"):
        fields["end_id"] = -1
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
