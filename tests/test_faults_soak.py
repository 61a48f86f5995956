"""Issue 31's load on the real server, and what it once broke: a mixed load with client
disconnects through `specdec` and the ensemble (a share of it through our OpenAI door and through
NVIDIA Dynamo's frontend with the server as its node) loses no request, restarts no model process,
frees everything and keeps the generator's memory flat; no model process frees a tensor without
the GIL (the cause of the crashes, watched with gdb); a clean stop leaves no crash behind
(the metrics' destructors at exit: "segfault at 60"). docs/perf-notes.md section 14."""
from __future__ import annotations

import re
import subprocess
import time

import pytest

from backend.bench import soak
from backend.serve.launcher import TritonServer
from gil_watch import GilWatch, available
from test_serving import metric_value, metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def soak_server(built_repo, tmp_path_factory):
    """The server, its generator publishing KV events (a node of a Dynamo deployment: soak_dynamo)."""
    from backend.serve.dynamo.launch import node_env

    srv = TritonServer(built_repo, log_file=tmp_path_factory.mktemp("soak") / "server.log", env=node_env())
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def soak_dynamo(soak_server, tmp_path_factory):
    """NVIDIA Dynamo's frontend (KV router) with the soak's server as its one node (issue 52): a
    quarter of the specdec soak's requests go through it (docs/scale-out.md)."""
    from backend.serve.dynamo.launch import Deployment, Frontend, Worker
    from backend.serve.launcher import free_port

    logs = tmp_path_factory.mktemp("soak-dynamo")
    deployment = Deployment(store=logs / "discovery")
    worker = Worker(soak_server, deployment, log_dir=logs).start()
    front = Frontend(deployment, free_port(), "kv", log_file=logs / "frontend.log").start()
    try:
        front.wait(1)
        yield front
    finally:
        front.stop()
        worker.stop()


@pytest.fixture(scope="module")
def soak_front(soak_server, built_repo):
    """The OpenAI front door in front of the soak's server (issue 42): half the specdec soak's
    requests go through it."""
    from backend.serve.launcher import free_port
    from backend.serve.openai_api import Front, OpenAIServer

    oa = OpenAIServer(Front(soak_server.http_url), free_port()).start()
    yield oa
    oa.stop()


