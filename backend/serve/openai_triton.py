"""One request to a Triton model over Triton's HTTP `generate_stream`, as an async iterator of text pieces
(the front's, to `generator`) or of the model's responses (the Dynamo worker's).

The front door asks Triton for a streamed answer always (a non-streaming OpenAI request joins the
pieces, which is what the model's own non-streaming answer is), so every request can be cancelled
the same way: leaving the iterator before the answer is complete closes its connection, Triton
cancels the request, and the generator drops the sequence at its next step.
The request is the fields as JSON (Triton's generate extension makes each key that names an input
of the model that tensor); the answer is server-sent events, one `data: {...}` line per response,
the outputs as top-level keys. Triton writes a BYTES output into the JSON string as its raw bytes,
so a piece that ended inside a character would arrive as invalid UTF-8: the line is decoded with
`surrogateescape` and the text's bytes go through an incremental decoder, which carries an
incomplete character over to the next piece, so no piece ever ends inside a character.
The stream's end is the response whose `finish_reason` is set (the model's last text response);
errors arrive as `data: {"error": ...}` events, their code lost, so their message says what they
are (backend/triton_io.error_code); the first response's code sets the HTTP status (the
generator's UNAVAILABLE is a 503 with that event). An error is the model's whole answer, like the
last text response: neither is cut. The rest of a finished answer's body (the chunked stream's
end, sent when the model's final flag arrives) is read in the background, so its connection goes
back to the pool and no cancel reaches a request already complete (a cancel just after a refusal
left a relay thread alive until finalize, and Triton could not stop in time: perf-notes §27).
All of it runs in the front's event loop: no threads of its own (docs/perf-notes.md §27b).
Knows: aiohttp's client, Triton's generate_stream, the model's outputs. Does not know: OpenAI's shapes.
"""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from backend import triton_io

log = logging.getLogger("specdec.openai")
DATA = b"data: "
EVENT_LIMIT = 2**20          # aiohttp reads a line of up to twice its read buffer: 2 MiB an event
DRAIN_TIMEOUT_S = 30.0       # a finished answer's end of body follows with the model's final flag
CLOSE_WAIT_S = 5.0           # at the front's stop, for those ends still on their way


class TritonFailure(Exception):
    """The model answered with an error (`message` is Triton's), or Triton could not be reached
    (`unreachable`: refused or dropped connection, or Triton's 503 before the model answered,
    e.g. while the supervisor restarts it)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.message, self.unreachable = message, unreachable


@dataclass(frozen=True)
class Piece:
    text: str
    stats: dict | None       # the statistics outputs, on the last piece only (finish_reason set)


def _stats(event: dict) -> dict:
    return {k: event[k] for k in triton_io.STAT_OUTPUTS if k in event}


class TritonHTTP:
    """Triton's HTTP door at host:port: one aiohttp session (a pool of keep-alive connections) in
    the running event loop; `open` and `close` in that loop."""

    def __init__(self, url: str):
        self.url = url
        self.session = None
        self._tails: set[asyncio.Task] = set()

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),       # no cap: a connection per request in flight
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),  # answers take as long as they take
            read_bufsize=EVENT_LIMIT)

    async def close(self) -> None:
        """Let finished answers end (cutting one could still cancel it in Triton), then let go."""
        if self._tails:
            await asyncio.wait(list(self._tails), timeout=CLOSE_WAIT_S)
        for task in list(self._tails):
            task.cancel()
        await asyncio.gather(*self._tails, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def generate(self, model: str, fields: dict) -> AsyncIterator[Piece]:
        """Stream one request's text; raises TritonFailure. Closing the iterator early cancels the request."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        async with contextlib.aclosing(self.events(model, fields)) as events:   # closed with us: the cancel
            async for event in events:
                finished = bool(event.get("finish_reason"))
                raw = event.get(triton_io.TEXT_OUTPUT, "").encode("utf-8", "surrogateescape")
                yield Piece(decoder.decode(raw, final=finished), _stats(event) if finished else None)

    async def events(self, model: str, fields: dict) -> AsyncIterator[dict]:
        """Stream one request's responses as they came (the outputs by name; a BYTES output as
        the str of its raw bytes, `surrogateescape`), up to the one whose finish_reason is set;
        raises TritonFailure. Closing the iterator early cancels the request."""
        import aiohttp

        resp = None
        finished = False
        try:
            try:
                resp = await self.session.post(f"http://{self.url}/v2/models/{model}/generate_stream",
                                               data=json.dumps(fields),
                                               headers={"Content-Type": "application/json"})
            except aiohttp.ClientError as exc:
                raise TritonFailure(f"Triton HTTP: {type(exc).__name__}: {exc}", unreachable=True) from None
            if resp.content_type != "text/event-stream":
                raise await _refusal(resp)         # refused before the model saw it (finished: no body left)
            content = resp.content
            while True:
                try:
                    line = await content.readline()
                except aiohttp.ClientError as exc:
                    raise TritonFailure(f"Triton HTTP: {type(exc).__name__}: {exc}", unreachable=True) from None
                if not line:
                    raise TritonFailure("the model ended the stream without finishing the request")
                if not line.startswith(DATA):
                    continue                       # the blank line after each event
                event = json.loads(line[len(DATA):].decode("utf-8", "surrogateescape"))
                if "error" in event:
                    finished = True                # the model's answer, complete: read its end, not cut it
                    raise TritonFailure(str(event["error"]))
                finished = bool(event.get("finish_reason"))
                yield event
                if finished:
                    return
        finally:
            if resp is not None and not finished:
                resp.close()                       # the connection closes: Triton cancels the request
            elif resp is not None:
                self._finish(resp)

    def _finish(self, resp) -> None:
        """A complete answer: its connection back to the pool once its body has ended."""
        if resp.content.at_eof():
            resp.release()
            return
        task = asyncio.ensure_future(_drain(resp))
        self._tails.add(task)
        task.add_done_callback(self._tail_done)

    def _tail_done(self, task: asyncio.Task) -> None:
        self._tails.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("reading the end of a finished answer failed: %r", task.exception())


async def _drain(resp) -> None:
    """Read the rest of a finished answer's body: its connection goes back to the pool (or, cut
    short, is closed: the request is complete either way)."""
    import aiohttp

    try:
        await asyncio.wait_for(resp.read(), DRAIN_TIMEOUT_S)
    except (asyncio.TimeoutError, aiohttp.ClientError):
        pass
    finally:
        resp.release()                             # pooled when read to its end, closed otherwise


async def _refusal(resp) -> TritonFailure:
    """Triton's own answer before the model's (an application/json error object): a 503 is Triton
    not ready to serve the model (starting or restarting), anything else the message as it is."""
    body = await resp.read()
    try:
        message = str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:500] or resp.reason
    return TritonFailure(f"Triton HTTP {resp.status}: {message}", unreachable=resp.status == 503)
