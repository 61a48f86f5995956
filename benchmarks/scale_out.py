#!/usr/bin/env python3
"""Nodes behind NVIDIA Dynamo's frontend, measured (issue 52, docs/scale-out.md).

`agent`: multi-turn agent traffic through a 2-node deployment, the KV-aware router against
round-robin. Each conversation of benchmarks/prompts/agent.jsonl is an agent session whose turn t
sends the history up to its t-th user message (every turn resends what came before, as an agent
does); sessions run `--concurrency` at a time, their turns in order. `--workload recorded`: the
history as the file has it (the conversations of a family share their system prompt and their
first exchanges, so much of the reuse is across sessions); `--workload live` (the default): each
session's first user message starts with a header of its own and the history holds the model's
own answers, so after the family's system prompt a session shares blocks with its own earlier
turns only (what an agent's conversation is). Each router gets deployments
of its own, fresh nodes every time (cold prefix caches and suffix indexes), in the order kv,
round-robin, kv, round-robin, ... (`--runs` each): two runs of one router are its A/A. Per run:
the prefix cache's hit rate (prompt tokens the nodes reused / prompt tokens, from each answer's
`usage.prompt_tokens_details.cached_tokens`), TTFT median and p90 (first content, streamed),
output tokens per second over the run, and the suffix drafter's acceptance (accepted / drafted,
from the nodes' Prometheus counters, both nodes summed).

    .venv/bin/python benchmarks/scale_out.py agent --model-repository model_repository --runs 2 \
        --json docs/results/dynamo_agent_kv_vs_rr.json

`front`: what Dynamo's frontend costs against our own OpenAI door on one node: a 1-node
deployment and our door on that node's tritonserver, the same chats through both, alternated
request by request (benchmarks/front_cost.py: Triton's generate_stream, our door, Dynamo's
frontend as the third door), then an A/A run (our door against itself).

    .venv/bin/python benchmarks/scale_out.py front --model-repository model_repository --reps 3 \
        --json docs/results/dynamo_front_cost.json

On 2 cores two nodes share the CPU (each engine gets one thread): hit rates and TTFT ratios say
what routing does; throughput scaling needs a core per node at least.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from backend.bench.provenance import write_result  # noqa: E402
from backend.serve.dynamo.launch import Deployment, Frontend, Node  # noqa: E402
from backend.serve.launcher import free_port  # noqa: E402

AGENT = HERE / "prompts" / "agent.jsonl"


def deploy(repo: Path, nodes: int, router: str, threads: int | None):
    """-> (frontend, nodes), serving (the caller stops them)."""
    d = Deployment()
    started = [Node(repo, f"node{i}", d, threads) for i in range(nodes)]
    with ThreadPoolExecutor(nodes) as pool:
        list(pool.map(Node.start, started))
    front = Frontend(d, free_port(), router).start()
    try:
        front.wait(nodes)
    except BaseException:
        undeploy(front, started)             # no servers left behind by a deployment that failed
        raise
    return front, started


def undeploy(front, nodes) -> None:
    front.stop()
    for n in nodes:
        n.stop()


def sessions(path: Path = AGENT) -> list[list[dict]]:
    """The conversations (their messages as recorded)."""
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def turns(msgs: list[dict], live: bool, s: int, answer) -> list[dict]:
    """One session: each turn's messages sent (up to and including each user message); live: the
    first user message headed by the session, the history's answers the model's own (`answer`
    sends a turn and returns the answer's text)."""
    if not live:
        for i, m in enumerate(msgs):
            if m["role"] == "user":
                answer(msgs[: i + 1])
        return
    users = [m["content"] for m in msgs if m["role"] == "user"]
    history = [m for m in msgs if m["role"] == "system"]
    for t, content in enumerate(users):
        head = f"[session {s:02d}, ticket #{1000 + 37 * s}] " if t == 0 else ""
        history.append({"role": "user", "content": head + content})
        history.append({"role": "assistant", "content": answer(list(history))})


def chat_stream(url: str, messages: list[dict], max_tokens: int, annotations: list[str]) -> dict:
    host, port = url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": "specdec", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "nvext": {"annotations": annotations}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first, usage, text = None, None, []
    for line in resp:
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        ev = json.loads(line[5:])
        piece = ev["choices"][0].get("delta", {}).get("content") if ev.get("choices") else None
        if piece:
            first = first if first is not None else time.perf_counter() - t0
            text.append(piece)
        usage = ev.get("usage") or usage
    conn.close()
    return {"ttft": first or 0.0, "seconds": time.perf_counter() - t0, "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "completion": usage["completion_tokens"], "text": "".join(text)}


def node_counters(nodes) -> dict[str, float]:
    """The suffix drafter's drafted and accepted tokens, summed over the nodes."""
    out = {"drafted": 0.0, "accepted": 0.0}
    for n in nodes:
        text = urllib.request.urlopen(n.server.metrics_url, timeout=10).read().decode()
        for line in text.splitlines():
            if 'drafter="suffix"' in line and not line.startswith("#"):
                key = "drafted" if line.startswith("specdec_draft_tokens_total") else \
                      "accepted" if line.startswith("specdec_accepted_tokens_total") else None
                if key:
                    out[key] += float(line.rsplit(" ", 1)[1])
    return out


def agent_run(url: str, nodes, convs, concurrency: int, max_tokens: int, live: bool) -> dict:
    rows, lock = [], threading.Lock()

    def answer(messages: list[dict]) -> str:
        r = chat_stream(url, messages, max_tokens, ["drafter:suffix"])
        with lock:
            rows.append(r)
        return r["text"]
    before = node_counters(nodes)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda sc: turns(sc[1], live, sc[0], answer), enumerate(convs)))
    wall = time.perf_counter() - t0
    after = node_counters(nodes)
    ttft = sorted(r["ttft"] for r in rows)
    drafted = after["drafted"] - before["drafted"]
    return {"requests": len(rows), "answers_sha1": _digest(sorted(r["text"] for r in rows)),
            "prompt_tokens": sum(r["prompt"] for r in rows),
            "cached_tokens": sum(r["cached"] for r in rows),
            "hit_rate": round(sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows), 4),
            "ttft_ms_median": round(1000 * statistics.median(ttft), 1),
            "ttft_ms_p90": round(1000 * ttft[int(0.9 * (len(ttft) - 1))], 1),
            "output_tokens": sum(r["completion"] for r in rows), "seconds": round(wall, 2),
            "tokens_per_s": round(sum(r["completion"] for r in rows) / wall, 2),
            "suffix_drafted": drafted, "suffix_accepted": after["accepted"] - before["accepted"],
            "suffix_acceptance": round((after["accepted"] - before["accepted"]) / drafted, 4) if drafted else None}


