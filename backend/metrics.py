"""Prometheus metrics of speculation, defined once and updated once per scheduler step.

The registry is injected: on Triton it wraps the Python backend's custom metrics
(`pb_utils.MetricFamily`, exported on Triton's metrics port); tests use an in-memory one.
Each update is an IPC call on Triton (~50 us), so values are aggregated per step.

  specdec_draft_tokens_total{drafter}             draft tokens proposed
  specdec_accepted_tokens_total{drafter}          draft tokens accepted
  specdec_output_tokens_total                     tokens generated (prefill's first token included)
  specdec_target_forwards_total                   sequence-steps verified (one per sequence per step)
  specdec_verify_batches_total                    batched verify forwards (one per step)
  specdec_verify_batch_size                       histogram of sequences per verify forward
  specdec_acceptance_rate                         gauge, accepted / drafted over the last window
  specdec_mean_accepted_tokens                    gauge, E[tau] (tokens per target forward) over the window
  specdec_position_drafted_total{position}        draft tokens at tree depth d
  specdec_position_accepted_total{position}       accepted draft tokens at depth d
  specdec_position_acceptance_rate{position}      gauge, accepted / drafted at depth d (window)
  specdec_draft_seconds / specdec_verify_seconds  histograms of per-step draft and verify time
  specdec_time_to_first_token_seconds             histogram per request
  specdec_time_per_output_token_seconds           histogram per request (after the first token)
  specdec_active_sequences                        gauge
  specdec_finished_requests_total{reason}         stop | length | cancelled
  specdec_cost_correction{part}                   gauge, live / build-time cost ratio the adaptive
                                                  controller uses: verify_t{width band}_b{batch band}
                                                  (verify_t2-5_b8-15, ...) and draft_b{batch band};
                                                  fresh_yield_{drafter}: share of the pooled tree
                                                  yield a request's first tree is expected to get;
                                                  published every 64 steps
  specdec_remote_draft_calls_total{outcome}       draft node calls: ok | error | timeout | resync
  specdec_remote_draft_seconds                    histogram of draft node call latency
  specdec_remote_draft_fallbacks_total            rows drafted locally because the node failed,
                                                  timed out, asked to resync or was backing off
  specdec_draft_vocab_tokens_total{outside}       draft tokens a draft model with a vocabulary of
                                                  its own drew (locally or on a draft node),
                                                  outside="true" where no target token is its text
  specdec_draft_outside_vocab_share               gauge, the outside share of those, since start
  specdec_draft_vocab_method_rows_total{method}   rows such a draft drafted by each method (slem: the
                                                  draft's text re-encoded; tli: its distribution on the
                                                  shared tokens), as its per-request choice picked
  specdec_prefix_cache_lookups_total{engine}      requests looked up in the prefix cache
                                                  (engine: target | draft-model)
  specdec_prefix_cache_hits_total{engine}         of them, requests that reused at least one block
  specdec_prefix_cache_lookup_tokens_total{engine}  prompt tokens looked up
  specdec_prefix_cache_hit_tokens_total{engine}   prompt tokens reused (not prefilled)
  specdec_prefix_cache_evictions_total{engine}    blocks evicted (least recently used first)
  specdec_prefix_cache_bytes{engine}              gauge, bytes the cache holds (KV and features)
  specdec_prefix_cache_capacity_bytes{engine}     gauge, its budget (model parameter prefix_cache_mb)
  specdec_heap_bytes{kind}                        gauge, the process's C heap (glibc's mallinfo2):
                                                  in_use (live allocations, mmapped ones included)
                                                  and held (what malloc has from the system); with
                                                  specdec_python_blocks (live Python allocator
                                                  blocks) what tells a leak from a high-water mark
                                                  or fragmentation; published every 64 steps and
                                                  whenever the scheduler goes idle
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import sys
import time
from typing import Protocol

from backend.sequence import SequenceState, StepOutput

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64]
WINDOW = 64         # steps in the sliding window of the rate gauges


class Registry(Protocol):
    def counter(self, name: str, description: str, labels: dict): ...

    def gauge(self, name: str, description: str, labels: dict): ...

    def histogram(self, name: str, description: str, labels: dict, buckets: list[float]): ...


class Metrics:
    def __init__(self, registry: Registry, labels: dict[str, str]):
        self.r, self.labels = registry, dict(labels)
        c, g, h = registry.counter, registry.gauge, registry.histogram
        lb = self.labels
        self.output_tokens = c("specdec_output_tokens_total", "Tokens generated", lb)
        self.forwards = c("specdec_target_forwards_total", "Sequence-steps verified by the target", lb)
        self.batches = c("specdec_verify_batches_total", "Batched target verify forwards", lb)
        self.batch_size = h("specdec_verify_batch_size", "Sequences per verify forward", lb, BATCH_BUCKETS)
        self.acceptance = g("specdec_acceptance_rate", "Accepted / drafted tokens (recent window)", lb)
        self.tau = g("specdec_mean_accepted_tokens", "Tokens per target forward, E[tau] (recent window)", lb)
        self.draft_s = h("specdec_draft_seconds", "Draft time per step", lb, LATENCY_BUCKETS)
        self.verify_s = h("specdec_verify_seconds", "Verify (target forward + sampling) time per step", lb, LATENCY_BUCKETS)
        self.ttft = h("specdec_time_to_first_token_seconds", "Time to first token", lb, LATENCY_BUCKETS)
        self.tpot = h("specdec_time_per_output_token_seconds", "Time per output token after the first", lb, LATENCY_BUCKETS)
        self.active = g("specdec_active_sequences", "Sequences being prefilled or decoded", lb)
        self._finished: dict[str, object] = {}
        self._by_drafter: dict[str, tuple] = {}
        self._by_pos: dict[int, tuple] = {}
        self._corr: dict[str, object] = {}
        self._window: collections.deque = collections.deque(maxlen=WINDOW)
        self._remote: dict[str, object] = {}
        self._remote_s = h("specdec_remote_draft_seconds", "Draft node call latency", lb, LATENCY_BUCKETS)
        self._fallbacks = c("specdec_remote_draft_fallbacks_total", "Rows drafted locally instead of on the node", lb)
        self._prefix: dict[str, tuple] = {}   # engine -> counters, gauges, counts published
        self._vocab = None                  # made at the first cross-vocabulary draft
        self._methods: dict = {}            # cross-vocabulary rows by method, made at first use
        self._heap: dict[str, object] = {}  # kind -> gauge

    def _drafter(self, name: str):
        if name not in self._by_drafter:
            lb = {**self.labels, "drafter": name}
            self._by_drafter[name] = (
                self.r.counter("specdec_draft_tokens_total", "Draft tokens proposed", lb),
                self.r.counter("specdec_accepted_tokens_total", "Draft tokens accepted", lb))
        return self._by_drafter[name]

    def _position(self, d: int):
        if d not in self._by_pos:
            lb = {**self.labels, "position": str(d)}
            self._by_pos[d] = (
                self.r.counter("specdec_position_drafted_total", "Draft tokens at tree depth d", lb),
                self.r.counter("specdec_position_accepted_total", "Accepted draft tokens at tree depth d", lb),
                self.r.gauge("specdec_position_acceptance_rate", "Acceptance at tree depth d (recent window)", lb))
        return self._by_pos[d]

    def on_step(self, outs: list[StepOutput], batch: int, drafters: list[str] | None = None) -> None:
        drafted = sum(o.step_draft_tokens for o in outs)
        accepted = sum(o.step_accepted for o in outs)
        emitted = sum(o.step_accepted + 1 for o in outs)
        self.output_tokens.increment(sum(len(o.new_ids) for o in outs))
        self.forwards.increment(len(outs))
        self.batches.increment(1)
        self.batch_size.observe(batch)
        self.draft_s.observe(outs[0].step_draft_s)
        self.verify_s.observe(outs[0].step_verify_s)
        per_drafter: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        pos_d, pos_a = collections.Counter(), collections.Counter()
        for i, o in enumerate(outs):
            name = drafters[i] if drafters else "all"
            per_drafter[name][0] += o.step_draft_tokens
            per_drafter[name][1] += o.step_accepted
            for d in range(1, o.step_depth + 1):
                pos_d[d] += 1
                pos_a[d] += int(o.step_accepted >= d)
        for name, (dr, ac) in per_drafter.items():
            if dr:
                cd, ca = self._drafter(name)
                cd.increment(dr)
                ca.increment(ac)
        self._window.append((drafted, accepted, emitted, len(outs), dict(pos_d), dict(pos_a)))
        w_dr = sum(x[0] for x in self._window)
        w_ac = sum(x[1] for x in self._window)
        self.acceptance.set(w_ac / w_dr if w_dr else 0.0)
        self.tau.set(sum(x[2] for x in self._window) / max(1, sum(x[3] for x in self._window)))
        for d in pos_d:
            cd, ca, g = self._position(d)
            cd.increment(pos_d[d])
            ca.increment(pos_a[d])
            wd = sum(x[4].get(d, 0) for x in self._window)
            g.set(sum(x[5].get(d, 0) for x in self._window) / wd if wd else 0.0)

    def on_corrections(self, parts: dict[str, float]) -> None:
        for part, v in parts.items():
            if part not in self._corr:
                self._corr[part] = self.r.gauge("specdec_cost_correction",
                                                "Live / build-time cost ratio used by the adaptive controller",
                                                {**self.labels, "part": part})
            self._corr[part].set(v)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.output_tokens.increment(1)

    def on_remote_call(self, outcome: str, seconds: float, fallback_rows: int) -> None:
        """A draft node call (drafters/remote.py); outcome "skipped": the node is backing off."""
        if outcome != "skipped":
            if outcome not in self._remote:
                self._remote[outcome] = self.r.counter("specdec_remote_draft_calls_total", "Draft node calls",
                                                       {**self.labels, "outcome": outcome})
            self._remote[outcome].increment(1)
            self._remote_s.observe(seconds)
        if fallback_rows:
            self._fallbacks.increment(fallback_rows)

    def on_vocab(self, drawn: int, outside: int, methods: dict | None = None) -> None:
        """Draft tokens a cross-vocabulary draft drew this step, those outside the intersection,
        and its rows by method (SLEM / TLI)."""
        for m, n in (methods or {}).items():
            if m not in self._methods:
                self._methods[m] = self.r.counter("specdec_draft_vocab_method_rows_total", "Rows a draft model "
                                                  "with its own vocabulary drafted by each method", {**self.labels, "method": m})
            self._methods[m].increment(n)
        if self._vocab is None:
            lb = self.labels
            self._vocab = (self.r.counter("specdec_draft_vocab_tokens_total", "Draft tokens drawn by a draft model "
                                          "with its own vocabulary", {**lb, "outside": "false"}),
                           self.r.counter("specdec_draft_vocab_tokens_total", "Draft tokens drawn by a draft model "
                                          "with its own vocabulary", {**lb, "outside": "true"}),
                           self.r.gauge("specdec_draft_outside_vocab_share", "Share of draft tokens outside "
                                        "the target's vocabulary", lb), [0, 0])
        inside, out, share, totals = self._vocab
        inside.increment(drawn - outside)
        out.increment(outside)
        totals[0] += drawn
        totals[1] += outside
        share.set(totals[1] / totals[0] if totals[0] else 0.0)

    PREFIX_COUNTERS = (("lookups", "specdec_prefix_cache_lookups_total", "Requests looked up in the prefix cache"),
                       ("hits", "specdec_prefix_cache_hits_total", "Requests that reused cached prompt blocks"),
                       ("lookup_tokens", "specdec_prefix_cache_lookup_tokens_total", "Prompt tokens looked up"),
                       ("hit_tokens", "specdec_prefix_cache_hit_tokens_total", "Prompt tokens reused from the prefix cache"),
                       ("evicted_blocks", "specdec_prefix_cache_evictions_total", "Prefix cache blocks evicted"))

    def on_prefix(self, caches: dict) -> None:
        """The prefix caches' counters (engine name -> prefix_cache.PrefixStats): their increments
        since the last call, and the bytes held."""
        for engine, st in caches.items():
            if engine not in self._prefix:
                lb = {**self.labels, "engine": engine}
                self._prefix[engine] = (
                    {f: self.r.counter(name, text, lb) for f, name, text in self.PREFIX_COUNTERS},
                    self.r.gauge("specdec_prefix_cache_bytes", "Bytes the prefix cache holds", lb),
                    self.r.gauge("specdec_prefix_cache_capacity_bytes", "The prefix cache's budget", lb),
                    {f: 0 for f, _, _ in self.PREFIX_COUNTERS})
            counters, held, capacity, seen = self._prefix[engine]
            for f in counters:
                now = getattr(st, f)
                if now > seen[f]:
                    counters[f].increment(now - seen[f])
                    seen[f] = now
            held.set(st.bytes)
            capacity.set(st.capacity_bytes)

    def on_finish(self, seq: SequenceState) -> None:
        reason = seq.finish_reason or "unknown"
        if reason not in self._finished:
            self._finished[reason] = self.r.counter("specdec_finished_requests_total",
                                                    "Requests finished, by reason", {**self.labels, "reason": reason})
        self._finished[reason].increment(1)
        n = len(seq.output_ids)
        if n > 1 and seq.first_token_at is not None:
            self.tpot.observe((time.perf_counter() - seq.first_token_at) / (n - 1))

    def set_active(self, n: int) -> None:
        self.active.set(n)

    def on_heap(self) -> None:
        """The process's heap (specdec_heap_bytes{kind}, specdec_python_blocks)."""
        for kind, v in heap_bytes().items():
            if kind not in self._heap:
                self._heap[kind] = self.r.gauge("specdec_heap_bytes", "The process's C heap (mallinfo2)",
                                                {**self.labels, "kind": kind})
            self._heap[kind].set(v)
        if "python" not in self._heap:
            self._heap["python"] = self.r.gauge("specdec_python_blocks", "Live Python allocator blocks", self.labels)
        self._heap["python"].set(sys.getallocatedblocks())

    def on_kernel(self, path: str) -> None:
        """The path the target's matmul runs on (native: amx | avx512-vnni | avx-vnni | avx2), as an
        info gauge: specdec_kernel_info{path} 1."""
        self.r.gauge("specdec_kernel_info", "The target engine's matmul path (the native kernel's ISA path)",
                     {**self.labels, "path": path}).set(1)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):          # not glibc, or glibc < 2.33
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()
try:
    _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
