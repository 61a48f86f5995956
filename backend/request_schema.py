"""The request schema: every field a request can carry and every output a response carries, written once.

One line per field: its Triton name, datatype and shape, what an absent field means, its meaning,
and the doors that honour it: the Triton models `specdec`, `ensemble` (and its `preprocessing`
step, which takes the ensemble's inputs) and `generator`; the OpenAI front (the request field it
comes from, OpenAI's own or our extension); the Dynamo worker (where a Dynamo request carries it);
the draft node (the sampling parameters each draft call sends, which shape the draft's
distribution); and `specdec generate` (its flag). What reads it:
- the models' `config.pbtxt` inputs and outputs, and the ensemble's maps, are generated from it
  by the build (builder/templates.py);
- `triton_io` (REQUEST_INPUTS, STAT_OUTPUTS, the SamplingParams a request's tensors make),
  `triton_relay.FORWARDED`, `serve/client.py` (datatypes, flags), `serve/openai_protocol.py`
  (honoured and extension fields, typed reads), `serve/dynamo/protocol.py` (sampling options,
  annotations) and the draft node's parameters (`drafters/remote.py`, `draft_node.py`) are
  derived from it;
- docs/serving.md's input and output tables are checked against it (tests/test_request_schema.py).
A new sampling parameter is its meaning (config.SamplingParams and sampling.py), the device
sampler, and one line here.
Knows: names, datatypes, shapes, defaults, meanings, doors. Does not know: conversion, Triton,
HTTP.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from backend.config import SamplingParams

SPECDEC, ENSEMBLE, GENERATOR = "specdec", "ensemble", "generator"
SERVED = (SPECDEC, ENSEMBLE, GENERATOR)      # the Triton models clients call
PY_TYPES = {"BYTES": str, "BOOL": bool, "INT32": int, "UINT64": int, "FP32": float}
INT_RANGES = {"INT32": (-2**31, 2**31 - 1), "UINT64": (0, 2**64 - 1)}
_PARAM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


@dataclass(frozen=True)
class Field:
    name: str                          # the Triton tensor name (TensorRT-LLM's where it has one)
    dtype: str                         # Triton's datatype, without TYPE_
    meaning: str
    models: tuple[str, ...] = SERVED   # the Triton models that take it
    dims: tuple[int, ...] = (1,)       # per request, without the batch dimension
    default: str | None = None         # what an absent field means (None: SamplingParams' default)
    param: str | None = None           # the SamplingParams attribute it sets
    required_in: tuple[str, ...] = ()  # models where it is not optional
    openai: str | None = None          # the OpenAI request field it comes from
    extension: bool = False            # that field is ours (vLLM's name where vLLM has one), not OpenAI's
    dynamo: str | None = None          # where a Dynamo request carries it: "group.key"
    draft: bool = False                # sent with each draft node call
    flag: str | None = None            # `specdec generate`'s flag for it (the field as it is)

    @property
    def py_type(self) -> type:
        return PY_TYPES[self.dtype]

    @property
    def is_list(self) -> bool:
        return self.dims == (-1,)

    @property
    def default_text(self) -> str:
        if self.default is not None:
            return self.default
        v = _PARAM_DEFAULTS[self.param]
        return f"{v:g}" if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class Output:
    name: str
    dtype: str
    meaning: str
    models: tuple[str, ...] = SERVED
    dims: tuple[int, ...] = (1,)
    stat: bool = True                  # a statistic of the request, on every response


_SAMPLING = dict(models=SERVED, draft=True)
FIELDS: tuple[Field, ...] = (
    Field("text_input", "BYTES", "the prompt", default="required", required_in=(SPECDEC,)),
    Field("input_ids", "INT32", "the prompt as token ids (the ensemble's preprocessing sends them; a "
          "token-in client such as the Dynamo worker too)", models=(GENERATOR,), dims=(-1,),
          default="text_input", dynamo="token_ids"),
    Field("apply_chat_template", "BOOL", "render the model's chat template; `text_input` is one user message, "
          "or a JSON list of `{\"role\",\"content\"}` messages; refused (INVALID_ARG naming "
          "`apply_chat_template`) for a model without one (a base model), which takes plain text",
          default="false"),
    Field("max_tokens", "INT32", "new tokens, 1..max_seq_len; -1 = up to the engine's context",
          param="max_tokens", openai="max_tokens", dynamo="stop_conditions.max_tokens"),
    Field("temperature", "FP32", "0 = greedy", param="temperature", openai="temperature",
          dynamo="sampling_options.temperature", flag="--temperature", **_SAMPLING),
    Field("top_k", "INT32", "0 = off", param="top_k", openai="top_k", extension=True,
          dynamo="sampling_options.top_k", flag="--top-k", **_SAMPLING),
    Field("top_p", "FP32", "(0, 1]; 0 = off (TensorRT-LLM convention)", param="top_p", openai="top_p",
          dynamo="sampling_options.top_p", flag="--top-p", **_SAMPLING),
    Field("min_p", "FP32", "[0, 1): drop the tokens less likely than min_p times the most likely one",
          param="min_p", openai="min_p", extension=True, dynamo="sampling_options.min_p", flag="--min-p",
          **_SAMPLING),
    Field("random_seed", "UINT64", "the request's noise, keyed to each token's position in the sequence "
          "(prompt counted): same seed, same text, alone or among other streams, with any drafter and any "
          "draft budget (it equals plain sampling with that seed)", default="random", param="seed",
          openai="seed", dynamo="sampling_options.seed"),
    Field("stop_words", "BYTES", "stop strings (cut from the output); empty strings are ignored", dims=(-1,),
          default="none", param="stop_strings", openai="stop", dynamo="stop_conditions.stop"),
    Field("end_id", "INT32", "stop token replacing the model's EOS; -1 = never stop at EOS", default="model EOS",
          openai="ignore_eos", extension=True, dynamo="stop_conditions.ignore_eos"),
    Field("stream", "BOOL", "one response per step, or one response with all the text", default="false"),
    Field("num_draft_tokens", "INT32", "fixed draft budget for this request (0 = plain); chain length, or "
          "tree nodes for `eagle`", default="adaptive", openai="num_draft_tokens", extension=True,
          dynamo="annotations.num_draft_tokens", flag="--num-draft-tokens"),
    Field("drafter", "BYTES", "`none`, `prompt-lookup`, `suffix`, `draft-model`, `eagle`, `lookup+eagle`, "
          "`medusa` (where built), `auto`", default="auto", openai="drafter", extension=True,
          dynamo="annotations.drafter", flag="--drafter"),
    Field("stop", "BOOL", "stop the sequence named by `sequence_key` (the ensemble's and the relay's "
          "cancellation)", models=(GENERATOR,), default="false"),
    Field("sequence_key", "BYTES", "the sequence a `stop` request stops", models=(GENERATOR,), default="none"),
)

OUTPUTS: tuple[Output, ...] = (
    Output("output_ids", "INT32", "the output's token ids so far (cumulative)", models=(GENERATOR,), dims=(-1,),
           stat=False),
    Output("text_start", "INT32", "where this response's text starts in the whole output's text",
           models=(GENERATOR,), stat=False),
    Output("text_end", "INT32", "where it ends", models=(GENERATOR,), stat=False),
    Output("text_output", "BYTES", "the new text (incremental when streaming)", stat=False),
    Output("sequence_key", "BYTES", "the sequence's key (for a `stop` request)", models=(GENERATOR,), stat=False),
    Output("output_token_count", "INT32", "tokens generated so far"),
    Output("total_draft_tokens", "INT32", "draft tokens proposed"),
    Output("total_accepted_draft_tokens", "INT32", "draft tokens accepted"),
    Output("acceptance_rate", "FP32", "accepted / drafted"),
    Output("mean_accepted_tokens", "FP32", "tokens per target forward (E[tau])"),
    Output("finish_reason", "BYTES", "`stop`, `length` or `cancelled` on the last response; empty before"),
    Output("cached_prompt_tokens", "INT32", "prompt tokens the prefix cache gave this request instead of "
           "prefilling them; 0 on a miss"),
    Output("prompt_token_count", "INT32", "the prompt's tokens as the model counted them (chat template "
           "included)"),
)
BY_NAME = {f.name: f for f in FIELDS}
DRAFT = tuple(f for f in FIELDS if f.draft)      # what a draft node call carries, by SamplingParams name
PROMPT_FIELDS = ("text_input", "apply_chat_template")   # what the ensemble's preprocessing turns into input_ids


def inputs_of(model: str) -> tuple[Field, ...]:
    """The inputs of a Triton model; `preprocessing` takes the ensemble's (it validates them)."""
    model = ENSEMBLE if model == "preprocessing" else model
    return tuple(f for f in FIELDS if model in f.models)


def outputs_of(model: str) -> tuple[Output, ...]:
    return tuple(o for o in OUTPUTS if model in o.models)


def stat_outputs() -> tuple[str, ...]:
    return tuple(o.name for o in OUTPUTS if o.stat)
