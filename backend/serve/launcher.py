"""Start the Triton Inference Server bundled in the `nvidia-pytriton` wheel on CPU.

The wheel ships `tritonserver`, the Python backend and one stub per Python version but no
ready backend directory, so we assemble one from symlinks (the stub's RPATH resolves through the
link), put this virtualenv's `bin` first on PATH (the stub embeds whatever `python3` PATH finds,
which must be the venv's for `import backend` to work) and this interpreter's libpython first on
LD_LIBRARY_PATH. Listens on 127.0.0.1 only. See ../shared/reference/triton-cpu.md.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from backend.errors import UserError


class LaunchError(UserError, RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TritonPaths:
    binary: Path
    backend_lib: Path
    backend_utils: Path
    stub: Path
    caches: Path
    libs: Path

    @classmethod
    def find(cls) -> "TritonPaths":
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise LaunchError("nvidia-pytriton is not installed: pip install 'specdec[server]'")
        root = Path(spec.submodule_search_locations[0]) / "tritonserver"
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        paths = cls(root / "bin" / "tritonserver", root / "backends" / "python" / "libtriton_python.so",
                    root / "backends" / "python" / "triton_python_backend_utils.py",
                    root / "python_backend_stubs" / ver / "triton_python_backend_stub",
                    root / "caches", root.parent.parent / "nvidia_pytriton.libs")
        for p in (paths.binary, paths.backend_lib, paths.stub):
            if not p.exists():
                raise LaunchError(f"missing {p} (Python {ver} stub needed)")
        return paths


def backend_dir(paths: TritonPaths, work: Path) -> Path:
    """<work>/backends/python/{libtriton_python.so, utils, stub} as symlinks."""
    d = work / "backends" / "python"
    d.mkdir(parents=True, exist_ok=True)
    for src, name in ((paths.backend_lib, "libtriton_python.so"),
                      (paths.backend_utils, "triton_python_backend_utils.py"),
                      (paths.stub, "triton_python_backend_stub")):
        link = d / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return work / "backends"


class TritonServer:
    """A running tritonserver; use as a context manager or call start()/stop()."""

    def __init__(self, model_repository: str | Path, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None,
                 log_verbose: int = 0, log_file: str | Path | None = None, exit_timeout: int = 30,
                 extra_args: list[str] | None = None, env: dict | None = None):
        self.repo = Path(model_repository).resolve()
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_verbose = log_verbose
        self.log_file = log_file
        self.exit_timeout = exit_timeout
        self.extra_args = extra_args or []
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.shm_prefix = f"specdec{uuid.uuid4().hex[:8]}_"
        self._work = Path(tempfile.mkdtemp(prefix="specdec-triton-"))
        self.fault_dir = self._work / "faults"
        self.fault_dir.mkdir()

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> tuple[list[str], dict]:
        paths = TritonPaths.find()
        backends = backend_dir(paths, self._work)
        cmd = [str(paths.binary), "--model-repository", str(self.repo),
               "--backend-directory", str(backends), "--cache-directory", str(paths.caches),
               "--http-address", "127.0.0.1", "--http-port", str(self.http_port),
               "--grpc-address", "127.0.0.1", "--grpc-port", str(self.grpc_port),
               "--metrics-address", "127.0.0.1", "--metrics-port", str(self.metrics_port),
               "--allow-gpu-metrics", "false", "--pinned-memory-pool-byte-size", "0",
               "--backend-config", f"python,shm-region-prefix-name={self.shm_prefix}",
               "--exit-timeout-secs", str(self.exit_timeout), "--log-verbose", str(self.log_verbose),
               *self.extra_args]
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = ":".join(x for x in (libdir, str(paths.libs), env.get("LD_LIBRARY_PATH", "")) if x)
        env["SPECDEC_GRPC_URL"] = self.grpc_url          # `remote_draft local`: this server's node
        env["SPECDEC_FAULT_DIR"] = str(self.fault_dir)   # each model process's dying words
        env.update(self.extra_env)
        return cmd, env

    def start(self, timeout: float = 300.0) -> "TritonServer":
        cmd, env = self.command()
        out = open(self.log_file, "ab") if self.log_file else None
        self.proc = subprocess.Popen(cmd, env=env, stdout=out or None, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"tritonserver exited with code {self.proc.returncode} while loading "
                                  f"models (see {self.log_file or 'its output above'})")
            if self.ready():
                return self
            time.sleep(0.1)
        self.stop()
        raise LaunchError(f"tritonserver not ready after {timeout:.0f}s")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except Exception:
            return False

    def stubs(self) -> dict[str, tuple[int, str]]:
        """The Python backend stubs of this server: model instance name -> (pid, process state;
        "Z" for one that died), read from /proc."""
        out = {}
        if self.proc is None:
            return out
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) != self.proc.pid:
                    continue
                pid = int(stat.split("/")[2])
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            # argv: stub, model.py, shm region, sizes (2), parent pid, lib dir, ipc handle,
            # instance name ("generator_0_0"), runtime
            if len(argv) > 8 and argv[0].endswith(b"triton_python_backend_stub"):
                out[argv[8].decode()] = (pid, fields[0])
        return out

    @staticmethod
    def exit_status(pid: int) -> str | None:
        """How a dead (zombie) stub ended, from /proc/<pid>/stat's exit_code (waitpid's status;
        tritonserver never reaps its stubs): "killed by signal 11 (SIGSEGV)" or "exited with
        code 1"; None while it lives or once it is gone."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        if fields[0] not in ("Z", "X") or len(fields) < 50:
            return None
        code = int(fields[49])
        if code & 0x7F:
            sig = code & 0x7F
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = "?"
            return f"killed by signal {sig} ({name})"
        return f"exited with code {code >> 8}"

    def last_lines(self, name: str, pid: int, n: int = 80) -> list[str]:
        """The last lines a stub wrote to its fault log (fatal-signal stack dumps, our warnings
        and errors; triton_glue.enable_fault_log)."""
        try:
            return (self.fault_dir / f"{name}.{pid}.log").read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return []

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each stub (model instance name -> bytes)."""
        out = {}
        for name, (pid, _) in self.stubs().items():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) * 1024
            except OSError:
                pass
        return out

    def kill(self) -> None:
        """Kill the server and its stubs at once (a restart does not wait for the exit timeout)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.stop()

    def stop(self) -> int | None:
        rc = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                rc = self.proc.wait(self.exit_timeout + 10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                rc = self.proc.wait()
        elif self.proc is not None:
            rc = self.proc.returncode
        for f in glob.glob(f"/dev/shm/{self.shm_prefix}*"):     # left by killed stubs
            try:
                os.unlink(f)
            except OSError:
                pass
        return rc

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
