"""The OpenAI-compatible front door of `specdec serve`: /v1/models, /v1/completions, /v1/chat/completions.

An aiohttp app that turns each request into one streamed request to the `specdec` Triton model on
Triton's HTTP `generate_stream`, read with aiohttp's client in the same event loop (openai_triton),
so it holds no engine: only the tokenizer, to count the prompt's tokens for `usage` exactly as the
model counts them (backend/triton_io.prompt_ids, chat template included), once the model has
answered (a streamed request without `include_usage` never counts).
A streamed answer waits for the model's first response before it sends its headers, so a refused
input is an HTTP 400 there too; later errors arrive as an SSE `error` event. A client that goes
away cancels its handler (aiohttp's handler_cancellation), which closes the Triton request's
connection: the request is cancelled and the generator frees its slot.
Knows: HTTP, SSE, the server's lifetime in a thread of its own. Does not know: decoding.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from backend import triton_io
from backend.config import RequestError
from backend.errors import UserError
from backend.serve import openai_protocol as proto
from backend.serve.openai_protocol import ApiError, Call
from backend.serve.openai_triton import Piece, TritonFailure, TritonHTTP

log = logging.getLogger("specdec.openai")
TRITON_MODEL = "specdec"
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


def _drop(task: asyncio.Future | None) -> None:
    """Let go of a count no longer wanted (cancelled, or its result or refusal read)."""
    if task is not None and not task.cancel() and not task.cancelled():
        task.exception()


class Front:
    """The request handlers: Triton's HTTP door (host:port), the tokenizer, the engine's context length."""

    def __init__(self, triton_url: str, tokenizer, max_seq_len: int, model_ids: tuple[str, ...] = (proto.MODEL_ID,)):
        self.triton = TritonHTTP(triton_url)
        self.tok, self.max_seq_len, self.model_ids = tokenizer, max_seq_len, model_ids
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

    def count_prompt(self, call: Call) -> int:
        """The prompt's tokens as the model counts them (its refusals of the prompt name the field)."""
        inputs = {triton_io.TEXT_INPUT: np.array([call.fields["text_input"].encode()], np.object_),
                  "apply_chat_template": np.array([call.chat])}
        try:
            return len(triton_io.prompt_ids(inputs, self.tok))
        except RequestError as exc:
            param = proto.field_of(exc.field, call)
            raise ApiError(400, f"{param}: {str(exc).split(': ', 1)[-1]}", param) from None

    async def serve(self, request, chat: bool):
        from aiohttp import web

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        call = proto.parse(body, chat, self.model_ids)
        fields = dict(call.fields)
        counting = None
        if "max_tokens" not in fields:             # up to the engine's context (vLLM's default)
            counting = self._count(call)
            fields["max_tokens"] = max(1, self.max_seq_len - await counting)
        pieces = self.triton.generate(TRITON_MODEL, fields)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        try:
            piece = await self._next(pieces, call)
            if call.stream:
                return await self._stream(request, call, pieces, piece, rid, created, counting)
            if counting is None:
                counting = self._count(call)
            parts = [piece.text]
            while piece.stats is None:
                piece = await self._next(pieces, call)
                parts.append(piece.text)
            return web.json_response(proto.response(call, rid, created, "".join(parts), piece.stats,
                                                    await counting))
        finally:
            _drop(counting)
            await pieces.aclose()                  # an unfinished request is cancelled in Triton

    def _count(self, call: Call) -> asyncio.Future:
        """The prompt's token count for `usage`, in a worker thread. Started once the model has
        accepted the request and answered (after the first chunk of a stream), so its ~1.5 ms of
        tokenizing stays off the time to first token; a prompt the model refuses is refused in
        the model's words (the same check, triton_io.prompt_ids, named for this door)."""
        return asyncio.ensure_future(asyncio.to_thread(self.count_prompt, call))

    @staticmethod
    async def _next(pieces, call: Call) -> Piece:
        try:
            return await anext(pieces)
        except TritonFailure as f:
            if f.unreachable:
                raise ApiError(503, f"the model server is not reachable (starting or restarting): {f.message}",
                               kind="server_unavailable", retry_after=2) from None
            raise proto.triton_error(f.message, call) from None

    async def _stream(self, request, call: Call, pieces, piece: Piece, rid: str, created: int,
                      counting: asyncio.Future | None):
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
                if call.include_usage and counting is None:
                    counting = self._count(call)   # after the first chunk: off the time to first token
                piece = await self._next(pieces, call)
            # the answer's end in one write (one send, not five: each costs ~0.1 ms of the cores the
            # engine decodes on, perf-notes §27b): its last text, the finish, the usage, [DONE], the EOF
            end = [text, sse(proto.chunk(call, rid, created, None, piece.stats))]
            if call.include_usage:
                if counting is None:
                    counting = self._count(call)
                end.append(sse(proto.usage_chunk(call, rid, created, piece.stats, await counting)))
            end.append(sse("[DONE]"))
        except ApiError as err:                    # headers are gone: the error is an event
            end = [sse(err.body())]
        except ConnectionError:                    # the client left: the caller cancels the request
            return resp
        finally:
            _drop(counting)
        await resp.write_eof(b"".join(end))
        return resp


def front_for(engine_dir: str | Path, triton_http_url: str) -> Front:
    """The front door for the engines a repository serves (their tokenizer and context length),
    before the Triton whose HTTP door is at host:port."""
    from backend.manifest import EngineManifest
    from backend.tokenizer import Tokenizer

    manifest = EngineManifest.load(engine_dir)
    return Front(triton_http_url, Tokenizer.from_manifest(manifest), manifest.max_seq_len)


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