def wait_idle(srv, timeout_s: float = 60.0) -> None:
    """Until the generator holds no sequence (and so has trimmed its heap and published it)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and metric_value(metrics(srv), "specdec_active_sequences", model="generator") > 0:
        time.sleep(0.2)
    assert metric_value(metrics(srv), "specdec_active_sequences", model="generator") == 0


def heap(srv) -> dict[str, float]:
    """The generator's heap as it last went idle (MiB; Python's live blocks)."""
    text = metrics(srv)
    return {"in_use": metric_value(text, "specdec_heap_bytes", kind="in_use", model="generator") / 2 ** 20,
            "held": metric_value(text, "specdec_heap_bytes", kind="held", model="generator") / 2 ** 20,
            "py_blocks": metric_value(text, "specdec_python_blocks", model="generator")}


def live_stubs(srv) -> dict[str, int]:
    return {name: pid for name, (pid, state) in srv.stubs().items() if state not in ("Z", "X")}


def fault_dumps(srv) -> dict[str, str]:
    return {p.name: p.read_text(errors="replace") for p in srv.fault_dir.glob("*.log")
            if "Fatal Python error" in p.read_text(errors="replace")}


@pytest.mark.skipif(not available(), reason="gdb is not installed")
def test_no_model_process_frees_a_tensor_without_the_gil(soak_server, tmp_path):
    """Before the fix the generator dropped ~1 in 3 tensors without the GIL (the outputs the relay
    had not asked for, deleted inside send()) and the relay some BLS responses' (the stub's
    cleanup thread dropping the last reference to a finished stream)."""
    srv = soak_server
    stubs = live_stubs(srv)
    watch = GilWatch(stubs, tmp_path)
    try:
        for model in ("specdec", "ensemble"):
            result = soak.run(srv.http_url, model, requests=12, concurrency=6, max_tokens=12)
            assert not result.failed, result.as_dict()
    finally:
        counts = watch.stop()
    print(counts)
    freed = {name: sum(c.values()) for name, c in counts.items()}
    assert freed["generator_0_0"] > 100 and freed["specdec_0_0"] > 100, freed    # the watch saw them
    unsafe = {name: {k: v for k, v in c.items() if k.startswith("NO-GIL")} for name, c in counts.items()}
    assert not any(unsafe.values()), unsafe


SOAK_TOKENS = 24      # the CLI's default is 48 (`python -m backend.bench.soak`); half keeps CI's time
_warm: list[str] = []


@pytest.mark.parametrize("model", ["specdec", "ensemble"])
def test_soak_with_disconnects_loses_nothing(soak_server, soak_front, soak_dynamo, model):
    """240 streams, 12 at a time, every drafter, greedy and seeded sampling, every third client
    gone after three events (for `specdec`, a quarter through the OpenAI front and a quarter
    through Dynamo's frontend): every
    other stream ends with a finish reason, no model process restarts, every sequence is freed,
    and the generator's memory after a warm-up of 240 stays within 10% (or, past a new high-water
    mark, grows no further over another 240). The warm-up runs once (the first model's): both
    models drive the one generator."""
    srv = soak_server
    door = f"{soak_front.host}:{soak_front.port}" if model == "specdec" else None
    dynamo = soak_dynamo.url.split("//")[1] if model == "specdec" else None
    before = live_stubs(srv)
    # warm-up: the process's high-water mark (KV pages first touched, buffers grown to the
    # largest step, allocator arenas) is reached within a few hundred requests of this mix and
    # then stays (perf-notes §14: 353 MiB after 48, 380 after 168, 380-385 over 600 more; §25,
    # 2026-12-06, AMX tiles / VNNI: 460 / 482 after 120, 505 / 512 after 360, 535 / 524 from
    # 840 on, flat over the last 240 / 480: 120 left the tile path's runs at the 10% edge)
    if not _warm:
        warm = soak.run(srv.http_url, model, requests=240, concurrency=12, max_tokens=SOAK_TOKENS)
        assert not warm.failed, warm.as_dict()
        _warm.append(model)
    wait_idle(srv)
    rss0, heap0 = srv.rss_bytes()["generator_0_0"], heap(srv)
    assert heap0["py_blocks"] > 0, "the generator publishes its heap as it goes idle"
    result = soak.run(srv.http_url, model, requests=240, concurrency=12, max_tokens=SOAK_TOKENS, openai_url=door,
                      dynamo_url=dynamo)
    print(model, result.as_dict())
    assert not result.failed, result.as_dict()
    assert result.completed == 160 and result.disconnected == 80, result.as_dict()
    assert live_stubs(srv) == before, "a model process died or was restarted"
    wait_idle(srv)
    rss1, heap1 = srv.rss_bytes()["generator_0_0"], heap(srv)
    print(f"generator RSS {rss0 / 2 ** 20:.0f} -> {rss1 / 2 ** 20:.0f} MiB; heap {heap0} -> {heap1}")
    if rss1 > 1.10 * rss0:
        # a high-water mark the warm-up never reached (a step with more logit rows than any
        # before grows its buffers once: +54 MiB seen once in four CI runs; the ensemble's first
        # 240 after specdec's: +61 MiB) is not a leak; a leak is live memory that grows again
        # over the same load: run it again and ask that the live heap (malloc's in-use bytes,
        # Python's blocks) stay within 2% and that any RSS growth past 2% be malloc's held-free
        # pages (fragmentation in the threads' arenas: CI of 2026-12-07 failed on RSS 479 -> 500 MiB,
        # which here read 437 -> 453 MiB with in-use +0.02 MiB and held +16 MiB; perf-notes §43)
        again = soak.run(srv.http_url, model, requests=240, concurrency=12, max_tokens=SOAK_TOKENS, openai_url=door,
                         dynamo_url=dynamo)
        assert not again.failed, again.as_dict()
        wait_idle(srv)
        rss2, heap2 = srv.rss_bytes()["generator_0_0"], heap(srv)
        print(f"generator RSS after another 240: {rss2 / 2 ** 20:.0f} MiB; heap {heap2}")
        assert heap2["in_use"] - heap1["in_use"] <= 0.02 * rss1 / 2 ** 20, (heap1, heap2)
        assert heap2["py_blocks"] <= 1.02 * heap1["py_blocks"], (heap1, heap2)
        assert rss2 - rss1 <= 0.02 * rss1 + max(0.0, heap2["held"] - heap1["held"]) * 2 ** 20, \
            (rss0, rss1, rss2, heap1, heap2)
    assert not fault_dumps(srv)


def kernel_segfaults() -> list[str]:
    r = subprocess.run(["dmesg"], capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if re.search(r"triton_python_b.*segfault", line)] \
        if r.returncode == 0 else []


def test_a_clean_stop_leaves_no_crash(soak_server):
    """Requests through both models (the generator's metrics made), then a clean stop of the soak's
    server, the last test of the module (a server of its own cost a start, ~10 s): tritonserver
    exits 0, no model process wrote a fatal-signal dump, and the kernel log (where readable) has
    no new stub segfault."""
    before = kernel_segfaults()
    srv = soak_server
    for model in ("specdec", "ensemble"):
        result = soak.run(srv.http_url, model, requests=8, concurrency=4, max_tokens=8)
        assert not result.failed, result.as_dict()
    rc = srv.stop()
    assert rc == 0, rc
    time.sleep(1.0)
    assert not fault_dumps(srv), fault_dumps(srv)
    assert [line for line in kernel_segfaults() if line not in before] == []
