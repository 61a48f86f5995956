"""Nodes behind NVIDIA Dynamo's frontend: `specdec serve --nodes N`, `--dynamo-node`, `--dynamo-frontend`.

A node is a supervised tritonserver (launcher.py, supervisor.py: restarted when a model process
dies) with the generator's KV events on a port of its own, plus its Dynamo worker (worker.py),
started once the server is ready and started again after the server was (the worker leaves the
deployment when its server is gone). The frontend is Dynamo's own (`python -m dynamo.frontend`:
OpenAI HTTP, tokenizer and chat template from the node's card, the KV-aware or round-robin
router, request migration). On one machine, discovery is a directory (`--discovery file`), the
events and requests go over ZMQ and TCP on 127.0.0.1, and each node's engine gets an equal share
of the cores (`SPECDEC_THREADS`); across machines, discovery is etcd (docs/scale-out.md).
Stopping (Ctrl-C, SIGTERM) drains: the frontend first (it finishes what it holds), then each
worker (Dynamo's graceful shutdown: out of discovery, then its requests finish), then the servers.
Knows: processes, ports, Dynamo's command lines and variables. Does not know: the models.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from backend import kv_events
from backend.serve.dynamo import install
from backend.serve.launcher import LaunchError, TritonServer, free_port
from backend.serve.supervisor import Supervisor

MIGRATION_LIMIT = 3
STOP_S = 30.0                # a process's graceful stop before it is killed
RESTART_S = 5.0              # at most one worker start per this many seconds


def system_port() -> int:
    """A free port for a worker's status server: Dynamo reads DYN_SYSTEM_PORT as an i16."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise LaunchError("no free port below 32768 for a Dynamo worker's status server")


@dataclass
class Deployment:
    """Where the processes of one deployment find each other."""

    discovery: str = "file"          # file (one machine) | etcd (ETCD_ENDPOINTS) | kubernetes
    namespace: str = "specdec"
    local: bool = True               # everything on 127.0.0.1
    store: Path | None = None        # file discovery's directory

    def __post_init__(self):
        # chosen once, here: nodes start on threads of their own, and a store chosen at each one's
        # first env() gave two racing nodes two stores (a frontend that saw 1 of 2 workers)
        if self.discovery == "file" and self.store is None:   # $DYN_FILE_KV: join a deployment on this machine
            self.store = Path(os.environ.get("DYN_FILE_KV") or tempfile.mkdtemp(prefix="specdec-dynamo-"))

    def env(self) -> dict:
        env = install.env()
        if self.discovery == "file":
            env["DYN_FILE_KV"] = str(self.store)
        if self.local:
            env.update(DYN_TCP_RPC_HOST="127.0.0.1", DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_SYSTEM_HOST="127.0.0.1")
        return env

    def planes(self) -> list[str]:
        return ["--discovery-backend", self.discovery, "--event-plane", "zmq", "--request-plane", "tcp"]


def _stop(proc: subprocess.Popen | None, timeout: float = STOP_S) -> int | None:
    """SIGTERM (a graceful stop), then SIGKILL after `timeout`."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def node_env(threads: int | None = None) -> dict:
    """A node's tritonserver environment: where its generator publishes KV events (a port of its
    own; its worker is on the same machine), and its engine's thread count when nodes share cores."""
    env = {kv_events.ENV: f"tcp://127.0.0.1:{free_port()}"}
    if threads:
        env["SPECDEC_THREADS"] = str(threads)
    return env


