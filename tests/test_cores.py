"""The native engine's thread governor (backend/runtime/cores.py): a thread is taken away while
other processes keep this process's cores busy and given back when they stop (hysteresis at the
edge), read from /proc/stat on a real busy process; SPECDEC_THREAD_GOVERNOR=off and bad values;
and what makes it safe: a whole engine's logits on 1 and on 2 threads are the same bits."""
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from backend.errors import UserError
from backend.runtime import cores
from backend.runtime.cores import CoreGovernor


class Fake:
    """A clock and a /proc/stat whose other processes' busy cores the test sets."""

    def __init__(self):
        self.t, self.busy, self.ours, self.others = 0.0, 0.0, 0.0, 0.0

    def advance(self, seconds: float, others: float, ours: float = 1.0):
        self.t += seconds
        self.busy += (others + ours) * seconds
        self.ours += ours * seconds

    def sample(self):
        return self.busy, self.ours


def _governor(fake: Fake, most=2, ncpu=2) -> CoreGovernor:
    return CoreGovernor(most, period_s=0.1, sample=fake.sample, clock=lambda: fake.t, on=True,
                        cpus=set(range(ncpu)))


def test_a_thread_is_taken_away_while_others_hold_a_core_and_given_back_after():
    fake = Fake()
    g = _governor(fake)
    assert g.threads() == 2
    fake.advance(0.05, others=1.0)
    assert g.threads() == 2                    # inside the period: no new reading
    fake.advance(0.1, others=1.0)
    assert g.threads() == 1 and g.others == pytest.approx(1.0)
    fake.advance(0.1, others=0.5)              # the edge: neither taken away nor given back
    assert g.threads() == 1
    fake.advance(0.1, others=0.1)
    assert g.threads() == 2
    fake.advance(0.1, others=0.5)
    assert g.threads() == 2
    fake.advance(0.1, others=0.7)
    assert g.threads() == 1
    assert g.changes == 3


def test_free_cores_beyond_the_thread_count_are_not_taken_away():
    fake = Fake()
    g = _governor(fake, most=4, ncpu=8)          # others on 3 of 8 cores leave 5 for our 4
    fake.advance(0.2, others=3.0, ours=4.0)
    assert g.threads() == 4
    fake.advance(0.2, others=5.0, ours=3.0)      # 3 left: one thread away
    assert g.threads() == 3
    fake.advance(0.2, others=7.5, ours=0.5)      # none left: one thread, never zero
    assert g.threads() == 1


def test_off_keeps_the_configured_count(monkeypatch):
    monkeypatch.setenv("SPECDEC_THREAD_GOVERNOR", "off")
    fake = Fake()
    g = CoreGovernor(2, sample=fake.sample, clock=lambda: fake.t, cpus={0, 1})
    fake.advance(1.0, others=2.0)
    assert not g.on and g.threads() == 2
    monkeypatch.setenv("SPECDEC_THREAD_GOVERNOR", "sometimes")
    with pytest.raises(UserError, match="SPECDEC_THREAD_GOVERNOR='sometimes'"):
        CoreGovernor(2)


def _burn(stop):
    while not stop.is_set():
        pass


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) > 8,
                    reason="reads Linux's /proc/stat; a busy process per core beyond 8 cores is too many")
def test_the_governor_sees_a_real_busy_process():
    """Busy processes on all cores but one: one thread within a second; the governor's reading
    of the other processes matches them."""
    ncpu = len(os.sched_getaffinity(0))
    g = CoreGovernor(2, period_s=0.2, on=True)
    if ncpu < 2:
        pytest.skip("one core: nothing to govern")
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(ncpu - 1)]
    for p in burners:
        p.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and g.threads() != 1:
            time.sleep(0.05)
        assert g.now == 1, g.others
        assert g.others >= ncpu - 1 - 0.4, g.others
    finally:
        stop.set()
        for p in burners:
            p.join(5)
    time.sleep(0.25)
    g.threads()
    # given back unless something else on this machine still holds a core (the rule, as read)
    assert g.now == (2 if g.others < (ncpu - 2) + cores.GIVE_BACK else 1), g.others


native = pytest.importorskip("backend.runtime.native")


@pytest.mark.skipif(not native.compiled(), reason="the native kernel is not compiled")
def test_an_engine_s_logits_on_one_and_two_threads_are_the_same_bits(tiny_native_engine):
    """Prefills, a batch of two trees and a plain step (conftest's tiny engine, wide qkv and LM head)."""
    for a, b in zip(tiny_native_engine(1), tiny_native_engine(2)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
