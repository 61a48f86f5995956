"""The front door's reader of Triton's HTTP `generate_stream` (backend/serve/openai_triton), against a
stand-in that answers as Triton's HTTP door does (an SSE `data: {...}` line per response, a BYTES
output's raw bytes in its JSON string, errors as `{"error": ...}`): the request is the fields as
JSON, a character split between two responses is carried whole, the statistics come with the last
piece, a finished answer's connection is reused, each kind of failure is told apart, and leaving
the iterator early closes the connection (which is how Triton learns of a cancel)."""
from __future__ import annotations

import asyncio
import json

import pytest

from backend import triton_io
from backend.serve.launcher import free_port
from backend.serve.openai_triton import TritonFailure, TritonHTTP

pytest.importorskip("aiohttp")
STATS = {"output_token_count": 3, "total_draft_tokens": 4, "total_accepted_draft_tokens": 2,
         "acceptance_rate": 0.5, "mean_accepted_tokens": 1.5, "cached_prompt_tokens": 0, "prompt_token_count": 7}


def event(text: bytes, finish: str = "") -> bytes:
    """One response as Triton writes it: the text's bytes raw inside the JSON string."""
    head = json.dumps({"model_name": "specdec", "model_version": "1", **STATS, "finish_reason": finish})
    return b"data: " + head[:-1].encode() + b', "text_output": "' + text + b'"}\n\n'


def error(message: str) -> bytes:
    return b"data: " + json.dumps({"error": message}).encode() + b"\n\n"


class FakeTriton:
    """An aiohttp server at /v2/models/specdec/generate_stream playing one scripted answer per request."""

    def __init__(self):
        self.port = free_port()
        self.bodies: list[dict] = []
        self.peers: list[tuple] = []
        self.gone = asyncio.Event()
        self.answer = None

    async def handle(self, request):
        from aiohttp import web

        self.bodies.append(await request.json())
        self.peers.append(request.transport.get_extra_info("peername"))
        status, events, end = self.answer
        if events is None:                                   # Triton's own refusal, before the model
            return web.json_response({"error": "Request for unknown model: 'specdec' is not ready"}, status=status)
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            for e in events:
                await resp.write(e)
                await asyncio.sleep(0.01)
            if end == "hang":
                while True:
                    await resp.write(event(b"."))
                    await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            self.gone.set()
            raise
        if end == "eof":
            await resp.write_eof()
        return resp

    async def __aenter__(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v2/models/specdec/generate_stream", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


async def collect(triton: TritonHTTP, fields: dict):
    pieces = []
    async for p in triton.generate("specdec", fields):
        pieces.append(p)
    return pieces


def run(coro):
    return asyncio.run(coro)


def test_pieces_carry_a_split_character_and_the_connection_is_reused():
    fields = {"text_input": '[{"role": "user", "content": "h\u00e9"}]', "apply_chat_template": True, "stream": True,
              "temperature": 0.0, "random_seed": 2**64 - 1, "stop_words": ["a", "b"], "end_id": -1}
    cafe = " caf\u00e9".encode()

    async def main():
        async with FakeTriton() as fake:
            triton = TritonHTTP(f"127.0.0.1:{fake.port}")
            await triton.open()
            try:
                fake.answer = (200, [event(b"Hi,"), event(cafe[:-1]), event(cafe[-1:] + b' \\"ok\\"\\n', "length")],
                               "eof")
                first = await collect(triton, fields)
                await asyncio.sleep(0.1)                    # the tail is read in the background
                fake.answer = (200, [event(b"x", "stop")], "eof")
                second = await collect(triton, {"text_input": "x"})
            finally:
                await triton.close()
            return fake, first, second

    fake, first, second = run(main())
    assert fake.bodies == [fields, {"text_input": "x"}]
    assert [p.text for p in first] == ["Hi,", " caf", '\u00e9 "ok"\n']
    assert [p.stats for p in first[:-1]] == [None, None]
    assert first[-1].stats == {**STATS, "finish_reason": "length"} and set(first[-1].stats) == set(triton_io.STAT_OUTPUTS)
    assert second[-1].text == "x" and second[-1].stats["finish_reason"] == "stop"
    assert fake.peers[0] == fake.peers[1], "a finished answer's connection goes back to the pool"


async def failure(url: str) -> TritonFailure:
    """The TritonFailure one request to Triton at `url` raises."""
    triton = TritonHTTP(url)
    await triton.open()
    try:
        with pytest.raises(TritonFailure) as e:
            await collect(triton, {"text_input": "x"})
    finally:
        await triton.close()
    return e.value


@pytest.mark.parametrize("answer,unreachable,says", [
    ((503, [error("unavailable: 1 requests are waiting (max_queue_size 1)")], "eof"), False, "unavailable:"),
    ((200, [event(b"a"), error("boom")], "eof"), False, "boom"),
    ((503, None, None), True, "not ready"),
    ((200, [event(b"a")], "eof"), False, "without finishing"),
], ids=["the-models-503", "error-mid-stream", "tritons-503", "no-finish"])
def test_failures(answer, unreachable, says):
    async def main():
        async with FakeTriton() as fake:
            fake.answer = answer
            return await failure(f"127.0.0.1:{fake.port}")

    err = run(main())
    assert err.unreachable == unreachable and says in err.message, err.message


def test_unreachable():
    assert run(failure(f"127.0.0.1:{free_port()}")).unreachable


def test_leaving_early_closes_the_connection():
    async def main():
        async with FakeTriton() as fake:
            fake.answer = (200, [event(b"a")], "hang")
            triton = TritonHTTP(f"127.0.0.1:{fake.port}")
            await triton.open()
            try:
                pieces = triton.generate("specdec", {"text_input": "x"})
                assert (await anext(pieces)).text == "a"
                await pieces.aclose()
                await asyncio.wait_for(fake.gone.wait(), 10)
            finally:
                await triton.close()

    run(main())
