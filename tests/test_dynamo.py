"""Two specdec nodes behind NVIDIA Dynamo's real frontend on one machine (`specdec serve --nodes 2`,
KV-aware router; docs/scale-out.md): prompts sharing a prefix land on the node that cached it
(round-robin, a second frontend over the same nodes, misses), greedy and seeded answers equal our
own OpenAI door's on one node, a client that hangs up leaves no sequence behind, bad input is a
clear 4xx and every node keeps serving, a node whose tritonserver is SIGKILLed mid-stream loses
no request (each finishes identical to an uninterrupted run), and SIGTERM drains what is in
flight and stops every process. One deployment for the whole module."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from test_serving import metric_value, metrics

pytestmark = pytest.mark.slow
pytest.importorskip("dynamo.llm", reason="NVIDIA Dynamo's runtime (the `dynamo` extra) is Linux-only")

NODE_LINE = re.compile(r"(node\d+)\s+HTTP http://(\S+)  metrics (\S+)  tritonserver pid (\d+)  "
                       r"\(Dynamo worker pid (\d+), (\S+)/metrics\)")
MODEL = "specdec"


@dataclass
class NodeInfo:
    name: str
    http_url: str
    metrics_url: str
    pid: int
    worker_pid: int
    system_url: str                   # the worker's /health and /metrics


class Launched:
    """`specdec serve ...` in a process of its own, its output collected."""

    def __init__(self, args: list[str], env: dict, log: Path, timeout_s: float = 600.0):
        self.lines: list[str] = []
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "backend.cli", "serve", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.time() + timeout_s
        while not any("Ctrl-C stops them all" in x for x in self.lines):
            assert self.proc.poll() is None and time.time() < deadline, "\n".join(self.lines[-40:])
            time.sleep(0.2)

    def _read(self) -> None:
        with open(self.log, "a") as f:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                f.write(line)

    def find(self, pattern: str) -> re.Match:
        return next(m for m in (re.search(pattern, x) for x in self.lines) if m)

    def stop(self, timeout_s: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)


@dataclass
class Deployment:
    cli: Launched
    url: str                      # the frontend (kv router)
    nodes: list[NodeInfo]
    store: str                    # file discovery's directory
    door: str                     # our own OpenAI door on node0 (the single-node reference)


@pytest.fixture(scope="module")
def deployment(built_repo, tmp_path_factory):
    from backend.serve.launcher import free_port
    from backend.serve.openai_api import Front, OpenAIServer

    work = tmp_path_factory.mktemp("dynamo")
    env = dict(os.environ, DYN_FILE_KV=str(work / "discovery"))
    t0 = time.time()
    cli = Launched(["--nodes", "2", "--model-repository", str(built_repo), "--openai-port", str(free_port())],
                   env, work / "serve.log")
    print(f"2 nodes and the frontend up in {time.time() - t0:.1f}s")
    nodes = [NodeInfo(m.group(1), m.group(2), m.group(3), int(m.group(4)), int(m.group(5)), m.group(6))
             for m in (NODE_LINE.search(x) for x in cli.lines) if m]
    door = OpenAIServer(Front(nodes[0].http_url), free_port()).start()
    yield Deployment(cli, cli.find(r"OpenAI   (http://\S+)/v1").group(1), nodes, str(work / "discovery"),
                     f"http://{door.host}:{door.port}")
    door.stop()
    if cli.proc.poll() is None:
        cli.stop()


def post(url: str, body: dict, timeout: float = 300.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def chat(url: str, content: str, system: str | None = None, **extra) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    status, body = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": messages, **extra})
    assert status == 200, body
    return body


def stream(url: str, body: dict, cut_after: int | None = None, on_event=None) -> tuple[str, str | None]:
    """A streamed completion -> (text, finish reason); cut after `cut_after` events if given."""
    host, port = url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    text, finish, n = "", None, 0
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        text += event["choices"][0].get("text") or ""
        finish = event["choices"][0].get("finish_reason") or finish
        n += 1
        if on_event is not None:
            on_event(n)
        if cut_after is not None and n >= cut_after:
            conn.sock.shutdown(2)
            break
    conn.close()
    return text, finish


def active(node: NodeInfo) -> float:
    return metric_value(metrics(node), "specdec_active_sequences", model="generator")


def workers(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
        return sum(1 for i in json.loads(r.read())["instances"] if i["endpoint"] == "generate")


def served(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
        return any(m["id"] == MODEL for m in json.loads(r.read())["data"])


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def family(tag: str) -> str:
    """A long system prompt of its own (about 300 tokens), so no other test's blocks match it."""
    return f"[{tag}] You are a careful assistant. " + " ".join(f"Rule {tag}-{i}: answer briefly." for i in range(30))


