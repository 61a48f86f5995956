"""How many threads the native engine runs a forward on: all it was given, unless other processes
keep this process's cores busy (perf-notes §28).

OpenMP's threads wait at a barrier by spinning for milliseconds before they sleep (libgomp's
default), and a forward passes ~300 barriers. When another process holds one of the cores, the
thread that barrier waits for is off the CPU while its partner spins: measured on the 2-vCPU Xeon
with one core kept busy, a 5.5 ms plain step took 1,300 ms on 2 threads and 11 ms on 1. Letting
libgomp sleep sooner (OMP_WAIT_POLICY=passive, a small GOMP_SPINCOUNT) saves the loaded case but
costs the quiet one up to 3x (a futex wake per barrier). So the engine keeps libgomp's spinning and
instead runs on the cores that are free: every `period_s` the governor reads the busy time of the
CPUs this process may run on (/proc/stat's per-CPU lines for the affinity mask) and this
process's own CPU time, and the cores other processes kept busy over the period decide the count.

Outputs do not depend on it: every native kernel partitions work so that each output's sums run in
one thread in a fixed order (tests/test_cores.py compares 1 and 2 threads bit for bit).
SPECDEC_THREAD_GOVERNOR=off keeps the configured count whatever else runs."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

log = logging.getLogger(__name__)

# a thread is taken away when other processes keep more than this share of a core busy, given back
# when they keep less than GIVE_BACK (hysteresis: no flapping at the edge)
TAKE_AWAY, GIVE_BACK = 0.6, 0.4


def enabled() -> bool:
    value = os.environ.get("SPECDEC_THREAD_GOVERNOR", "on").strip().lower()
    if value not in ("on", "off", "1", "0", ""):
        from backend.errors import UserError
        raise UserError(f"SPECDEC_THREAD_GOVERNOR={value!r}: expected on or off")
    return value not in ("off", "0")


def _cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def read_busy(cpus: set[int]) -> tuple[float, float] | None:
    """(seconds the CPUs in `cpus` were busy since boot, this process's CPU seconds), or None
    where /proc/stat cannot be read (then the governor keeps the configured count)."""
    try:
        text = open("/proc/stat").read()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if int(name[3:]) in cpus:
            v = [int(x) for x in fields[:8]]
            busy += sum(v) - v[3] - v[4]            # all but idle and iowait
    t = os.times()
    return busy / tick, t.user + t.system


def others_busy(s0: tuple[float, float] | None, s1: tuple[float, float] | None, seconds: float) -> float | None:
    """The cores other processes kept busy between two read_busy samples `seconds` apart (the
    CPUs' busy time less this process's CPU time), or None where either sample is unknown."""
    if s0 is None or s1 is None:
        return None
    return max(0.0, (s1[0] - s0[0]) - (s1[1] - s0[1])) / max(seconds, 1e-9)


class OtherLoad:
    """The cores other processes have kept busy on this process's CPUs since it was made
    (the governor's measure, read over one span: the wide-activation price's quiet check)."""

    def __init__(self, cpus: set[int] | None = None):
        self.cpus = cpus if cpus is not None else _cpus()
        self.t0, self.s0 = time.monotonic(), read_busy(self.cpus)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def cores(self) -> float:
        """inf where /proc/stat cannot be read: unknown is not quiet."""
        v = others_busy(self.s0, read_busy(self.cpus), self.elapsed())
        return float("inf") if v is None else v


class CoreGovernor:
    """threads() before each forward: the count to run it on (1 ... `most`)."""

    def __init__(self, most: int, period_s: float = 0.1,
                 sample: Callable[[], tuple[float, float] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, on: bool | None = None,
                 cpus: set[int] | None = None):
        self.most = max(1, most)
        self.period_s = period_s
        cpus = cpus if cpus is not None else _cpus()
        self.ncpu = max(len(cpus), 1)
        self._sample = sample or (lambda: read_busy(cpus))
        self._clock = clock
        self.on = (enabled() if on is None else on) and self.most > 1
        self.now = self.most
        self.others = 0.0           # cores other processes kept busy over the last period
        self.changes = 0
        self._last = (self._clock(), self._sample()) if self.on else None

    def threads(self) -> int:
        if not self.on:
            return self.most
        now = self._clock()
        t0, s0 = self._last
        if now - t0 < self.period_s:
            return self.now
        s1 = self._sample()
        self._last = (now, s1)
        others = others_busy(s0, s1, now - t0)
        if others is None:
            return self.now
        self.others = others
        # the cores left to us (ncpu - others), rounded with hysteresis around the current count
        want = self.now
        while want > 1 and others > (self.ncpu - want) + TAKE_AWAY:
            want -= 1
        while want < self.most and others < (self.ncpu - want - 1) + GIVE_BACK:
            want += 1
        if want != self.now:
            self.changes += 1
            (log.info if self.changes <= 8 else log.debug)(
                "native engine: %d -> %d threads (other processes kept %.2f of %d cores busy)",
                self.now, want, others, self.ncpu)
            self.now = want
        return self.now
