"""Watch Triton Python backend stubs for tensors freed without the GIL, with gdb.

Every `pb_utils.Tensor` made from (or loaded as) a numpy array owns a reference to it; its C++
destructor (`PbTensor::~PbTensor`) drops that reference, which frees the array when it was the
last one. Done without the GIL, that races with whichever thread holds it: Python's allocator
and reference counts are not thread safe (issue 31: segfaults inside libpython, glibc heap
corruption). gdb breaks on the destructor in each watched process, reads which thread holds the
GIL (`_PyRuntime.gilstate.tstate_current->thread_id`, no call into the process) and counts the
hits by GIL state and by the backend function that dropped the tensor; the process runs on.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SCRIPT = r'''
import collections, gdb, json, os
stats = collections.Counter()

class OnFree(gdb.Breakpoint):
    def stop(self):
        cur = gdb.parse_and_eval("(PyThreadState*)_PyRuntime.gilstate.tstate_current._value")
        holder = int(cur["thread_id"]) if int(cur) else 0
        me = int.from_bytes(gdb.selected_thread().handle(), "little")
        frame, via = gdb.newest_frame(), "?"
        for _ in range(8):
            frame = frame.older()
            if frame is None:
                break
            name = frame.name() or ""
            if "python::" in name and "Sp_counted" not in name and "_M_" not in name:
                via = name.split("(")[0].replace("triton::backend::python::", "")
                break
        stats[("gil " if holder == me else "NO-GIL ") + via] += 1
        return False

OnFree("triton::backend::python::PbTensor::~PbTensor")

def report():
    with open(os.environ["GIL_WATCH_OUT"], "w") as f:
        json.dump(dict(stats), f)
'''

COMMANDS = """set pagination off
set print thread-events off
set confirm off
handle SIGUSR1 SIGUSR2 SIGPIPE SIGCHLD nostop noprint
source {script}
continue
python report()
delete
detach
quit
"""


def available() -> bool:
    return shutil.which("gdb") is not None


class GilWatch:
    """gdb attached to each of `pids` (name -> pid) until `stop()`: then {name: {kind: count}}."""

    def __init__(self, pids: dict[str, int], work: Path):
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        (work / "watch.py").write_text(SCRIPT)
        (work / "watch.gdb").write_text(COMMANDS.format(script=work / "watch.py"))
        self.procs = {}
        for name, pid in pids.items():
            env = {**os.environ, "GIL_WATCH_OUT": str(work / f"{name}.json")}
            log = open(work / f"{name}.gdb.log", "w")
            self.procs[name] = subprocess.Popen(["gdb", "-p", str(pid), "-batch", "-x", str(work / "watch.gdb")],
                                                stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 60                           # attached: the breakpoint is set
        while time.time() < deadline and not all(
                "Breakpoint 1 at" in (work / f"{n}.gdb.log").read_text() for n in self.procs):
            assert all(p.poll() is None for p in self.procs.values()), self._logs()
            time.sleep(0.2)
        assert time.time() < deadline, f"gdb did not attach: {self._logs()}"

    def _logs(self) -> str:
        return {n: (self.work / f"{n}.gdb.log").read_text()[-600:] for n in self.procs}.__repr__()

    def stop(self) -> dict[str, dict[str, int]]:
        for p in self.procs.values():
            p.send_signal(signal.SIGINT)                       # interrupt `continue`, report, detach
        out = {}
        for name, p in self.procs.items():
            p.wait(60)
            path = self.work / f"{name}.json"
            assert path.exists(), f"gdb on {name} wrote no report: {self._logs()}"
            out[name] = json.loads(path.read_text())
        return out
