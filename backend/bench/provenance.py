"""Where a bench result came from, written into its JSON by the bench itself (issue 43, point 4):
the date, the machine (CPU model, logical CPUs, the native kernel's instruction set, the threads
the bench ran on, the GPU), the commit (with the diff's hash on a dirty tree) and the exact command. A number in docs/results.md is
then checked against the file it links, not against a session's memory of where it ran.

    write_result(path, result, threads=n)   # {"provenance": provenance(n), **result} as JSON

Knows: /proc/cpuinfo, git, sys.argv, and (lazily, each failure recorded as null) the native
kernel and torch. Does not know: what any bench measures. Only the standard library is imported
at module level, so the peer benches' own interpreter (benchmarks/peer_llamacpp.py runs in the
llama.cpp venv, which has no specdec installed) can use it through the repository path.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def provenance(threads: int | None) -> dict:
    """{"date", "machine", "commit", "command"} of this process, now. `threads`: the CPU threads
    the bench's engine ran on (engine_threads() for the usual default), None where none applies
    (a correctness check) or is not known."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": _cpu_model(), "logical_cpus": os.cpu_count(), "native_isa": _native_isa(),
                        "threads": threads, "gpu": _gpu_name()},
            "commit": _commit(),
            "command": shlex.join(sys.argv)}


def write_result(path: str | Path, result: dict, threads: int | None = None) -> dict:
    """Write `result` with its provenance first (JSON, indent 2, trailing newline); returns what
    was written."""
    out = {"provenance": provenance(threads), **result}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    return out


def engine_threads(options=None) -> int:
    """The CPU threads an engine loaded with RuntimeOptions `options` (None: the defaults) runs
    on: the ORT and native runtimes' shared rule (runtime/base.py default_threads)."""
    from backend.runtime.base import default_threads

    return (options.threads if options is not None else None) or default_threads()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _native_isa() -> str | None:
    """The path the native kernel was compiled for; null where it is not compiled or does not
    load (the message is not a fact about the machine)."""
    try:
        from backend.runtime import native

        return native.isa()
    except Exception:
        return None


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


def _commit() -> dict | None:
    """{"hash": short hash of HEAD, "dirty": tracked files differ from it} of the checkout this
    module runs from, and on a dirty tree "diff_sha256": the sha256 of `git diff HEAD` (the
    tracked changes, binary included), so a number measured on uncommitted code names that code
    (issue 50). None outside a git checkout (an installed copy) or without git."""
    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                              check=True, timeout=30).stdout
    try:
        if Path(git("rev-parse", "--show-toplevel").decode().strip()).resolve() != REPO:
            return None
        out = {"hash": git("rev-parse", "--short", "HEAD").decode().strip(),
               "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}
        if out["dirty"]:
            out["diff_sha256"] = hashlib.sha256(git("diff", "--binary", "HEAD")).hexdigest()
        return out
    except (OSError, subprocess.SubprocessError):
        return None