except (OSError, AttributeError):
    _MALLOC_TRIM = None


def trim_heap() -> None:
    """Give malloc's free pages back to the system (glibc's malloc_trim(0): every arena, not only
    the top): what a load's transient buffers left behind in the threads' arenas stops counting
    in the process's RSS. A no-op where it is missing."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def heap_bytes() -> dict[str, int]:
    """The C heap: in_use (live malloc'd bytes, mmapped chunks included) and held (what malloc has
    taken from the system); {} where glibc's mallinfo2 is missing."""
    if _MALLINFO2 is None:
        return {}
    m = _MALLINFO2()
    return {"in_use": m.uordblks + m.hblkhd, "held": m.arena + m.hblkhd}


class MemoryRegistry:
    """In-process registry (tests, offline runs): name -> labels -> value."""

    class _Metric:
        def __init__(self):
            self.value = 0.0
            self.observations: list[float] = []

        def increment(self, v: float = 1.0) -> None:
            self.value += v

        def set(self, v: float) -> None:
            self.value = v

        def observe(self, v: float) -> None:
            self.observations.append(v)
            self.value += 1

    def __init__(self):
        self.metrics: dict[tuple, MemoryRegistry._Metric] = {}

    def _get(self, name, labels):
        key = (name, tuple(sorted(labels.items())))
        return self.metrics.setdefault(key, MemoryRegistry._Metric())

    def counter(self, name, description, labels):
        return self._get(name, labels)

    def gauge(self, name, description, labels):
        return self._get(name, labels)

    def histogram(self, name, description, labels, buckets):
        return self._get(name, labels)
