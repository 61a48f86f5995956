"""`specdec generate`: a stock-tritonclient client that streams text as it arrives.

gRPC (default) uses `tritonclient.grpc` bidirectional streaming; HTTP uses Triton's
`generate_stream` (server-sent events) endpoint. At the end it prints the acceptance statistics
the server returned with the last response.
"""
from __future__ import annotations

import json
import queue
import sys
import time
import urllib.request

import numpy as np

from backend import request_schema, triton_io


def request_fields(prompt: str, args) -> dict:
    fields = {"text_input": prompt, "max_tokens": args.max_tokens, "stream": args.stream,
              "apply_chat_template": not args.raw}
    for f in request_schema.FIELDS:
        if f.flag and getattr(args, f.name) is not None:
            fields[f.name] = getattr(args, f.name)
    if args.seed is not None:
        fields["random_seed"] = args.seed
    if args.stop:
        fields["stop_words"] = list(args.stop)
    return fields


_DTYPES = {f.name: f.dtype for f in request_schema.FIELDS}
_NP = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": bool}


def grpc_inputs(fields: dict):
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in fields.items():
        dtype = _DTYPES[name]
        vals = value if isinstance(value, list) else [value]
        if dtype == "BYTES":
            vals = [str(v).encode() for v in vals]
        arr = np.array([vals], dtype=_NP[dtype])                 # [1, n]: leading batch dim
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def stream_grpc(url: str, model: str, fields: dict, on_text, timeout: float = 600.0) -> dict:
    """Send one request over a gRPC stream; call on_text(chunk) per response; return last stats."""
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    stats: dict = {}
    try:
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        client.async_stream_infer(model, grpc_inputs(fields), request_id="1",
                                  enable_empty_final_response=True)
        deadline = time.time() + timeout
        while True:
            result, error = q.get(timeout=max(1.0, deadline - time.time()))
            if error is not None:
                raise RuntimeError(str(error))
            resp = result.get_response()
            if result.as_numpy(triton_io.TEXT_OUTPUT) is not None:
                on_text(result.as_numpy(triton_io.TEXT_OUTPUT).reshape(-1)[0].decode("utf-8", "replace"))
                stats = {k: result.as_numpy(k).reshape(-1)[0] for k in triton_io.STAT_OUTPUTS
                         if result.as_numpy(k) is not None}
            if resp.parameters["triton_final_response"].bool_param:
                return stats
    finally:
        client.stop_stream()
        client.close()


def stream_http(url: str, model: str, fields: dict, on_text, timeout: float = 600.0) -> dict:
    """Triton's generate_stream endpoint (SSE): one `data:` JSON line per response."""
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream",
                                 data=json.dumps(fields).encode(),
                                 headers={"Content-Type": "application/json"})
    stats: dict = {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"])
            on_text(event.get(triton_io.TEXT_OUTPUT, ""))
            stats = {k: event[k] for k in triton_io.STAT_OUTPUTS if k in event}
    return stats


def main(args) -> int:
    fields = request_fields(args.prompt, args)
    out = sys.stdout

    def on_text(chunk: str) -> None:
        out.write(chunk)
        out.flush()

    t0 = time.time()
    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    fn = stream_grpc if args.protocol == "grpc" else stream_http
    try:
        stats = fn(url, args.model, fields, on_text)
    except Exception as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    dt = time.time() - t0
    out.write("\n")
    n = int(stats.get("output_token_count", 0))
    finish = stats.get("finish_reason", "")
    finish = finish.decode() if isinstance(finish, bytes) else finish
    print(f"[{n} tokens in {dt:.2f}s, {n / dt if dt else 0:.1f} tok/s | drafted "
          f"{int(stats.get('total_draft_tokens', 0))}, accepted "
          f"{int(stats.get('total_accepted_draft_tokens', 0))}, acceptance rate "
          f"{float(stats.get('acceptance_rate', 0)):.2f}, tokens per target forward "
          f"{float(stats.get('mean_accepted_tokens', 0)):.2f}, cached prompt tokens "
          f"{int(stats.get('cached_prompt_tokens', 0))}, finish {finish}]", file=sys.stderr)
    return 0