class Worker:
    """The Dynamo worker process of a tritonserver started with node_env(); started again when it
    left (its server was gone), once the server is back."""

    def __init__(self, server: TritonServer, deployment: Deployment, name: str = "node", log_dir: Path | None = None,
                 on_event=None):
        self.server, self.deployment, self.name = server, deployment, name
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="specdec-node-"))
        self.on_event = on_event or (lambda msg: None)
        self.system_port = system_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._started_at = 0.0
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._keep, name=f"specdec-{name}-worker", daemon=True)

    @property
    def system_url(self) -> str:
        return f"http://{'127.0.0.1' if self.deployment.local else '0.0.0.0'}:{self.system_port}"

    def start(self) -> "Worker":
        self._spawn()
        self._watch.start()
        return self

    def _spawn(self) -> None:
        env = self.deployment.env()
        env["DYN_SYSTEM_PORT"] = str(self.system_port)          # its /health and /metrics
        cmd = [sys.executable, "-m", "backend.serve.dynamo.worker", "--triton-url", self.server.http_url,
               "--model-repository", str(self.server.repo), "--kv-events", self.server.extra_env[kv_events.ENV],
               "--namespace", self.deployment.namespace, "--discovery-backend", self.deployment.discovery]
        log = open(self.log_dir / f"{self.name}-worker.log", "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        self._started_at = time.time()

    def _keep(self) -> None:
        while not self._stopping.wait(0.5):
            if self.proc.poll() is None:
                continue
            self.on_event(f"{self.name}: Dynamo worker exited (code {self.proc.returncode}); "
                          "starting it again once tritonserver is ready")
            while not self._stopping.is_set() and (not self.server.ready() or time.time() - self._started_at < RESTART_S):
                self._stopping.wait(0.5)
            if not self._stopping.is_set():
                self._spawn()

    def stop(self) -> int | None:
        self._stopping.set()
        if self._watch.is_alive():
            self._watch.join(timeout=5)
        return _stop(self.proc)


class Node:
    """One node: a supervised tritonserver and its Dynamo worker."""

    def __init__(self, repo: Path, name: str, deployment: Deployment, threads: int | None = None,
                 ports: tuple[int | None, int | None, int | None] = (None, None, None),
                 log_dir: Path | None = None, on_event=None):
        self.name = name
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="specdec-node-"))
        on_event = on_event or (lambda msg: None)
        self.server = TritonServer(repo, *ports, log_file=log_dir / f"{name}-tritonserver.log", env=node_env(threads))
        self.supervisor = Supervisor(self.server, on_event=lambda msg: on_event(f"{name}: {msg}"))
        self.worker = Worker(self.server, deployment, name, log_dir, on_event)

    def start(self) -> "Node":
        self.supervisor.start()
        self.worker.start()
        return self

    def stop(self) -> int | None:
        self.worker.stop()
        return self.supervisor.stop()


def _instances(frontend_url: str) -> int | None:
    """How many workers the frontend routes to (its /health), or None if it does not answer."""
    try:
        with urllib.request.urlopen(f"{frontend_url}/health", timeout=2) as r:
            return sum(1 for i in json.loads(r.read()).get("instances", []) if i.get("endpoint") == "generate")
    except Exception:
        return None


def _models(frontend_url: str) -> list[str]:
    """The models the frontend serves (a worker's instance shows before its model card is read)."""
    try:
        with urllib.request.urlopen(f"{frontend_url}/v1/models", timeout=2) as r:
            return [m.get("id") for m in json.loads(r.read()).get("data", [])]
    except Exception:
        return []


