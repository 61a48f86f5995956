#!/usr/bin/env python3
"""What the OpenAI front door costs (issue 42: <= 3% throughput, <= 5 ms time to first token at
concurrency 1): the same chats, greedy, streamed, one at a time, through Triton's HTTP
`generate_stream` and through the front's `/v1/chat/completions`, the two doors alternated request
by request (door order flipped every other prompt) against one running `specdec serve`.

    .venv/bin/specdec serve &        # HTTP 8000, OpenAI 8080
    .venv/bin/python benchmarks/front_cost.py --triton 127.0.0.1:8000 --openai 127.0.0.1:8080 \
        --reps 3 --max-tokens 64 --json front_cost.json

Both doors are read with the same plain HTTP client (http.client, server-sent events), so client
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


def run(triton: str, openai: str, prompts: list[list[dict]], reps: int, max_tokens: int) -> dict:
    rows = {"triton": [], "openai": []}
    same = 0
    for rep in range(reps):
        for i, messages in enumerate(prompts):
            got = {}
            order = ("triton", "openai") if (i + rep) % 2 == 0 else ("openai", "triton")
            for door in order:
                if door == "triton":
                    body = {"text_input": json.dumps(messages), "apply_chat_template": True, "stream": True,
                            "max_tokens": max_tokens, "temperature": 0.0, "end_id": -1}
                    got[door] = _stream(triton, "/v2/models/specdec/generate_stream", body)
                else:
                    body = {"model": "specdec", "messages": messages, "stream": True, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
                    got[door] = _stream(openai, "/v1/chat/completions", body)
                rows[door].append(got[door][:2] + (got[door][3],))
            same += got["triton"][2] == got["openai"][2]
    out = {}
    for door, r in rows.items():
        tokens, seconds = sum(x[2] for x in r), sum(x[1] for x in r)
        out[door] = {"ttft_ms_median": round(1000 * statistics.median(x[0] for x in r), 2),
                     "tokens_per_s": round(tokens / seconds, 2), "requests": len(r), "tokens": tokens}
    out["front_over_triton"] = {"throughput": round(out["openai"]["tokens_per_s"] / out["triton"]["tokens_per_s"], 4),
                                "ttft_ms_added": round(out["openai"]["ttft_ms_median"] - out["triton"]["ttft_ms_median"], 2)}
    out["identical_texts"] = f"{same}/{len(prompts) * reps}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton", default="127.0.0.1:8000", help="Triton's HTTP host:port")
    ap.add_argument("--openai", default="127.0.0.1:8080", help="the OpenAI front's host:port")
    ap.add_argument("--prompts", default=str(HERE / "prompts" / "public.jsonl"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    prompts = [json.loads(line)["messages"] for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    result = run(a.triton, a.openai, prompts, a.reps, a.max_tokens)
    result["config"] = {"reps": a.reps, "max_tokens": a.max_tokens, "prompts": a.prompts}
    print(json.dumps(result, indent=2))
    if a.json:
        write_result(a.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