def test_prompts_sharing_a_prefix_land_on_the_node_that_cached_it(deployment, built_repo, tmp_path):
    """KV router: after the first request of a family, every other one finds its prefix cached
    (so it went to the node holding it). Round-robin, a second frontend over the same two nodes,
    alternates and misses on the node that has not seen the family."""
    kv = [cached(chat(deployment.url, q, family("kv"), max_tokens=4, temperature=0))
          for q in ("What is 2+2?", "Name a colour.", "Say hi.", "Count to three.")]
    assert kv[0] == 0 and all(c >= 256 for c in kv[1:]), kv
    from backend.serve.launcher import free_port

    env = dict(os.environ, DYN_FILE_KV=deployment.store)
    rr = Launched(["--dynamo-frontend", "--router", "round-robin", "--model-repository", str(built_repo),
                   "--openai-port", str(free_port())], env, tmp_path / "rr.log")
    try:
        url = rr.find(r"OpenAI   (http://\S+)/v1").group(1)
        deadline = time.time() + 60
        while workers(url) < 2 or not served(url):
            assert time.time() < deadline
            time.sleep(0.2)
        robin = [cached(chat(url, q, family("rr"), max_tokens=4, temperature=0))
                 for q in ("What is 2+2?", "Name a colour.", "Say hi.", "Count to three.")]
    finally:
        assert rr.stop() == 0
    print("kv cached tokens", kv, "round-robin", robin)
    assert robin.count(0) == 2, robin                     # each node's first sight of the family


def test_each_worker_relays_its_nodes_kv_events_and_load(deployment):
    """The generator's BlockStored events reached Dynamo's ZMQ source in the worker (the router's
    index is fed from them), and each worker publishes the load the router weighs: its KV blocks
    (32 sequences x 2048 tokens / 16) and, where it served the family above, its hit rate."""
    texts = [urllib.request.urlopen(f"{n.system_url}/metrics", timeout=10).read().decode() for n in deployment.nodes]
    stored = [metric_value(t, "dynamo_component_kv_publisher_zmq_events_total", event_type="stored", stage="accepted")
              for t in texts]
    assert sum(stored) > 0, stored
    assert [metric_value(t, "dynamo_component_total_blocks") for t in texts] == [4096, 4096]
    assert max(metric_value(t, "dynamo_component_kv_cache_hit_rate") for t in texts) > 0
    for n in deployment.nodes:
        with urllib.request.urlopen(f"{n.system_url}/health", timeout=10) as r:
            assert json.loads(r.read())["status"] == "ready"


PROMPTS = ("Explain TCP vs UDP in two sentences.", "Write a haiku about the sea.",
           "List three uses of a paperclip.")


def test_greedy_and_seeded_answers_equal_a_single_nodes(deployment):
    """The same request through Dynamo (tokenized by the frontend from the node's card) and
    through our own OpenAI door on one node: the same text, greedy and seeded, with a drafter
    chosen through nvext.annotations."""
    for i, prompt in enumerate(PROMPTS):
        for extra, ours in (({"temperature": 0}, {}),
                            ({"temperature": 0.8, "seed": 100 + i}, {}),
                            ({"temperature": 0.7, "seed": 7, "nvext": {"annotations": ["drafter:prompt-lookup"]}},
                             {"drafter": "prompt-lookup"})):
            ref = {k: v for k, v in extra.items() if k != "nvext"}
            a = chat(deployment.url, prompt, max_tokens=24, **extra)
            b = chat(deployment.door, prompt, max_tokens=24, **ref, **ours)
            assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], (prompt, extra)
            assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
            assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]


