"""One request to the `specdec` Triton model over a gRPC stream, as an async iterator of text pieces.

The front door asks Triton for a streamed answer always (a non-streaming OpenAI request joins the
pieces, which is what the model's own non-streaming answer is), so every request can be cancelled
the same way: leaving the iterator cancels the gRPC call, Triton cancels the request, and the
`specdec` relay stops the generator's sequence at its next step. The text arrives as UTF-8 bytes
per response; an incremental decoder carries an incomplete character over to the next piece, so
no piece ever ends inside a character. The stream's end is the response whose `finish_reason` is
set (the relay's last text response; errors arrive as error responses, without a code, so their
message says what they are: backend/triton_io.error_code).
Knows: tritonclient's asyncio gRPC API, the model's outputs. Does not know: HTTP, OpenAI's shapes.
"""
from __future__ import annotations

import asyncio
import codecs
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from backend import triton_io
from backend.serve.client import grpc_inputs

_ids = itertools.count()


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


def _scalar(v):
    v = np.asarray(v).reshape(-1)[0]
    return v.decode() if isinstance(v, bytes) else v.item()


def _stats(result) -> dict:
    return {k: _scalar(result.as_numpy(k)) for k in triton_io.STAT_OUTPUTS if result.as_numpy(k) is not None}


async def generate(client, model: str, fields: dict) -> AsyncIterator[Piece]:
    """Stream one request; raises TritonFailure. Closing the iterator early cancels the request."""
    import grpc
    from tritonclient.utils import InferenceServerException

    done = asyncio.Event()

    async def requests():
        yield {"model_name": model, "inputs": grpc_inputs(fields), "request_id": f"openai-{next(_ids)}",
               "outputs": None}
        await done.wait()                   # keep the stream open until the answer is complete

    responses = client.stream_infer(requests())
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    finished = False
    try:
        async for result, error in responses:
            if error is not None:
                raise TritonFailure(str(error.message()))
            stats = _stats(result)
            finished = bool(stats.get("finish_reason"))
            raw = result.as_numpy(triton_io.TEXT_OUTPUT)
            text = decoder.decode(bytes(np.asarray(raw).reshape(-1)[0]) if raw is not None else b"", final=finished)
            yield Piece(text, stats if finished else None)
            if finished:
                return
        raise TritonFailure("the model ended the stream without finishing the request")
    except grpc.RpcError as exc:            # grpc.aio raises these while iterating
        raise TritonFailure(f"Triton gRPC: {exc.details()}", exc.code() == grpc.StatusCode.UNAVAILABLE) from None
    except InferenceServerException as exc:
        status = str(exc.status() or "")
        raise TritonFailure(exc.message() or str(exc), unreachable="UNAVAILABLE" in status) from None
    finally:
        done.set()
        if not finished:
            responses.cancel()
