#!/usr/bin/env python3
"""What the OpenAI front door costs (issue 42: <= 3% throughput, <= 5 ms time to first token at
concurrency 1): the same chats, greedy, streamed, one at a time, through Triton's HTTP
`generate_stream` and through the front's `/v1/chat/completions`, the two doors alternated request
by request (door order flipped every other prompt) against one running `specdec serve`.

    .venv/bin/specdec serve &        # HTTP 8000, OpenAI 8080
    .venv/bin/python benchmarks/front_cost.py --triton 127.0.0.1:8000 --openai 127.0.0.1:8080 \
        --reps 3 --max-tokens 64 --json front_cost.json

With `--openai-b HOST:PORT` a second front (another build of the front, e.g. a change and its base,
each run by its own process against the same Triton) joins the rotation as a third door, and the
JSON adds `b_over_a`: the A/B of the two fronts measured alternated in one run.

With `--triton-model generator` Triton's door is the model the front itself calls (what the front
alone costs); the default, `specdec`, is the model Triton's clients call (a relay to `generator`).

With `--grpc HOST:PORT` Triton's own gRPC stream (tritonclient, one client and stream for the
run) joins too (`triton_grpc` against `triton`: what Triton's gRPC door costs against its HTTP
door; the front itself reads the HTTP door, perf-notes §27b). `--openai-b` naming the same front
as `--openai` makes `b_over_a` an A/A control of the front.

The HTTP doors are read with the same plain HTTP client (http.client, server-sent events), so client
libraries add nothing to either side. Per door: time to first token (first non-empty text piece),
the whole request, tokens (the server's count: Triton's final `output_token_count`, the front's
`usage`), and the texts must be equal (the JSON says whether they were).
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from backend.bench.provenance import write_result  # noqa: E402


def _stream(hostport: str, path: str, body: dict) -> tuple[float, float, str, int]:
    """-> (time to first text, total seconds, text, tokens) of one streamed request."""
    host, port = hostport.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    first, text, tokens = None, [], 0
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status} {resp.read()[:300]!r}")
        for line in resp:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            ev = json.loads(line[5:])
            if "choices" in ev:                                   # the OpenAI door
                piece = ev["choices"][0]["delta"].get("content") if ev["choices"] else None
                tokens = (ev.get("usage") or {}).get("completion_tokens", tokens)
            else:                                                 # Triton's generate_stream
                piece = ev.get("text_output")
                tokens = int(ev.get("output_token_count", tokens) or tokens)
            if piece:
                first = first if first is not None else time.perf_counter() - t0
                text.append(piece)
    finally:
        conn.close()
    return first or 0.0, time.perf_counter() - t0, "".join(text), tokens


class _GrpcDoor:
    """Triton's gRPC stream, one persistent client: -> the same tuple as _stream."""

    def __init__(self, hostport: str):
        import queue

        import tritonclient.grpc as grpcclient

        self.q: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(hostport)
        self.client.start_stream(callback=lambda result, error: self.q.put((time.perf_counter(), result, error)))
        self.n = 0

    def __call__(self, fields: dict) -> tuple[float, float, str, int]:
        import numpy as np

        from backend.serve.client import grpc_inputs

        self.n += 1
        t0 = time.perf_counter()
        self.client.async_stream_infer("specdec", grpc_inputs(fields), request_id=f"fc-{self.n}")
        first, text, tokens = None, [], 0
        while True:
            t, result, error = self.q.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"gRPC: {error}")
            piece = bytes(np.asarray(result.as_numpy("text_output")).reshape(-1)[0]).decode("utf-8", "replace")
            if piece:
                first = first if first is not None else t - t0
                text.append(piece)
            if np.asarray(result.as_numpy("finish_reason")).reshape(-1)[0]:
                tokens = int(np.asarray(result.as_numpy("output_token_count")).reshape(-1)[0])
                return first or 0.0, t - t0, "".join(text), tokens

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _order(doors: tuple[str, ...], k: int) -> tuple[str, ...]:
    """The doors' order for the k-th prompt: two doors flip, three rotate (each door leads as often)."""
    if len(doors) == 2:
        return doors if k % 2 == 0 else doors[::-1]
    k %= len(doors)
    return doors[k:] + doors[:k]


