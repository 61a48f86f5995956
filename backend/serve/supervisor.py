"""Keep a tritonserver serving after a model process dies, and the canary health check.

Triton 2.51's Python backend never restarts a decoupled model's stub, its readiness does not
notice the death, and the in-flight streams of the dead stub never get a final response
(../shared/reference/reliability.md). So `specdec serve` supervises what it started: a thread
watches the stub processes (children of tritonserver, /proc) every `poll_s` and runs a canary
generation every `canary_s`; when a stub is gone or a zombie, or the canary gets no answer in
time or says a stub is unhealthy, the event names the process, how it ended (signal or exit
code, read from the zombie's /proc/<pid>/stat) and the last lines it wrote to its fault log
(the stack dump of every thread on a fatal signal: triton_glue.enable_fault_log; where
tritonserver itself aborted right after a stub's crash, before a poll saw the zombie, the stub
is named from its fault log), and the whole
server is killed (every open stream then ends at the
client with a connection error at once, and readiness stops answering) and started again on the
same ports. Deployments that run `tritonserver` themselves get the same canary as
`specdec health`, for a liveness probe.
Knows: processes, HTTP. Does not know: the models.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request


def canary(http_url: str, model: str = "specdec", timeout: float = 30.0) -> tuple[bool, str]:
    """One short greedy generation through `model` with a deadline -> (healthy, what happened).
    An overloaded server (503: its queue is full) counts as alive."""
    body = json.dumps({"text_input": "ping", "max_tokens": 2, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
            ok = r.status == 200 and "text_output" in out
            return ok, f"{'ok' if ok else 'bad answer'} in {time.time() - t0:.2f}s"
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")[:300]
        return e.code == 503, f"HTTP {e.code}: {text}"
    except Exception as e:                      # timeout, refused connection, reset
        return False, f"{type(e).__name__}: {e}"


class Supervisor:
    """Start `server` and restart it whenever one of its model processes dies or the canary fails."""

    def __init__(self, server, poll_s: float = 0.25, canary_s: float = 30.0,
                 canary_timeout_s: float = 60.0, on_event=None):
        self.server = server
        self.poll_s, self.canary_s, self.canary_timeout_s = poll_s, canary_s, canary_timeout_s
        self.on_event = on_event or (lambda msg: None)
        self.restarts: list[dict] = []
        self._expected: set[str] = set()
        self._pids: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self.server.start()
        self._watch()
        self._thread.start()
        return self

    def stop(self) -> int | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.canary_timeout_s + 5)
        return self.server.stop()

    def failure(self) -> str | None:
        """Why the server needs a restart now, or None."""
        reason, _ = self._diagnose()
        return reason

    def _diagnose(self) -> tuple[str | None, dict[str, list[str]]]:
        """(why the server needs a restart, or None; each dead model process's last lines)."""
        if self.server.proc is None or self.server.proc.poll() is not None:
            code = None if self.server.proc is None else self.server.proc.returncode
            # tritonserver may abort right after a stub's crash, before a poll saw the zombie
            # (its status then goes with it); the stub's fault log still says it crashed
            crashed = {name: self.server.last_lines(name, pid) for name, pid in sorted(self._pids.items())}
            crashed = {name: lines for name, lines in crashed.items() if any("Fatal Python error" in x for x in lines)}
            after = "".join(f" after model process {name} (pid {self._pids[name]}, a fatal error in its fault log) died"
                            for name in crashed)
            return f"tritonserver exited (code {code}){after}", crashed
        stubs = self.server.stubs()
        dead = sorted(n for n in self._expected if n not in stubs or stubs[n][1] in ("Z", "X"))
        if not dead:
            return None, {}
        what, lines = [], {}
        for name in dead:
            pid = stubs[name][0] if name in stubs else self._pids.get(name)
            status = (self.server.exit_status(pid) if pid else None) or "exit status unknown"
            what.append(f"{name} (pid {pid}, {status})")
            lines[name] = self.server.last_lines(name, pid) if pid else []
        return f"model process {', '.join(what)} died", lines

    def restart(self, reason: str, last_lines: dict[str, list[str]] | None = None) -> None:
        t0 = time.time()
        message = f"restarting tritonserver: {reason}"
        for name, lines in (last_lines or {}).items():
            message += f"\n  last lines of {name}:" + "".join(f"\n    {line}" for line in lines or ["(none)"])
        self.on_event(message)
        self.server.kill()
        self.server.start()
        self._watch()
        seconds = time.time() - t0
        self.restarts.append({"reason": reason, "seconds": round(seconds, 2), "at": t0,
                              "last_lines": dict(last_lines or {})})
        self.on_event(f"tritonserver serving again after {seconds:.1f}s")

    def _watch(self) -> None:
        stubs = self.server.stubs()
        self._expected = set(stubs)
        self._pids = {name: pid for name, (pid, _) in stubs.items()}

    def _run(self) -> None:
        last_canary = time.time()
        while not self._stop.wait(self.poll_s):
            reason, lines = self._diagnose()
            if reason is None and time.time() - last_canary >= self.canary_s:
                ok, what = canary(self.server.http_url, timeout=self.canary_timeout_s)
                last_canary = time.time()
                reason = None if ok or self._stop.is_set() else f"canary failed ({what})"
            if reason is not None and not self._stop.is_set():
                try:
                    self.restart(reason, lines)
                except Exception as exc:             # keep supervising: try again next poll
                    self.on_event(f"restart failed: {type(exc).__name__}: {exc}")
                last_canary = time.time()