class Frontend:
    """Dynamo's frontend process (OpenAI HTTP, preprocessing, router, migration)."""

    def __init__(self, deployment: Deployment, port: int, router: str, host: str = "127.0.0.1",
                 migration_limit: int = MIGRATION_LIMIT, log_file: Path | None = None, model: str = "specdec"):
        self.deployment, self.port, self.router, self.host, self.model = deployment, port, router, host, model
        self.migration_limit, self.log_file = migration_limit, log_file
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Frontend":
        cmd = [sys.executable, "-m", "dynamo.frontend", "--http-host", self.host, "--http-port", str(self.port),
               "--router-mode", self.router, "--migration-limit", str(self.migration_limit),
               "--namespace", self.deployment.namespace, *self.deployment.planes()]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env=self.deployment.env(), stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait(self, workers: int, timeout: float = 300.0) -> None:
        """Until the frontend routes to `workers` workers."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"Dynamo's frontend exited with code {self.proc.returncode} (see {self.log_file})")
            seen = _instances(self.url)
            if seen is not None and seen >= workers and (not workers or self.model in _models(self.url)):
                return
            time.sleep(0.25)
        raise LaunchError(f"Dynamo's frontend at {self.url} did not see {workers} worker(s) in {timeout:.0f}s")

    def stop(self) -> int | None:
        return _stop(self.proc)


def serve(args, repo: Path) -> int:
    """`specdec serve --nodes N` (a frontend and N nodes here), `--dynamo-node` (one node of a
    deployment), `--dynamo-frontend` (a deployment's frontend): start, print, wait, drain."""
    spread = args.dynamo_node or args.dynamo_frontend
    deployment = Deployment(args.discovery, args.namespace, local=not spread or args.discovery == "file")
    count = args.nodes or int(args.dynamo_node)
    threads = max(1, (os.cpu_count() or 1) // count) if args.nodes else None   # nodes share this machine's cores
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-dynamo-logs-"))
    say = lambda msg: print(msg, flush=True)
    ports = (args.http_port, args.grpc_port, args.metrics_port) if args.dynamo_node else (None, None, None)
    nodes = [Node(repo, f"node{i}", deployment, threads, ports, log_dir, on_event=say) for i in range(count)]
    front = None if args.dynamo_node else Frontend(deployment, args.openai_port, args.router, args.openai_host,
                                                   args.migration_limit, log_dir / "frontend.log")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    try:
        say(f"starting {count} node(s) ..." if count else "starting Dynamo's frontend ...")
        with ThreadPoolExecutor(max(1, count)) as pool:          # the servers load their engines at once
            list(pool.map(Node.start, nodes))
        if front is not None:
            front.start().wait(count)
        say(_banner(repo, args, deployment, nodes, front, log_dir))
        while not stop.wait(0.5):
            pass
    finally:
        say("stopping (draining: the frontend, the workers, the servers) ...")
        codes = [front.stop() if front else None]
        with ThreadPoolExecutor(max(1, count)) as pool:          # each worker's grace period at once
            list(pool.map(lambda n: n.worker.stop(), nodes))
            codes += list(pool.map(lambda n: n.supervisor.stop(), nodes))
        say(f"stopped (exit codes {codes})")
    return 0 if all(c in (0, None) for c in codes[1:]) else 1


def _banner(repo: Path, args, deployment: Deployment, nodes: list[Node], front: Frontend | None, log_dir: Path) -> str:
    what = (f"{len(nodes)} node(s) behind NVIDIA Dynamo's frontend (router {args.router}, migration up to "
            f"{args.migration_limit} times)" if front and nodes else "one node of a Dynamo deployment" if nodes
            else f"NVIDIA Dynamo's frontend (router {args.router}) for the nodes it discovers")
    lines = [f"specdec is serving {repo}: {what}"]
    if front is not None:
        lines += [f"  OpenAI   {front.url}/v1  (/chat/completions, /completions, /models; model \"specdec\"; "
                  f"extensions in nvext.annotations)",
                  f"           e.g. openai.OpenAI(base_url=\"{front.url}/v1\", api_key=\"none\")"]
    for node in nodes:
        srv = node.server
        lines.append(f"  {node.name:<8} HTTP http://{srv.http_url}  metrics {srv.metrics_url}  tritonserver pid "
                     f"{srv.proc.pid}  (Dynamo worker pid {node.worker.proc.pid}, {node.worker.system_url}/metrics)")
    store = f"file {deployment.store}" if deployment.discovery == "file" else deployment.discovery
    lines += [f"  discovery {store}; logs {log_dir}", "Ctrl-C stops them all."]
    return "\n".join(lines)
