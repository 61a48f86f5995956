"""Faults against the real tritonserver and real processes: a model process killed mid-stream
(the supervisor restarts the server; every open stream ends with an error, readiness drops, the
same request then gives the same text), the canary health command, a burst of client
disconnects, streams beyond the admission cap (UNAVAILABLE at once), one copy of the engines per
server, and every request input fuzzed. Every accepted request must complete or get an error:
never silence."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
import urllib.request

import pytest

from backend.builder.pipeline import ENGINE_SUBDIR
from backend.config import DrafterKind, SamplingParams, ServeConfig
from backend.engine import make_decoder
from backend.sequence import Request
from backend.serve import client as spclient
from backend.serve.launcher import TritonServer
from backend.serve.supervisor import Supervisor, canary
from test_serving import Args, collect, http_post, metric_value, metrics

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")


def offline_text(repo, prompt: str, max_tokens: int) -> str:
    dec = make_decoder(ServeConfig(engine_dir=str(repo / ENGINE_SUBDIR)))
    ids = dec.tok.encode(dec.tok.apply_chat_template([{"role": "user", "content": prompt}]))
    return "".join(o.text for o in dec.generate(Request(tuple(ids), SamplingParams(max_tokens=max_tokens),
                                                        DrafterKind.NONE)))


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


class Stream:
    """One gRPC stream in the background: chunks as they come, the end (final flag or error)."""

    def __init__(self, url: str, model: str, prompt: str, **kw):
        self.chunks, self.error, self.done = [], None, threading.Event()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._cb)
        self.client.async_stream_infer(model, spclient.grpc_inputs(spclient.request_fields(prompt, Args(**kw))),
                                       enable_empty_final_response=True)

    def _cb(self, result, error):
        if error is not None:
            self.error = error
            self.done.set()
            return
        text = result.as_numpy("text_output")
        if text is not None:
            self.chunks.append(text.reshape(-1)[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.done.set()

    def close(self, cancel: bool = False):
        try:
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()
        except Exception:
            pass


@pytest.fixture
def supervised(built_repo, tmp_path):
    sup = Supervisor(TritonServer(built_repo, log_file=tmp_path / "server.log"), poll_s=0.2, canary_s=3600)
    sup.start()
    yield sup
    sup.stop()


def test_a_killed_model_process_ends_its_streams_and_the_server_serves_again(supervised, built_repo):
    srv = supervised.server
    prompt = "Write a long story about a lighthouse keeper."
    expected = offline_text(built_repo, prompt, 24)
    # SIGSEGV: what a native crash does (faulthandler dumps the stacks first); SIGKILL: an OOM kill
    for victim, sig in (("generator_0_0", signal.SIGSEGV), ("specdec_0_0", signal.SIGKILL)):
        s = Stream(srv.grpc_url, "specdec", prompt, max_tokens=400)
        while len(s.chunks) < 3 and not s.done.is_set():
            time.sleep(0.02)
        pid = srv.stubs()[victim][0]
        t0 = time.time()
        os.kill(pid, sig)
        assert s.done.wait(15), f"the stream of a killed {victim} never ended"
        ended = time.time() - t0
        assert s.error is not None, "a cut stream must end with an error, not a final response"
        saw_down, deadline = False, time.time() + 120
        while time.time() < deadline:
            up = ready(srv.http_url)
            saw_down |= not up
            if up and saw_down and supervised.restarts and supervised.restarts[-1]["at"] >= t0:
                break
            time.sleep(0.1)
        recovered = time.time() - t0
        assert saw_down, "readiness kept answering 200 with a dead model process"
        assert ready(srv.http_url)
        s.close()
        assert collect(spclient.stream_grpc, srv.grpc_url, "specdec", prompt, max_tokens=24)[0] == expected
        assert collect(spclient.stream_grpc, srv.grpc_url, "ensemble", prompt, max_tokens=24)[0] == expected
        print(f"{victim} killed: stream ended in {ended:.2f}s, serving again in {recovered:.1f}s")
    seg, kill = supervised.restarts
    # the zombie's status, or, where tritonserver aborted before a poll saw the zombie, its fault log
    assert re.fullmatch(r"model process generator_0_0 \(pid \d+, killed by signal 11 \(SIGSEGV\)\) died", seg["reason"]) \
        or re.fullmatch(r"tritonserver exited \(code -?\d+\) after model process generator_0_0 \(pid \d+, a fatal "
                        r"error in its fault log\) died", seg["reason"]), seg
    assert re.fullmatch(r"model process specdec_0_0 \(pid \d+, killed by signal 9 \(SIGKILL\)\) died", kill["reason"]), kill
    dump = "\n".join(seg["last_lines"]["generator_0_0"])
    assert "Fatal Python error: Segmentation fault" in dump or "Current thread" in dump, dump
    assert "specdec-scheduler" in dump or "scheduler.py" in dump, dump     # every thread's stack


def test_a_crash_that_took_tritonserver_down_is_named_from_the_fault_log():
    """tritonserver can abort right after a stub's crash, before a poll saw the zombie (its
    status then goes with it): the restart's reason still names the stub, from its fault log."""
    class Server:
        proc = type("Proc", (), {"returncode": -6, "poll": lambda self: -6})()

        def last_lines(self, name, pid):
            return ["Fatal Python error: Segmentation fault", "Current thread"] if name == "generator_0_0" else ["ok"]

    sup = Supervisor(Server())
    sup._pids = {"generator_0_0": 11, "specdec_0_0": 12}
    reason, lines = sup._diagnose()
    assert reason == ("tritonserver exited (code -6) after model process generator_0_0 (pid 11, a fatal error in "
                      "its fault log) died"), reason
    assert list(lines) == ["generator_0_0"]
    sup._pids = {"specdec_0_0": 12}
    assert sup._diagnose() == ("tritonserver exited (code -6)", {})