def test_a_client_that_hangs_up_leaves_no_active_sequence(deployment):
    threads = [threading.Thread(target=stream, args=(deployment.url, {
        "model": MODEL, "prompt": f"Tell a long story, part {i}.", "max_tokens": 400, "ignore_eos": True}, 3))
        for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    deadline = time.time() + 30
    while time.time() < deadline and sum(active(n) for n in deployment.nodes) > 0:
        time.sleep(0.2)
    assert [active(n) for n in deployment.nodes] == [0, 0]


BAD = [({"max_tokens": 4, "nvext": {"annotations": ["drafter:bogus"]}}, "drafter"),
       ({"max_tokens": 4, "presence_penalty": 0.5}, "presence_penalty"),
       ({"max_tokens": 4, "logprobs": 2}, "logprobs"),
       ({"max_tokens": 4, "nvext": {"annotations": ["num_draft_tokens:999"]}}, "num_draft_tokens"),
       ({"max_tokens": 4, "nvext": {"annotations": ["num_draft_tokens:x"]}}, "num_draft_tokens"),
       ({"max_tokens": 100000}, "max_tokens"),
       ({"max_tokens": 4, "temperature": -1}, "emperature"),
       ({"max_tokens": 4, "drafter": "eagle"}, "drafter")]


def test_bad_input_is_a_clear_4xx_and_every_node_keeps_serving(deployment):
    pids = [(n.pid, n.worker_pid) for n in deployment.nodes]
    for extra, field in BAD:
        status, body = post(f"{deployment.url}/v1/completions", {"model": MODEL, "prompt": "hi", **extra})
        assert 400 <= status < 500 and field in body.get("message", ""), (extra, status, body)
    status, body = post(f"{deployment.url}/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 404, body
    for _ in range(4):                                       # both nodes answer (the router spreads them)
        chat(deployment.url, "Say hi.", max_tokens=2, temperature=0)
    assert all(os.path.exists(f"/proc/{p}") for pair in pids for p in pair), "a node process died"
    assert workers(deployment.url) == 2


def test_a_node_killed_mid_stream_loses_no_request(deployment):
    """SIGKILL of the tritonserver (and its model processes) of a node serving streams: the
    node's worker fails them as EngineShutdown and leaves, the frontend re-sends each with the
    tokens produced so far to the other node, and every stream finishes with the text of an
    uninterrupted run, greedy and seeded. The node comes back (supervisor, worker restarted)."""
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 64, "ignore_eos": True, "temperature": t, "seed": 11 + i}
              for i, (p, t) in enumerate([("The history of the printing press", 0), ("A recipe for bread", 0.8),
                                          ("How rivers form", 0), ("The rules of chess", 0.8)])]
    want = [stream(deployment.url, b) for b in bodies]
    killed: list[NodeInfo] = []
    lock = threading.Lock()

    def kill_once(n: int) -> None:
        with lock:
            if n == 4 and not killed:
                node = max(deployment.nodes, key=active)
                os.killpg(node.pid, signal.SIGKILL)
                killed.append(node)

    got: list = [None] * len(bodies)

    def go(i: int) -> None:
        got[i] = stream(deployment.url, bodies[i], on_event=kill_once)
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert killed, "no node was killed"
    assert got == want
    deadline = time.time() + 180                              # the node serves again
    while workers(deployment.url) < 2:
        assert time.time() < deadline, "the killed node did not come back"
        time.sleep(0.5)
    assert any(f"{killed[0].name}: tritonserver serving again" in x for x in deployment.cli.lines)


def test_sigterm_drains_what_is_in_flight_and_stops_every_process(deployment):
    done: list = []
    t = threading.Thread(target=lambda: done.append(stream(deployment.url, {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0})))
    t.start()
    deadline = time.time() + 30
    while sum(active(n) for n in deployment.nodes) == 0:
        assert time.time() < deadline
        time.sleep(0.05)
    marks = [f"--http-port {n.http_url.rsplit(':', 1)[1]} " for n in deployment.nodes] + \
            [f"--triton-url {n.http_url} " for n in deployment.nodes] + [f"--http-port {deployment.url.rsplit(':', 1)[1]} "]
    assert len(ours(marks)) == 5                   # two servers, two workers, the frontend
    assert deployment.cli.stop() == 0
    t.join(60)
    assert done and done[0][1] == "length", done
    assert any("stopped (exit codes [0, 0, 0])" in x for x in deployment.cli.lines), deployment.cli.lines[-5:]
    assert ours(marks) == []


def ours(marks: list[str]) -> list[int]:
    """Live processes whose command line carries one of `marks` (a deployment's ports)."""
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") + " "
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(m in cmd for m in marks):
            found.append(int(d.name))
    return found
