"""The front door's gRPC messages, built and read as protobufs (backend/serve/openai_triton): the
request is byte for byte what tritonclient builds from the same fields, and a response reads as
tritonclient's InferResult reads it (the text's bytes, the statistics' values and types)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from backend import triton_io
from backend.serve import openai_triton as ot
from backend.serve.client import grpc_inputs

pytest.importorskip("tritonclient.grpc")


@pytest.mark.parametrize("fields", [
    {"text_input": 'h\u00e9llo ["x"]', "apply_chat_template": True, "stream": True, "max_tokens": 64,
     "temperature": 0.0, "top_p": 0.95, "random_seed": 2**63 + 5, "stop_words": ["a", "b\u00e9"], "top_k": 5,
     "min_p": 0.1, "end_id": -1, "drafter": "eagle", "num_draft_tokens": 3},
    {"text_input": "x", "stream": False}], ids=["every-field", "minimal"])
def test_request_is_tritonclients(fields):
    from tritonclient.grpc._utils import _get_inference_request

    theirs = _get_inference_request(model_name="specdec", inputs=grpc_inputs(fields), model_version="",
                                    request_id="openai-1", outputs=None, sequence_id=0, sequence_start=False,
                                    sequence_end=False, priority=0, timeout=None, parameters=None)
    assert ot.infer_request("specdec", fields, "openai-1").SerializeToString() == theirs.SerializeToString()


def _response(text: bytes, finish: bytes):
    from tritonclient.grpc import service_pb2 as pb

    r = pb.ModelInferResponse()

    def add(name, dtype, arr):
        o = r.outputs.add(name=name, datatype=dtype)
        o.shape.extend(arr.shape)
        r.raw_output_contents.append(b"".join(struct.pack("<I", len(x)) + x for x in arr.reshape(-1))
                                     if dtype == "BYTES" else arr.tobytes())

    add(triton_io.TEXT_OUTPUT, "BYTES", np.array([text], np.object_))
    for k in triton_io.STAT_OUTPUTS:
        if k == "finish_reason":
            add(k, "BYTES", np.array([finish], np.object_))
        elif k in ("acceptance_rate", "mean_accepted_tokens"):
            add(k, "FP32", np.array([0.3], np.float32))
        else:
            add(k, "INT32", np.array([7 + len(k)], np.int32))
    return r


@pytest.mark.parametrize("finish", [b"", b"length"])
def test_response_reads_as_infer_result(finish):
    from tritonclient.grpc import InferResult

    r = _response(" caf\u00e9".encode()[:-1], finish)       # a piece ending inside a character
    res = InferResult(r)

    def scalar(name):
        v = np.asarray(res.as_numpy(name)).reshape(-1)[0]
        return v.decode() if isinstance(v, bytes) else v.item()

    outputs = ot._outputs(r)
    assert ot._read(outputs, triton_io.TEXT_OUTPUT) == bytes(res.as_numpy(triton_io.TEXT_OUTPUT).reshape(-1)[0])
    assert ot._read(outputs, "finish_reason") == finish
    stats, expected = ot._stats(outputs), {k: scalar(k) for k in triton_io.STAT_OUTPUTS}
    assert stats == expected and [type(v) for v in stats.values()] == [type(v) for v in expected.values()]