def test_health_command_passes_on_a_serving_server_and_fails_on_a_dead_one(supervised):
    ok, what = canary(supervised.server.http_url, timeout=60)
    assert ok, what
    rc = subprocess.run([sys.executable, "-m", "backend.cli", "health", "--url", supervised.server.http_url],
                        capture_output=True, text=True, timeout=120).returncode
    assert rc == 0
    from backend.serve.launcher import free_port
    r = subprocess.run([sys.executable, "-m", "backend.cli", "health", "--url", f"127.0.0.1:{free_port()}",
                        "--timeout", "3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "UNHEALTHY" in r.stdout


def repo_with(built_repo, dst, **generator_params):
    """A copy of the built repository (engines linked, not copied) with generator parameters set."""
    shutil.copytree(built_repo, dst, symlinks=True, ignore=shutil.ignore_patterns("engine"))
    (dst / ENGINE_SUBDIR).symlink_to((built_repo / ENGINE_SUBDIR).resolve())
    cfg = dst / "generator" / "config.pbtxt"
    text = cfg.read_text()
    for key, value in generator_params.items():
        text, n = re.subn(rf'key: "{key}" value: {{ string_value: "[^"]*" }}',
                          f'key: "{key}" value: {{ string_value: "{value}" }}', text)
        assert n == 1, key
    cfg.write_text(text)
    return dst


@pytest.fixture(scope="module")
def capped(built_repo, tmp_path_factory):
    """The built repository with generator's max_queue_size set to 2."""
    repo = repo_with(built_repo, tmp_path_factory.mktemp("capped") / "repo", max_queue_size=2)
    srv = TritonServer(repo, log_file=repo.parent / "server.log")
    srv.start()
    yield srv
    srv.stop()


def test_streams_beyond_the_admission_cap_are_refused_at_once_and_the_rest_complete(capped):
    streams = [Stream(capped.grpc_url, "specdec" if i % 2 else "ensemble",
                      f"Count from {i} to {i + 30} in words.", max_tokens=32) for i in range(24)]
    for s in streams:
        assert s.done.wait(300), "every accepted request completes or errors: never silence"
        s.close()
    refused = [s for s in streams if s.error is not None]
    done = [s for s in streams if s.error is None]
    assert refused and len(done) >= 2, (len(refused), len(done))
    assert all("unavailable" in str(s.error).lower() for s in refused), [str(s.error) for s in refused]
    status, text = http_post(capped.http_url, "/v2/models/specdec/generate", {"text_input": "hi", "max_tokens": 1})
    assert status in (200, 503)                 # serving (or briefly full), never broken
    status, text = http_post(capped.http_url, "/v2/models/specdec/generate", {"text_input": "hi", "max_tokens": 1})
    deadline = time.time() + 60
    while status == 503 and time.time() < deadline:
        time.sleep(0.5)
        status, text = http_post(capped.http_url, "/v2/models/specdec/generate", {"text_input": "hi", "max_tokens": 1})
    assert status == 200, text


def test_a_burst_of_client_disconnects_frees_everything(capped, built_repo):
    srv = capped
    streams = []
    for i in range(30):
        streams.append(Stream(srv.grpc_url, "specdec" if i % 2 else "ensemble",
                              "Write a very long essay about rivers.", max_tokens=300))
        time.sleep(0.02)
    time.sleep(1.0)
    for s in streams:                               # clients vanish: cancel and drop the channel
        s.close(cancel=True)
    deadline = time.time() + 60
    while time.time() < deadline and metric_value(metrics(srv), "specdec_active_sequences", model="generator") > 0:
        time.sleep(0.2)
    assert metric_value(metrics(srv), "specdec_active_sequences", model="generator") == 0
    assert collect(spclient.stream_grpc, srv.grpc_url, "specdec", "Say hi.", max_tokens=4)[0]


def test_one_copy_of_the_engines_per_server(capped, manifest):
    """After a request to each of specdec and the ensemble, only the generator holds the
    serving engine: it is the biggest process, no other maps the engine file, and each other
    holds less memory than the engine's bytes alone (a tokenizer and Python: 40-80 MiB)."""
    for model in ("specdec", "ensemble"):
        assert collect(spclient.stream_grpc, capped.grpc_url, model, "Say hi.", max_tokens=8)[0]
    rss = capped.rss_bytes()
    assert set(rss) == {"specdec_0_0", "generator_0_0", "preprocessing_0_0", "postprocessing_0_0"}, rss
    engine = manifest.engine()
    print({k: f"{v / 2 ** 20:.0f} MiB" for k, v in rss.items()}, f"engine {engine.size_bytes / 2 ** 20:.0f} MiB")
    assert max(rss.values()) == rss["generator_0_0"], rss
    assert all(v < engine.size_bytes for k, v in rss.items() if k != "generator_0_0"), rss
    maps = {name: Path(f"/proc/{pid}/maps").read_text() for name, (pid, _) in capped.stubs().items()}
    assert [n for n, m in maps.items() if Path(engine.path).name in m] in ([], ["generator_0_0"]), maps.keys()


def test_an_internal_error_mid_stream_ends_every_stream_with_an_error(built_repo, tmp_path):
    """A decoding step that raises (injected into a copy of the generator) after the first token
    was streamed: `specdec` and ensemble clients get an error at once, never silence."""
    repo = repo_with(built_repo, tmp_path / "repo")
    model = repo / "generator" / "1" / "model.py"
    model.write_text(model.read_text().replace(
        "self.service = triton_glue.Service(pb_utils, args)",
        "self.service = triton_glue.Service(pb_utils, args)\n"
        "        def step(seqs):\n"
        "            raise RuntimeError('injected step failure')\n"
        "        self.service.decoder.step = step"))
    srv = TritonServer(repo, log_file=tmp_path / "server.log")
    srv.start()
    try:
        for model_name in ("specdec", "ensemble"):
            s = Stream(srv.grpc_url, model_name, "Say hello.", max_tokens=20)
            assert s.done.wait(30), f"{model_name}: silence after an internal error"
            assert s.error is not None and (s.chunks or model_name == "ensemble"), (model_name, s.error)
            s.close()
    finally:
        srv.kill()


def test_a_draft_node_that_dies_mid_stream_never_hurts_the_target(built_repo, tmp_path):
    """The self-draft on its own server: the target's greedy streams equal plain decoding with the
    node up, killed mid-stream (the step falls back; nothing fails) and back again (used again
    after the back-off); the metrics count the calls and the fallbacks."""
    from backend.builder.pipeline import write_draft_node

    write_draft_node(built_repo, "draft-model", tmp_path / "node")
    node = TritonServer(tmp_path / "node", log_file=tmp_path / "node.log")
    node.start()
    repo = repo_with(built_repo, tmp_path / "target", remote_draft=node.grpc_url,
                     remote_draft_kind="draft-model", remote_draft_timeout_ms=1000)
    target = TritonServer(repo, log_file=tmp_path / "target.log")
    target.start()
    try:
        prompt = "List the planets of the solar system with one fact each."
        expected = offline_text(built_repo, prompt, 120)
        calls = lambda outcome: metric_value(metrics(target), "specdec_remote_draft_calls_total",
                                             model="generator", outcome=outcome)
        kw = dict(max_tokens=120, drafter="draft-model", num_draft_tokens=3)
        assert collect(spclient.stream_grpc, target.grpc_url, "specdec", prompt, **kw)[0] == expected
        assert calls("ok") > 0
        s = Stream(target.grpc_url, "specdec", prompt, **kw)
        while len(s.chunks) < 3 and not s.done.is_set():
            time.sleep(0.01)
        node.kill()                                  # the node vanishes mid-stream
        assert s.done.wait(300) and s.error is None
        assert "".join(s.chunks) == expected
        s.close()
        fallbacks = metric_value(metrics(target), "specdec_remote_draft_fallbacks_total", model="generator")
        assert fallbacks > 0 and calls("error") + calls("timeout") > 0
        node.start()                                 # back on the same port
        ok, deadline = calls("ok"), time.time() + 90
        while calls("ok") == ok and time.time() < deadline:
            assert collect(spclient.stream_grpc, target.grpc_url, "specdec", prompt, **kw)[0] == expected
        assert calls("ok") > ok, "the node was not used again after it came back"
    finally:
        target.stop()
        node.stop()


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

ANY_TEXT = st.text(max_size=40) | st.sampled_from(["", "   ", "hello", "[{\"role\": \"user\"}]", "\u00e9\u4e2d\U0001f600"])
INTS = st.integers(-2 ** 31, 2 ** 31 - 1) | st.sampled_from([0, 1, 2, 16, 100000])
FLOATS = st.floats(-1e3, 1e3, allow_nan=False) | st.sampled_from([0.0, 1.0, 0.5, -0.0, 100.0, 1e-9])
FIELDS = {
    "text_input": ANY_TEXT, "apply_chat_template": st.booleans(), "max_tokens": INTS,
    "temperature": FLOATS, "top_k": INTS, "top_p": FLOATS, "min_p": FLOATS,
    "random_seed": st.integers(0, 2 ** 64 - 1), "stop_words": st.lists(st.text(max_size=5), max_size=3),
    "end_id": INTS, "stream": st.booleans(), "num_draft_tokens": INTS,
    "drafter": st.sampled_from(["auto", "none", "prompt-lookup", "draft-model", "eagle", "lookup+eagle", "", "x"]) | st.text(max_size=8),
}


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(model=st.sampled_from(["specdec", "ensemble"]),
                  body=st.fixed_dictionaries({}, optional=FIELDS))
def test_fuzzed_request_inputs_get_an_answer_or_a_named_invalid_arg(capped, model, body):
    """Any JSON value of the right type for every input: HTTP 200 with text, or 400 naming an
    input (503 if the queue is full), never a 500 or silence; the server keeps serving."""
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
        body["max_tokens"] = 16                      # keep the suite fast: length is not the point
    body = {**body, "stream": False}
    status, text = http_post(capped.http_url, f"/v2/models/{model}/generate", body)
    if status == 200:
        assert "text_output" in json.loads(text)
    else:
        assert status in (400, 503), (status, text, body)
        if status == 400:
            assert any(f in text for f in FIELDS), (text, body)
