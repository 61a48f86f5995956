"""End to end against the real tritonserver (from nvidia-pytriton) with stock tritonclient:
streaming gRPC and HTTP generate_stream through `specdec` and `ensemble`, non-streaming,
concurrency with batched verification, cancellation, bad inputs, metrics."""
from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from backend.builder.pipeline import ENGINE_SUBDIR
from backend.config import DrafterKind, SamplingParams, ServeConfig
from backend.engine import make_decoder
from backend.sequence import Request
from backend.serve import client as spclient
from backend.serve.launcher import TritonServer
from conftest import http_post, load_prompts

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(built_repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "server.log"
    srv = TritonServer(built_repo, log_file=log, log_verbose=0)
    srv.start()
    yield srv
    rc = srv.stop()
    assert rc == 0, f"tritonserver exit code {rc}; log: {log}"


@pytest.fixture(scope="module")
def offline(built_repo):
    """Reference text: offline SpecDecoder greedy decoding of the chat-templated prompt."""
    dec = make_decoder(ServeConfig(engine_dir=str(built_repo / ENGINE_SUBDIR)))

    def generate(prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        ids = dec.tok.encode(dec.tok.apply_chat_template([{"role": "user", "content": prompt}]))
        return "".join(o.text for o in dec.generate(Request(tuple(ids), SamplingParams(max_tokens=max_tokens),
                                                            DrafterKind.NONE)))
    return generate


class Args:
    def __init__(self, **kw):
        base = dict(max_tokens=MAX_TOKENS, temperature=0.0, stream=True, raw=False, top_k=None,
                    top_p=None, min_p=None, num_draft_tokens=None, drafter=None, seed=None, stop=[])
        base.update(kw)
        self.__dict__.update(base)


def collect(fn, url, model, prompt, **kw):
    chunks = []
    stats = fn(url, model, spclient.request_fields(prompt, Args(**kw)), chunks.append)
    return "".join(chunks), chunks, stats


def metrics(srv) -> str:
    with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


PROMPT = "What is the capital of France? Answer in one sentence and then explain why."


@pytest.mark.parametrize("model", ["specdec", "ensemble"])
def test_streams_equal_offline_decoding(server, offline, model):
    expected = offline(PROMPT)
    g_text, g_chunks, g_stats = collect(spclient.stream_grpc, server.grpc_url, model, PROMPT)
    h_text, h_chunks, h_stats = collect(spclient.stream_http, server.http_url, model, PROMPT)
    n_text, n_chunks, _ = collect(spclient.stream_grpc, server.grpc_url, model, PROMPT, stream=False)
    assert g_text == expected and h_text == expected and n_text == expected
    # streamed vs whole: a stream sends one chunk per target forward, so how many depends on how
    # many tokens each forward settles (the suffix drafter, `auto`, learns this answer from the
    # earlier requests and settles most of it in two or three forwards)
    assert len(g_chunks) > 1 and len(h_chunks) > 1 and len(n_chunks) == 1
    assert int(g_stats["output_token_count"]) > 0
    status, body = http_post(server.http_url, f"/v2/models/{model}/generate",
                             {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "apply_chat_template": True})
    assert status == 200 and json.loads(body)["text_output"] == expected


def test_concurrent_streams_are_batched(server, offline):
    prompts = [p["messages"][0]["content"] for p in load_prompts()][:8]
    expected = [offline(p, 24) for p in prompts]
    before = metrics(server)
    results: dict[int, str] = {}

    def run(i):
        results[i] = collect(spclient.stream_grpc, server.grpc_url, "specdec", prompts[i], max_tokens=24)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results.get(i) for i in range(8)] == expected
    after = metrics(server)
    fwd = metric_value(after, "specdec_target_forwards_total") - metric_value(before, "specdec_target_forwards_total")
    batches = metric_value(after, "specdec_verify_batches_total") - metric_value(before, "specdec_verify_batches_total")
    assert batches > 0 and fwd / batches > 2.0, f"{fwd} sequence-steps in {batches} forwards: not batched"


def test_seeded_sampling_is_the_same_text_alone_among_streams_and_with_any_drafter(server):
    """random_seed at temperature 0.7: the text does not depend on the drafter, on the draft
    budget the adaptive controller picks under load, or on the other streams in the batch."""
    edit = next(p for p in load_prompts() if p["kind"] == "edit")["messages"][0]["content"]
    kw = dict(temperature=0.7, top_p=0.95, seed=42, max_tokens=48)
    alone_plain = collect(spclient.stream_grpc, server.grpc_url, "specdec", edit, drafter="none", **kw)[0]
    alone_lookup = collect(spclient.stream_grpc, server.grpc_url, "specdec", edit, drafter="prompt-lookup", **kw)[0]
    assert alone_plain and alone_lookup == alone_plain
    others = [p["messages"][0]["content"] for p in load_prompts()][:7]
    results: dict[int, str] = {}

    def run(i):
        if i == 0:
            results[i] = collect(spclient.stream_grpc, server.grpc_url, "specdec", edit, drafter="prompt-lookup", **kw)[0]
        else:
            results[i] = collect(spclient.stream_grpc, server.grpc_url, "specdec", others[i - 1],
                                 temperature=1.0, max_tokens=48)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results.get(0) == alone_plain


def test_cancel_one_stream_others_finish(server, offline):
    prompts = ["Write a long story about a dragon.", "List twenty fruits.", "Explain TCP in detail."]
    expected = [offline(p, 60) for p in prompts]
    out = {i: [] for i in range(3)}
    done = {i: threading.Event() for i in range(3)}
    clients = []
    for i, p in enumerate(prompts):
        c = grpcclient.InferenceServerClient(server.grpc_url)

        def cb(result, error, i=i):
            if error is None and result.as_numpy("text_output") is not None:
                out[i].append(result.as_numpy("text_output").reshape(-1)[0].decode())
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                done[i].set()
        c.start_stream(callback=cb)
        c.async_stream_infer("specdec", spclient.grpc_inputs(spclient.request_fields(p, Args(max_tokens=60))),
                             request_id=str(i), enable_empty_final_response=True)
        clients.append(c)
    while len(out[0]) < 3:
        time.sleep(0.01)
    clients[0].stop_stream(cancel_requests=True)
    for i in (1, 2):
        assert done[i].wait(300)
        clients[i].stop_stream()
    for c in clients:
        c.close()
    assert "".join(out[0]) != expected[0] and len("".join(out[0])) < len(expected[0])
    assert ["".join(out[1]), "".join(out[2])] == expected[1:]
    deadline = time.time() + 30
    while time.time() < deadline and metric_value(metrics(server), "specdec_active_sequences", model="generator") > 0:
        time.sleep(0.2)
    m = metrics(server)
    assert metric_value(m, "specdec_active_sequences", model="generator") == 0
    assert metric_value(m, "specdec_finished_requests_total", model="generator", reason="cancelled") >= 1


def test_cancel_through_ensemble_stops_generator(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    got = []
    c.start_stream(callback=lambda result, error: got.append(result))
    c.async_stream_infer("ensemble", spclient.grpc_inputs(spclient.request_fields(
        "Write a very long essay about the history of computing.", Args(max_tokens=400))),
        request_id="e1", enable_empty_final_response=True)
    while len(got) < 3:
        time.sleep(0.01)
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.time() + 60
    while time.time() < deadline and metric_value(metrics(server), "specdec_active_sequences", model="generator") > 0:
        time.sleep(0.2)
    m = metrics(server)
    assert metric_value(m, "specdec_active_sequences", model="generator") == 0
    assert metric_value(m, "specdec_finished_requests_total", model="generator", reason="cancelled") >= 1


BAD = [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "   ", "max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "top_k": -3}, "top_k"),
    ({"text_input": "hi", "drafter": "telepathy"}, "drafter"),
    ({"text_input": "hi", "num_draft_tokens": 1000}, "num_draft_tokens"),
    ({"text_input": "word " * 3000, "max_tokens": 8}, "text_input"),
]


@pytest.mark.parametrize("model", ["specdec", "ensemble"])
@pytest.mark.parametrize("body,field", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_is_invalid_arg_and_server_keeps_serving(server, model, body, field):
    status, text = http_post(server.http_url, f"/v2/models/{model}/generate", body)
    assert status == 400, (status, text)
    assert field in text, text
    status, text = http_post(server.http_url, f"/v2/models/{model}/generate",
                             {"text_input": "Say hi.", "max_tokens": 4, "apply_chat_template": True})
    assert status == 200 and json.loads(text)["text_output"]


@pytest.mark.parametrize("model", ["specdec", "ensemble"])
def test_grpc_bad_values_and_types_are_invalid_argument(server, model):
    with pytest.raises(RuntimeError, match="top_p"):
        collect(spclient.stream_grpc, server.grpc_url, model, "hi", top_p=7.0)
    # a wrong datatype is refused by Triton itself, naming the input
    c = grpcclient.InferenceServerClient(server.grpc_url)
    errors = queue.Queue()
    c.start_stream(callback=lambda result, error: errors.put(error))
    inputs = spclient.grpc_inputs({"text_input": "hi"})
    bad = grpcclient.InferInput("temperature", [1, 1], "BYTES")
    bad.set_data_from_numpy(np.array([[b"hot"]], np.object_))
    c.async_stream_infer(model, inputs + [bad], request_id="bad")
    err = errors.get(timeout=30)
    c.stop_stream()
    c.close()
    assert err is not None and "temperature" in str(err) and "expects" in str(err), str(err)
    assert collect(spclient.stream_grpc, server.grpc_url, model, "Say hi.", max_tokens=4)[0]


def test_http_wrong_json_type_is_refused_and_server_keeps_serving(server):
    """Triton's HTTP generate frontend parses JSON before any model runs and answers a string
    for a number with its own error (HTTP 500 on 2.51, not naming the field); the server must
    keep serving."""
    status, text = http_post(server.http_url, "/v2/models/specdec/generate",
                             {"text_input": "hi", "temperature": "hot"})
    assert status in (400, 500) and "parse" in text
    status, text = http_post(server.http_url, "/v2/models/specdec/generate",
                             {"text_input": "Say hi.", "max_tokens": 4, "apply_chat_template": True})
    assert status == 200


def test_metrics_move_after_a_request(server):
    """A fixed draft budget: left adaptive, the controller may rightly price drafting out on a
    loaded machine (CI once drafted nothing, so the draft counters stood still)."""
    before = metrics(server)
    collect(spclient.stream_grpc, server.grpc_url, "specdec",
            "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
            max_tokens=40, drafter="prompt-lookup", num_draft_tokens=4)
    after = metrics(server)
    for name in ("specdec_output_tokens_total", "specdec_target_forwards_total", "specdec_verify_batches_total"):
        assert metric_value(after, name, model="generator") > metric_value(before, name, model="generator"), name
    assert metric_value(after, "specdec_draft_tokens_total", model="generator") > \
        metric_value(before, "specdec_draft_tokens_total", model="generator")
    for name in ("specdec_acceptance_rate", "specdec_mean_accepted_tokens", "specdec_position_acceptance_rate",
                 "specdec_time_to_first_token_seconds_count", "specdec_time_per_output_token_seconds_count",
                 "specdec_draft_seconds_count", "specdec_verify_seconds_count", "specdec_active_sequences",
                 "specdec_cost_correction"):
        assert re.search(rf"^{name}\{{", after, re.M), name
    # the served gguf engine's matmul path (issue 44): what this machine's kernel runs on
    from backend.runtime import native

    assert metric_value(after, "specdec_kernel_info", model="generator", path=native.isa()) == 1


def test_concurrency_bench_round_runs_every_request_in_each_mode(server):
    """`specdec bench --concurrency`: rounds hold the same requests for every mode, every prompt
    at least once per level, and a round's requests all complete against the real server."""
    from backend.bench import concurrency_bench as cb

    prompts = load_prompts()
    for n in (1, 4, 32):
        rounds = cb.level_requests(prompts, n, 2)
        flat = [p["id"] for r in rounds for p in r]
        assert len(rounds) >= 2 and len({len(r) for r in rounds}) == 1 and len(rounds[0]) >= n
        assert {p["id"] for p in prompts} <= set(flat)
    fields = {"max_tokens": 8, "temperature": 0.0, "stream": True, "apply_chat_template": True}
    parts = [cb.run_level(server.grpc_url, prompts[:3], 2, {**fields, "drafter": d})
             for d in ("none", "prompt-lookup")]
    for p in parts:
        assert not p["errors"] and len(p["results"]) == 3 and p["tokens"] > 0
    combined = cb._combine(parts)
    assert combined["tokens"] == sum(p["tokens"] for p in parts)
