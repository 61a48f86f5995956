"""One request to the `specdec` Triton model over a gRPC stream, as an async iterator of text pieces.

The front door asks Triton for a streamed answer always (a non-streaming OpenAI request joins the
pieces, which is what the model's own non-streaming answer is), so every request can be cancelled
the same way: leaving the iterator cancels the gRPC call, Triton cancels the request, and the
`specdec` relay stops the generator's sequence at its next step. The text arrives as UTF-8 bytes
per response; an incremental decoder carries an incomplete character over to the next piece, so
no piece ever ends inside a character. The stream's end is the response whose `finish_reason` is
set (the relay's last text response; errors arrive as error responses, without a code, so their
message says what they are: backend/triton_io.error_code). An error response is the model's whole
answer: the stream is half-closed then, as after the last text response, not cancelled (a cancel
just after a refusal left a relay thread alive until finalize, and Triton could not stop in time).
The messages are built and read as Triton's protobufs directly, on a grpc.aio channel of our own:
tritonclient's wrappers (an InferInput per field, an InferResult per response searched output by
output) cost ~0.6 ms per request and ~0.13 ms per streamed piece, on the cores the engine decodes
on (docs/perf-notes.md §27). Each piece's text and finish flag are read; the statistics only on
the last piece.
Knows: grpc.aio, Triton's gRPC protobufs, the model's outputs. Does not know: HTTP, OpenAI's shapes.
"""
from __future__ import annotations

import codecs
import itertools
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from backend import triton_io
from backend.serve.client import _DTYPES, _NP

_ids = itertools.count()
_NUMERIC = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}


class TritonFailure(Exception):
    """The model answered with an error (`message` is Triton's), or Triton could not be reached
    (`unreachable`: gRPC UNAVAILABLE, e.g. the supervisor is restarting it)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.message, self.unreachable = message, unreachable


@dataclass(frozen=True)
class Piece:
    text: str
    stats: dict | None       # the statistics outputs, on the last piece only (finish_reason set)


def connect(url: str):
    """-> (channel, stub) for Triton's gRPC service at host:port (tritonclient's channel options)."""
    import grpc
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions, service_pb2_grpc

    ka = KeepAliveOptions()
    channel = grpc.aio.insecure_channel(url, options=[
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", ka.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", ka.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", ka.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", ka.http2_max_pings_without_data)])
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _bytes_tensor(vals: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in vals)


def infer_request(model: str, fields: dict, request_id: str):
    """The ModelInferRequest that tritonclient builds from backend/serve/client.grpc_inputs(fields):
    each field a [1, n] tensor of its declared type, its bytes in raw_input_contents."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model, id=request_id)
    for name, value in fields.items():
        dtype = _DTYPES[name]
        vals = value if isinstance(value, list) else [value]
        tensor = req.inputs.add(name=name, datatype=dtype)
        tensor.shape.extend((1, len(vals)))
        if dtype == "BYTES":
            req.raw_input_contents.append(_bytes_tensor([str(v).encode() for v in vals]))
        else:
            req.raw_input_contents.append(np.array(vals, dtype=_NP[dtype]).tobytes())
    return req


def _value(datatype: str, raw: bytes):
    """The first element of one raw output tensor as a Python value (bytes for BYTES)."""
    if datatype == "BYTES":
        (n,) = struct.unpack_from("<I", raw)
        return raw[4:4 + n]
    return np.frombuffer(raw, dtype=_NUMERIC[datatype], count=1)[0].item()


def _outputs(response) -> dict:
    """name -> (datatype, raw bytes) of a ModelInferResponse (Triton's gRPC sends raw contents)."""
    raw = response.raw_output_contents
    if len(raw) < len(response.outputs):         # never from Triton; read as tritonclient would
        from tritonclient.grpc import InferResult

        result = InferResult(response)
        return {o.name: ("NUMPY", result.as_numpy(o.name)) for o in response.outputs}
    return {o.name: (o.datatype, raw[i]) for i, o in enumerate(response.outputs)}


def _read(outputs: dict, name: str):
    datatype, raw = outputs.get(name, (None, None))
    if datatype is None:
        return None
    if datatype == "NUMPY":
        v = np.asarray(raw).reshape(-1)[0]
        return v if isinstance(v, bytes) else v.item()
    return _value(datatype, raw)


def _stats(outputs: dict) -> dict:
    stats = {k: _read(outputs, k) for k in triton_io.STAT_OUTPUTS if k in outputs}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in stats.items()}


async def generate(stub, model: str, fields: dict) -> AsyncIterator[Piece]:
    """Stream one request; raises TritonFailure. Closing the iterator early cancels the request."""
    import grpc

    call = stub.ModelStreamInfer()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    finished = False
    try:
        # the stream stays open (no half-close) until the answer is complete
        await call.write(infer_request(model, fields, f"openai-{next(_ids)}"))
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise TritonFailure("the model ended the stream without finishing the request")
            if response.error_message:
                finished = True             # the model's answer, complete: end the stream, not cancel it
                raise TritonFailure(response.error_message)
            outputs = _outputs(response.infer_response)
            finished = bool(_read(outputs, "finish_reason"))
            raw = _read(outputs, triton_io.TEXT_OUTPUT)
            text = decoder.decode(raw if raw is not None else b"", final=finished)
            yield Piece(text, _stats(outputs) if finished else None)
            if finished:
                return
    except grpc.RpcError as exc:            # grpc.aio raises these (AioRpcError) on write and read
        raise TritonFailure(f"Triton gRPC: {exc.details()}", exc.code() == grpc.StatusCode.UNAVAILABLE) from None
    finally:
        if finished:
            await _half_close(call)
        else:
            call.cancel()


async def _half_close(call) -> None:
    """End our side of a finished stream (Triton then closes it with OK)."""
    import grpc

    try:
        await call.done_writing()
    except (grpc.RpcError, RuntimeError):    # already ended (cancelled, or the server closed it)
        pass
