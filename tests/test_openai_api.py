"""The OpenAI-compatible front door against the real tritonserver, with the official `openai` client:
both doors give the same text (greedy and seeded sampling, chat and completions, streamed and not),
usage counts what the model counted, stop strings cut exactly, every refusal is a 400 naming its
field, an unreachable Triton and a full queue are a 503 with Retry-After (and the server serves on),
and a client gone mid-stream frees its slot."""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from backend.serve import client as spclient
from backend.serve.launcher import TritonServer, free_port
from backend.serve.openai_api import Front, OpenAIServer
from conftest import http_post

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
MAX_TOKENS = 24
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three French cheeses and say one thing about each."}]


@pytest.fixture(scope="module")
def server(built_repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "server.log"
    srv = TritonServer(built_repo, log_file=log).start()
    yield srv
    assert srv.stop() == 0, f"tritonserver did not stop cleanly; log: {log}"


@pytest.fixture(scope="module")
def front(server, built_repo):
    oa = OpenAIServer(Front(server.http_url), free_port()).start()
    yield oa
    oa.stop()


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=front.url, api_key="none", max_retries=0, timeout=300)


def triton_text(server, text: str, chat: bool, **fields) -> tuple[str, dict]:
    """The same request through Triton's own door (gRPC, the `specdec` model)."""
    chunks: list[str] = []
    stats = spclient.stream_grpc(server.grpc_url, "specdec", {"text_input": text, "apply_chat_template": chat,
                                                             "stream": True, **fields}, chunks.append)
    return "".join(chunks), {**stats, "finish_reason": stats["finish_reason"].decode()}


