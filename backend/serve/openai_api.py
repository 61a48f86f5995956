"""The OpenAI-compatible front door of `specdec serve`: /v1/models, /v1/completions, /v1/chat/completions.

An aiohttp app that turns each request into one streamed request to the `generator` Triton model
(the one that holds the engines and takes text) on Triton's HTTP `generate_stream`, read with
aiohttp's client in the same event loop (openai_triton), so it holds no engine, no tokenizer and
reads no engine directory: the model counts the prompt (`prompt_token_count`, with the cached
tokens, on every response) and takes max_tokens = -1 as "up to the context", so a request is sent
as soon as it is parsed. (Triton's own clients call `specdec`, a relay to the same generator that
answers with text and statistics only; this door needs no such hop.)
A streamed answer waits for the model's first response before it sends its headers, so a refused
input is an HTTP 400 there too; later errors arrive as an SSE `error` event. A client that goes
away cancels its handler (aiohttp's handler_cancellation), which closes the Triton request's
connection: the request is cancelled and the generator frees its slot.
Knows: HTTP, SSE, the server's lifetime in a thread of its own. Does not know: decoding, tokens.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

from backend.errors import UserError
from backend.request_schema import GENERATOR
from backend.serve import openai_protocol as proto
from backend.serve.openai_protocol import ApiError, Call
from backend.serve.openai_triton import Piece, TritonFailure, TritonHTTP

log = logging.getLogger("specdec.openai")
TRITON_MODEL = GENERATOR
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(err: ApiError):
    from aiohttp import web

    headers = {"Retry-After": str(err.retry_after)} if err.retry_after else None
    return web.json_response(err.body(), status=err.status, headers=headers)


def sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _errors(request, handler):
    """Every failure as OpenAI's error object: ours as raised, an unknown path or method with its
    status, anything else logged with its traceback and answered 500 (the server keeps serving)."""
    from aiohttp import web

    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}"))
    except Exception as exc:                   # noqa: BLE001 - the third tier: log, 500, keep serving
        log.exception("%s %s failed", request.method, request.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))


class Front:
    """The request handlers before Triton's HTTP door (host:port)."""

    def __init__(self, triton_url: str, model_ids: tuple[str, ...] = (proto.MODEL_ID,)):
        self.triton = TritonHTTP(triton_url)
        self.model_ids = model_ids
        self.created = int(time.time())

    def app(self):
        from aiohttp import web

        app = web.Application(middlewares=[web.middleware(_errors)], client_max_size=16 * 2**20)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._connect)
        app.on_cleanup.append(self._disconnect)
        return app

    async def _connect(self, app) -> None:
        await self.triton.open()

    async def _disconnect(self, app) -> None:
        await self.triton.close()

    async def models(self, request):
        from aiohttp import web

        return web.json_response(proto.models_list(self.model_ids, self.created))

    async def completions(self, request):
        return await self.serve(request, chat=False)

    async def chat_completions(self, request):
        return await self.serve(request, chat=True)

    async def serve(self, request, chat: bool):
        from aiohttp import web

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        call = proto.parse(body, chat, self.model_ids)
        pieces = self.triton.generate(TRITON_MODEL, call.fields)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        try:
            piece = await self._next(pieces, call)
            if call.stream:
                return await self._stream(request, call, pieces, piece, rid, created)
            parts = [piece.text]
            while piece.stats is None:
                piece = await self._next(pieces, call)
                parts.append(piece.text)
            return web.json_response(proto.response(call, rid, created, "".join(parts), piece.stats))
        finally:
            await pieces.aclose()                  # an unfinished request is cancelled in Triton

    @staticmethod
    async def _next(pieces, call: Call) -> Piece:
        try:
            return await anext(pieces)
        except TritonFailure as f:
            if f.unreachable:
                raise ApiError(503, f"the model server is not reachable (starting or restarting): {f.message}",
                               kind="server_unavailable", retry_after=2) from None
            raise proto.triton_error(f.message, call) from None

    async def _stream(self, request, call: Call, pieces, piece: Piece, rid: str, created: int):
        from aiohttp import web

        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        first = call.chat                         # a chat's first chunk names the role
        try:
            while True:
                text = sse(proto.chunk(call, rid, created, piece.text, first=first)) if piece.text or first else b""
                first = False
                if piece.stats is not None:
                    break
                if text:
                    await resp.write(text)
                piece = await self._next(pieces, call)
            # the answer's end in one write (one send, not five: each costs ~0.1 ms of the cores the
            # engine decodes on, perf-notes §27b): its last text, the finish, the usage, [DONE], the EOF
            end = [text, sse(proto.chunk(call, rid, created, None, piece.stats))]
            if call.include_usage:
                end.append(sse(proto.usage_chunk(call, rid, created, piece.stats)))
            end.append(sse("[DONE]"))
        except ApiError as err:                    # headers are gone: the error is an event
            end = [sse(err.body())]
        except ConnectionError:                    # the client left: the caller cancels the request
            return resp
        await resp.write_eof(b"".join(end))
        return resp


class OpenAIServer:
    """The front door's HTTP server on an event loop in a thread of its own (start / stop)."""

    def __init__(self, front: Front, port: int, host: str = "127.0.0.1"):
        self.front, self.host, self.port = front, host, port
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def _start(self) -> None:
        from aiohttp import web

        self._runner = web.AppRunner(self.front.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    def start(self) -> "OpenAIServer":
        started: dict = {}
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            try:
                self.loop.run_until_complete(self._start())
            except Exception as exc:                # noqa: BLE001 - reported by start()
                started["error"] = exc
                ready.set()
                return
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self._runner.cleanup())
            self.loop.close()

        self._thread = threading.Thread(target=run, name="openai-front", daemon=True)
        self._thread.start()
        ready.wait(60)
        if "error" in started:
            raise UserError(f"the OpenAI front door cannot listen on {self.host}:{self.port}: {started['error']} "
                            "(choose another --openai-port, or --no-openai)")
        return self

    def stop(self) -> None:
        if self.loop is not None and self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
