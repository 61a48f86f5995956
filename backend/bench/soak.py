"""The load a deployment sees every minute, as a soak: streams over HTTP `generate_stream`, many
at a time, the drafter cycling `auto`, `prompt-lookup`, `eagle`, `none`, greedy and seeded
sampling alternating (each drafter gets both), and every third client closing its connection
after its third streamed event; given the OpenAI front's URL, every other request goes through
its /v1/chat/completions instead (backend/serve/openai_api.py, the same mix); given the URL of
NVIDIA Dynamo's frontend in front of the server (docs/scale-out.md), every fourth request goes
there (the drafter in `nvext.annotations`). It counts what a user would: every request that was
not cut by its client must end with a finish reason, never an error or silence.

Used by the fault suite (tests/test_faults_soak.py) and by hand against any running server:
  python -m backend.bench.soak --url 127.0.0.1:8000 --model specdec --requests 240 --concurrency 12
Knows: HTTP, the request fields. Does not know: the server's insides.
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

DRAFTERS = ("auto", "prompt-lookup", "eagle", "none")
PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "public.jsonl"


@dataclass
class SoakResult:
    completed: int = 0                  # ended with a finish reason
    disconnected: int = 0               # cut by their client, as planned
    failed: list[str] = field(default_factory=list)   # what went wrong, one line each
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"completed": self.completed, "disconnected": self.disconnected,
                "failed": len(self.failed), "failures": self.failed[:10], "seconds": round(self.seconds, 1)}


def request_body(i: int, messages: list[dict], max_tokens: int) -> dict:
    """Request i of the mix: drafter i % 4, temperature 0.7 on every other group of four, a seed."""
    body = {"text_input": json.dumps(messages), "apply_chat_template": True, "max_tokens": max_tokens,
            "drafter": DRAFTERS[i % len(DRAFTERS)], "stream": True, "random_seed": 1000 + i}
    if (i // len(DRAFTERS)) % 2:
        body["temperature"] = 0.7
    return body


def openai_body(i: int, messages: list[dict], max_tokens: int) -> dict:
    """Request i of the mix for the OpenAI door: the same drafter, temperature and seed."""
    t = request_body(i, messages, max_tokens)
    return {"model": "specdec", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": t.get("temperature", 0.0), "seed": t["random_seed"], "drafter": t["drafter"]}


def dynamo_body(i: int, messages: list[dict], max_tokens: int) -> dict:
    """Request i of the mix for Dynamo's frontend: our extensions travel as nvext annotations."""
    body = openai_body(i, messages, max_tokens)
    body["nvext"] = {"annotations": [f"drafter:{body.pop('drafter')}"]}
    return body


def _finish(event: dict) -> str:
    """An event's finish reason, Triton's (top level) or OpenAI's (its choice's)."""
    if "choices" in event:
        return (event["choices"][0].get("finish_reason") or "") if event["choices"] else ""
    return event.get("finish_reason") or ""


def one_request(url: str, path: str, body: dict, cut_after: int | None, timeout_s: float) -> str | None:
    """Stream one request to `path` (Triton's generate_stream or OpenAI's chat completions: both
    server-sent events); cut the connection after `cut_after` events if given.
    -> None when it finished (or was cut as planned), else what went wrong."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return f"HTTP {resp.status}: {resp.read()[:200]!r}"
        events, finish = 0, ""
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data:"):
                continue
            if line[5:].strip() == b"[DONE]":
                break
            event = json.loads(line[5:])
            if "error" in event:
                return f"error after {events} events: {event['error']}"
            events += 1
            finish = _finish(event) or finish
            if cut_after is not None and events >= cut_after:
                conn.sock.shutdown(socket.SHUT_RDWR)          # the client goes away mid-stream
                return None
        return None if finish else f"stream ended after {events} events without a finish reason"
    except Exception as exc:                                  # reset, refused, timeout
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def run(url: str, model: str, requests: int = 240, concurrency: int = 12, max_tokens: int = 48,
        cut_every: int = 3, cut_after: int = 3, prompts_path: Path = PROMPTS,
        timeout_s: float = 300.0, openai_url: str | None = None, dynamo_url: str | None = None) -> SoakResult:
    """The soak against Triton's HTTP door at `url` (model `model`); with openai_url, every other
    request (the odd ones) through the OpenAI front there instead; with dynamo_url, every fourth
    (i % 4 == 3) through Dynamo's frontend there."""
    prompts = [json.loads(line)["messages"] for line in prompts_path.read_text().splitlines() if line.strip()]
    result, lock = SoakResult(), threading.Lock()

    def go(i: int) -> None:
        cut = cut_after if cut_every and i % cut_every == cut_every - 1 else None
        messages = prompts[i % len(prompts)]
        if dynamo_url and i % 4 == 3:
            err = one_request(dynamo_url, "/v1/chat/completions", dynamo_body(i, messages, max_tokens), cut, timeout_s)
        elif openai_url and i % 2:
            err = one_request(openai_url, "/v1/chat/completions", openai_body(i, messages, max_tokens), cut, timeout_s)
        else:
            err = one_request(url, f"/v2/models/{model}/generate_stream", request_body(i, messages, max_tokens), cut,
                              timeout_s)
        with lock:
            if err is not None:
                result.failed.append(f"request {i} ({DRAFTERS[i % len(DRAFTERS)]}): {err}")
            elif cut is not None:
                result.disconnected += 1
            else:
                result.completed += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(go, range(requests)))
    result.seconds = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8000", help="HTTP host:port")
    ap.add_argument("--model", default="specdec")
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--openai-url", default=None, help="host:port of the OpenAI front: every other request there")
    ap.add_argument("--dynamo-url", default=None, help="host:port of Dynamo's frontend: every fourth request there")
    a = ap.parse_args(argv)
    result = run(a.url, a.model, a.requests, a.concurrency, a.max_tokens, prompts_path=a.prompts,
                 openai_url=a.openai_url, dynamo_url=a.dynamo_url)
    print(json.dumps(result.as_dict()))
    return 1 if result.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