def streamed(events) -> tuple[str, list]:
    chunks = list(events)
    pieces = [c.choices[0].delta.content if c.choices and hasattr(c.choices[0], "delta") else
              (c.choices[0].text if c.choices else None) for c in chunks]
    return "".join(p for p in pieces if p), chunks


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_chat_equals_triton_generate_streamed_and_not(server, client, tokenizer, sampling):
    fields = {"max_tokens": MAX_TOKENS, "temperature": sampling["temperature"]}
    if "seed" in sampling:
        fields.update(top_p=sampling["top_p"], random_seed=sampling["seed"])
    expected, stats = triton_text(server, json.dumps(MESSAGES), True, **fields)
    prompt_tokens = len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES)))

    r = client.chat.completions.create(model="specdec", messages=MESSAGES, max_tokens=MAX_TOKENS, **sampling)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == stats["finish_reason"] and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, int(stats["output_token_count"]))
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    ext = r.model_extra["specdec"]
    assert set(ext) == {"drafted_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_target_forward"}
    assert 0 <= ext["accepted_tokens"] <= ext["drafted_tokens"] and ext["tokens_per_target_forward"] >= 1

    text, chunks = streamed(client.chat.completions.create(
        model="specdec", messages=MESSAGES, max_completion_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, **sampling))
    assert text == expected and "\ufffd" not in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == stats["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == int(stats["output_token_count"])
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert [c for c in chunks if c.model_extra.get("specdec")] == [chunks[-2]]


def test_completions_equal_triton_and_the_stream_ends_with_done(server, client, front):
    prompt = "The three primary colors are"
    expected, stats = triton_text(server, prompt, False, max_tokens=MAX_TOKENS, temperature=0.0)
    r = client.completions.create(model="specdec", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected and r.object == "text_completion"
    assert r.usage.completion_tokens == int(stats["output_token_count"])
    text, chunks = streamed(client.completions.create(model="specdec", prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True))
    assert text == expected and len(chunks) > 2
    # the wire itself: server-sent events, each a JSON object, the last `data: [DONE]`
    req = urllib.request.Request(f"{front.url}/completions", data=json.dumps(
        {"model": "specdec", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in resp.read().decode().split("\n\n") if line]
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_stop_strings_cut_exactly_streamed_and_not(client):
    ask = dict(model="specdec", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    full = client.chat.completions.create(**ask).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip(), full
    expected = full[: full.index(stop)]
    r = client.chat.completions.create(**ask, stop=[stop, "never-in-this-text"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    text, chunks = streamed(client.chat.completions.create(**ask, stop=stop, stream=True))
    assert text == expected and chunks[-1].choices[0].finish_reason == "stop"


REFUSED = [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content"),
    ({"model": "gpt-4o"}, "model"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"top_p": 1.5}, "top_p"),                          # refused by the model, named for this door
    ({"drafter": "telepathy"}, "drafter"),              # the same
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages"),
    ({"best_guess": True}, "best_guess"),
]


@pytest.mark.parametrize("change,field", REFUSED, ids=[f for _, f in REFUSED])
def test_refusals_are_400_naming_the_field(front, change, field):
    body = {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **change}
    status, text = http_post(f"127.0.0.1:{front.port}", "/v1/chat/completions", body)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == field and err["message"].startswith(field + ":"), (status, text)


def test_refusal_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="specdec", prompt="hi", max_tokens=4, echo=True)
    assert e.value.status_code == 400 and e.value.body["param"] == "echo"


def test_unreachable_triton_is_503_with_retry_after(built_repo):
    oa = OpenAIServer(Front(f"127.0.0.1:{free_port()}"), free_port()).start()
    try:
        req = urllib.request.Request(f"{oa.url}/chat/completions", data=json.dumps(
            {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 503 and int(e.value.headers["Retry-After"]) > 0
        assert json.loads(e.value.read())["error"]["type"] == "server_unavailable"
    finally:
        oa.stop()


@pytest.fixture(scope="module")
def full(built_repo, tmp_path_factory):
    """A server that decodes one request at a time and queues one more (generator's
    max_active_batch 1, max_queue_size 1), and a front door before it."""
    from test_faults import repo_with

    repo = repo_with(built_repo, tmp_path_factory.mktemp("full") / "repo", max_active_batch=1, max_queue_size=1)
    srv = TritonServer(repo, log_file=repo.parent / "server.log").start()
    oa = OpenAIServer(Front(srv.http_url), free_port()).start()
    yield srv, oa
    oa.stop()
    assert srv.stop() == 0          # the refused streams left no relay thread behind (perf-notes §27)


def post(port: int, body: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_a_full_queue_is_503_with_retry_after_and_the_server_serves_on(full):
    """Beyond the generator's queue, the door answers at once 503 with Retry-After and OpenAI's
    error object (streamed or not: a stream's headers wait for the model's first answer); every
    accepted request completes; afterwards the same door serves again."""
    srv, oa = full
    answers: list = [None] * 12

    def send(i: int) -> None:
        answers[i] = post(oa.port, {"model": "specdec", "max_tokens": 48, "ignore_eos": True, "stream": i % 2 == 1,
                                    "messages": [{"role": "user", "content": f"Count from {i} to {i + 40} in words."}]})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(answers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(a is not None for a in answers), "every request is answered: never silence"
    busy = [a for a in answers if a[0] == 503]
    served = [a for a in answers if a[0] == 200]
    assert busy and served and len(busy) + len(served) == len(answers), [a[:2] for a in answers]
    for status, headers, body in busy:
        assert int(headers["Retry-After"]) > 0 and headers["Content-Type"].startswith("application/json")
        err = json.loads(body)["error"]
        assert err["type"] == "server_busy" and "max_queue_size" in err["message"], err
        assert set(err) == {"message", "type", "param", "code"}
    for status, headers, body in served:                # whole answers, streamed or not
        if headers["Content-Type"].startswith("text/event-stream"):
            assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
        else:
            assert json.loads(body)["usage"]["completion_tokens"] == 48
    deadline = time.time() + 60                         # the queue drains; the door serves again
    status, _, body = post(oa.port, {"model": "specdec", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    while status == 503 and time.time() < deadline:
        time.sleep(0.5)
        status, _, body = post(oa.port, {"model": "specdec", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"], body


def gauge(server, name: str, **labels) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{")
               and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_client_gone_mid_stream_cancels_the_triton_request(server, front):
    cancelled = gauge(server, "specdec_finished_requests_total", model="generator", reason="cancelled")
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "specdec", "messages": [{"role": "user", "content": "Write a very long story about a ship."}],
         "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        events += resp.readline().startswith(b"data: ")
    assert gauge(server, "specdec_active_sequences", model="generator") == 1
    conn.sock.close()                                   # the client is gone
    conn.close()
    deadline = time.time() + 60
    while time.time() < deadline and gauge(server, "specdec_active_sequences", model="generator") > 0:
        time.sleep(0.2)
    assert gauge(server, "specdec_active_sequences", model="generator") == 0
    assert gauge(server, "specdec_finished_requests_total", model="generator", reason="cancelled") == cancelled + 1