def run(triton: str, openai: str, prompts: list[list[dict]], reps: int, max_tokens: int,
        openai_b: str | None = None, grpc: str | None = None, triton_model: str = "specdec") -> dict:
    fronts = {"openai": openai, **({"openai_b": openai_b} if openai_b else {})}
    rows = {"triton": [], **{d: [] for d in fronts}, **({"triton_grpc": []} if grpc else {})}
    grpc_door = _GrpcDoor(grpc) if grpc else None
    same = 0
    for rep in range(reps):
        for i, messages in enumerate(prompts):
            got = {}
            for door in _order(tuple(rows), i + rep):
                if door == "triton":
                    body = {"text_input": json.dumps(messages), "apply_chat_template": True, "stream": True,
                            "max_tokens": max_tokens, "temperature": 0.0, "end_id": -1}
                    got[door] = _stream(triton, f"/v2/models/{triton_model}/generate_stream", body)
                elif door == "triton_grpc":
                    got[door] = grpc_door({"text_input": json.dumps(messages), "apply_chat_template": True,
                                           "stream": True, "max_tokens": max_tokens, "temperature": 0.0,
                                           "end_id": -1})
                else:
                    body = {"model": "specdec", "messages": messages, "stream": True, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
                    got[door] = _stream(fronts[door], "/v1/chat/completions", body)
                rows[door].append(got[door][:2] + (got[door][3],))
            same += all(got[d][2] == got["triton"][2] for d in got)
    if grpc_door:
        grpc_door.close()
    out = {}
    for door, r in rows.items():
        tokens, seconds = sum(x[2] for x in r), sum(x[1] for x in r)
        out[door] = {"ttft_ms_median": round(1000 * statistics.median(x[0] for x in r), 2),
                     "tokens_per_s": round(tokens / seconds, 2), "requests": len(r), "tokens": tokens}
    def versus(a: str, b: str) -> dict:
        """door a against door b: throughput ratio, median TTFT added."""
        return {"throughput": round(out[a]["tokens_per_s"] / out[b]["tokens_per_s"], 4),
                "ttft_ms_added": round(out[a]["ttft_ms_median"] - out[b]["ttft_ms_median"], 2)}

    out["front_over_triton"] = versus("openai", "triton")
    if openai_b:
        out["front_b_over_triton"] = versus("openai_b", "triton")
        out["b_over_a"] = versus("openai_b", "openai")
    if grpc:
        out["triton_grpc_over_http"] = versus("triton_grpc", "triton")
    out["identical_texts"] = f"{same}/{len(prompts) * reps}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton", default="127.0.0.1:8000", help="Triton's HTTP host:port")
    ap.add_argument("--openai", default="127.0.0.1:8080", help="the OpenAI front's host:port")
    ap.add_argument("--openai-b", default=None, help="a second front's host:port, alternated with the first")
    ap.add_argument("--grpc", default=None, help="Triton's gRPC host:port: its gRPC stream as one more door")
    ap.add_argument("--triton-model", default="specdec", choices=["specdec", "generator"],
                    help="the Triton model of Triton's HTTP door (generator: the one the front calls)")
    ap.add_argument("--prompts", default=str(HERE / "prompts" / "public.jsonl"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    prompts = [json.loads(line)["messages"] for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    result = run(a.triton, a.openai, prompts, a.reps, a.max_tokens, a.openai_b, a.grpc, a.triton_model)
    result["config"] = {"reps": a.reps, "max_tokens": a.max_tokens, "prompts": a.prompts, "openai_b": a.openai_b,
                        "grpc": a.grpc, "triton_model": a.triton_model}
    print(json.dumps(result, indent=2))
    if a.json:
        write_result(a.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