def _digest(texts: list[str]) -> str:
    import hashlib

    return hashlib.sha1("\x00".join(texts).encode()).hexdigest()[:12]


def agent(a) -> dict:
    convs = sessions()
    runs = {"kv": [], "round-robin": []}
    for _ in range(a.runs):
        for router in runs:
            front, nodes = deploy(Path(a.model_repository), 2, router, a.threads)
            try:
                r = agent_run(front.url, nodes, convs, a.concurrency, a.max_tokens, a.workload == "live")
            finally:
                undeploy(front, nodes)
            print(router, json.dumps(r), flush=True)
            runs[router].append(r)
    med = lambda router, key: statistics.median(r[key] for r in runs[router])
    ratio = {k: round(med("kv", k) / med("round-robin", k), 4) if med("round-robin", k) else None
             for k in ("hit_rate", "ttft_ms_median", "ttft_ms_p90", "tokens_per_s", "suffix_acceptance")}
    return {"runs": runs, "kv_over_round_robin": ratio,
            "config": {"nodes": 2, "workload": a.workload, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                       "runs": a.runs, "threads_per_node": a.threads, "sessions": len(convs),
                       "turns": sum(m["role"] == "user" for c in convs for m in c), "prompts": str(AGENT)}}


def front(a) -> dict:
    import front_cost

    from backend.serve.openai_api import Front, OpenAIServer

    repo = Path(a.model_repository)
    dyn, nodes = deploy(repo, 1, "kv", None)
    ours = OpenAIServer(Front(nodes[0].server.http_url), free_port()).start()
    try:
        prompts = [json.loads(line)["messages"] for line in (HERE / "prompts" / "public.jsonl").read_text().splitlines()
                   if line.strip()]
        door = f"{ours.host}:{ours.port}"
        result = front_cost.run(nodes[0].server.http_url, door, prompts, a.reps, a.max_tokens,
                                openai_b=dyn.url.split("//")[1])
        control = front_cost.run(nodes[0].server.http_url, door, prompts, a.reps, a.max_tokens, openai_b=door)
    finally:
        ours.stop()
        undeploy(dyn, nodes)
    return {"dynamo_vs_ours": result, "aa_control": control,
            "doors": {"openai": "our OpenAI door (backend/serve/openai_api.py)",
                      "openai_b": "Dynamo's frontend (1 node, kv router)", "triton": "Triton's generate_stream"},
            "config": {"reps": a.reps, "max_tokens": a.max_tokens}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("agent", "front"):
        p = sub.add_parser(name)
        p.add_argument("--model-repository", default="model_repository")
        p.add_argument("--json", default=None)
        p.add_argument("--max-tokens", type=int, default=48 if name == "agent" else 64)
        if name == "agent":
            p.add_argument("--runs", type=int, default=2)
            p.add_argument("--concurrency", type=int, default=4)
            p.add_argument("--threads", type=int, default=1, help="engine threads per node")
            p.add_argument("--workload", default="live", choices=["live", "recorded"])
        else:
            p.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    result = agent(a) if a.what == "agent" else front(a)
    print(json.dumps(result, indent=2))
    if a.json:
        write_result(a.json, result, threads=getattr(a, "threads", None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
