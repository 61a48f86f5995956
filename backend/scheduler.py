"""Continuous batching: one thread drives the decoder for every active request.

Requests join and leave between steps. Each loop iteration admits new requests, drops cancelled
ones, feeds at most one prompt chunk of a joining request (so long prompts do not stall the
streams already running), then runs ONE speculative step over all decoding sequences: their
verification is a single batched target forward (decoder.step), not a forward per request.
Outputs go to each request's Sink (the Triton adapter streams them). A failing step fails only
the requests in it; the loop keeps serving.
Knows: request lifecycle, batching, fairness. Does not know: Triton, tensors.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from backend.config import RequestError
from backend.decoder import SpecDecoder
from backend.metrics import trim_heap
from backend.sequence import Request, SequenceState, StepOutput

log = logging.getLogger("specdec.scheduler")


class Sink(Protocol):
    def send(self, out: StepOutput) -> None: ...

    def error(self, exc: Exception, internal: bool) -> None: ...

    def cancelled(self) -> bool: ...

    def close(self) -> None: ...


@dataclass
class _Entry:
    request: Request
    sink: Sink
    key: str
    seq: SequenceState | None = None
    stopped: bool = False             # a stop/cancel arrived by key (ensemble path)
    t_submit: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, decoder: SpecDecoder, max_batch: int = 32, metrics=None,
                 idle_wait_s: float = 0.05, start: bool = True):
        self.decoder = decoder
        self.max_batch = max_batch
        self.metrics = metrics
        self._incoming: queue.Queue[_Entry] = queue.Queue()
        self._stop_keys: queue.Queue[str] = queue.Queue()
        self._waiting: collections.deque[_Entry] = collections.deque()    # no KV room yet
        self._prefilling: collections.deque[_Entry] = collections.deque()
        self._active: list[_Entry] = []
        self._idle_wait = idle_wait_s
        self._busy = False                  # sequences were active at the last gauge update
        self._running = True
        self.steps = 0
        self.batch_hist: collections.Counter = collections.Counter()   # batch size -> steps
        self._thread = threading.Thread(target=self._run, name="specdec-scheduler", daemon=True)
        if start:                 # start=False: the caller drives iterate() (the paired bench)
            self._thread.start()

    # --- called from request threads ---------------------------------------------------------
    def submit(self, request: Request, sink: Sink, key: str = "") -> None:
        self._incoming.put(_Entry(request, sink, key))

    def stop(self, key: str) -> None:
        """Stop the request submitted with `key` (TensorRT-LLM's `stop` input)."""
        self._stop_keys.put(key)

    def num_active(self) -> int:
        return len(self._active) + len(self._prefilling)

    def queued(self) -> int:
        """Requests submitted that have not started decoding (waiting for KV room or prefill)."""
        return self._incoming.qsize() + len(self._waiting) + len(self._prefilling)

    def has_work(self) -> bool:
        return bool(self._active or self._prefilling or self._waiting or not self._incoming.empty())

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the loop, then end every request it held (cancelled). The loop thread owns the
        requests' response senders: if it does not stop in time they are left to it, never
        touched from two threads at once (a Triton 2.51 response factory freed twice)."""
        self._running = False
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.error("scheduler loop still running %.0fs after close; its requests are left to it", timeout_s)
                return
        while not self._incoming.empty():
            self._waiting.append(self._incoming.get_nowait())
        for e in list(self._waiting) + list(self._prefilling) + self._active:
            self._finish(e, cancelled=True)

    # --- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        while self._running:
            try:
                self.iterate(block=True)
            except Exception:                                   # never let the loop die
                log.exception("scheduler loop error")

    def iterate(self, block: bool = False) -> None:
        """One loop iteration: admit new requests (waiting up to idle_wait_s for one if `block`
        and nothing is running), drop cancelled ones, one prompt chunk, one decoding step."""
        self._admit(block=block and not (self._active or self._prefilling))
        self._drop_cancelled()
        if self._prefilling:
            self._prefill_one()
        if self._active:
            self._step()

    def _admit(self, block: bool) -> None:
        """Start new requests while the decoder has KV room; the rest wait in order."""
        try:
            entry = self._incoming.get(timeout=self._idle_wait) if block and not self._waiting \
                else self._incoming.get_nowait()
            while True:
                self._waiting.append(entry)
                entry = self._incoming.get_nowait()
        except queue.Empty:
            pass
        while self._waiting and self.decoder.room() > 0:
            entry = self._waiting.popleft()
            try:
                entry.seq = self.decoder.start(entry.request)
                self._prefilling.append(entry)
            except RequestError as exc:
                entry.sink.error(exc, internal=False)
                entry.sink.close()
            except Exception as exc:
                log.exception("start failed")
                entry.sink.error(exc, internal=True)
                entry.sink.close()
        self._set_active_gauge()

    def _drop_cancelled(self) -> None:
        stop = set()
        while not self._stop_keys.empty():
            stop.add(self._stop_keys.get_nowait())
        for e in list(self._waiting) + list(self._prefilling) + list(self._active):
            if (e.key and e.key in stop) or e.sink.cancelled():
                self._finish(e, cancelled=True)

    def _prefill_one(self) -> None:
        e = self._prefilling[0]
        try:
            out = self.decoder.prefill(e.seq)
        except Exception as exc:
            self._fail([e], exc)
            return
        if out is None:
            return                                             # more prompt chunks to go
        self._prefilling.popleft()
        if self.metrics is not None:
            self.metrics.on_first_token(time.perf_counter() - e.t_submit)
            self.metrics.on_prefix(self.decoder.prefix_stats())
        e.sink.send(out)
        if out.finished:
            self._finish(e)
        else:
            self._active.append(e)

    def _step(self) -> None:
        batch = self._active[: self.max_batch]
        if len(self._active) > self.max_batch:                  # round robin beyond max_batch
            self._active = self._active[self.max_batch:] + batch
        try:
            outs = self.decoder.step([e.seq for e in batch])
        except Exception as exc:
            self._fail(batch, exc)
            return
        self.steps += 1
        self.batch_hist[len(batch)] += 1
        if self.metrics is not None:
            self.metrics.on_step(outs, len(batch), [e.seq.drafter.value for e in batch])
            if self.steps % 64 == 1:                            # a few IPC calls: not every step
                self.metrics.on_corrections(self.decoder.controller.corrections())
                self.metrics.on_prefix(self.decoder.prefix_stats())
                self.metrics.on_heap()
        for e, out in zip(batch, outs):
            e.sink.send(out)
            if out.finished:
                self._finish(e)

    def _fail(self, entries: list[_Entry], exc: Exception) -> None:
        log.exception("step failed for %d request(s)", len(entries))
        for e in entries:
            e.sink.error(exc, internal=not isinstance(exc, RequestError))
            self._finish(e)

    def _finish(self, e: _Entry, cancelled: bool = False) -> None:
        for queue_ in (self._active, self._prefilling, self._waiting):
            if e in queue_:
                queue_.remove(e)
        if e.seq is not None:
            if cancelled and not e.seq.finished:
                e.seq.cancel()
            self.decoder.finish(e.seq)
            if self.metrics is not None:
                self.metrics.on_finish(e.seq)
        e.sink.close()
        self._set_active_gauge()

    def _set_active_gauge(self) -> None:
        n = self.num_active()
        if self.metrics is not None:
            self.metrics.set_active(n)
        if n == 0 and self._busy:           # gone idle: malloc's free pages back to the system,
            trim_heap()                     # then the heap as the load left it
            if self.metrics is not None:
                self.metrics.on_heap()
        self._busy = n > 0
