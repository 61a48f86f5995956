"""The Triton Python backend side of serving, shared by the thin `model.py` adapters.

`pb` (triton_python_backend_utils) is passed in by each model.py, so this module never imports
it and the rest of backend/ never sees Triton. Here: reading model parameters into ServeConfig,
response senders as scheduler Sinks (streaming or one final response), error mapping
(RequestError -> INVALID_ARG naming the field, Overloaded -> UNAVAILABLE, anything else ->
INTERNAL, the final flag always sent), a metrics registry over the Python backend's custom
metrics, and the engine-holding Service of `generator` (triton_relay.py: `specdec`).

Three rules keep a model process alive on Triton 2.51's Python backend (r24.10), whose C++ side
drops some Python objects without the GIL (docs/perf-notes.md section 14 has the evidence):
- a response carries only the outputs its request asked for (`requested_outputs`):
  `ResponseSender.send` releases the GIL and then deletes every unrequested tensor, which frees
  that tensor's numpy array without the GIL (a race with the thread that holds it: heap
  corruption, crashes inside libpython);
- a BLS response stream is read through `bls_stream`, which keeps the iterator (and the numpy
  arrays of every response it stored) referenced from Python until the stub's cleanup thread has
  dropped its own reference: that thread drops it without the GIL, and if it is the last owner
  the arrays are freed there;
- a model that made Python backend objects with native destructors releases them in its
  `finalize` (`release_bls`, `TritonRegistry.close`): at interpreter exit the stub is gone and a
  metric's destructor writes through its null shared-memory pool ("segfault at 60").
A model process also dumps every thread's stack on a fatal signal (`enable_fault_log`).
"""
from __future__ import annotations

import collections
import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from backend import kv_events, triton_io
from backend.config import (PREFIX_CACHE_MB, DrafterKind, RemoteDraft, RequestError, RuntimeOptions,
                            ServeConfig, SpecConfig)
from backend.sequence import StepOutput

log = logging.getLogger("specdec.triton")


def model_parameters(args: dict) -> dict[str, str]:
    cfg = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}


def serve_config(args: dict) -> ServeConfig:
    """ServeConfig from config.pbtxt parameters (filled by the build; env/CLI can override)."""
    p = model_parameters(args)
    repo_root = Path(args["model_repository"]).resolve().parent
    engine_dir = (repo_root / p["engine_dir"]).resolve()
    drafter = p.get("default_drafter", "auto") or "auto"
    k = p.get("num_draft_tokens", "auto")
    spec = SpecConfig(auto_drafter=DrafterKind(drafter),
                      num_draft_tokens=None if k in ("", "auto") else int(k))
    slots = p.get("kv_slots", "auto")
    remote = None
    if p.get("remote_draft"):
        remote = RemoteDraft(p["remote_draft"], DrafterKind(p.get("remote_draft_kind") or "draft-model"),
                             float(p.get("remote_draft_timeout_ms") or 200) / 1000)
    return ServeConfig(engine_dir=str(engine_dir), weight_format=p.get("weight_format") or None,
                       spec=spec, max_batch=int(p.get("max_active_batch", 32) or 32),
                       runtime=RuntimeOptions(max_sequences=None if slots in ("", "auto") else int(slots)),
                       remote_draft=remote, prefix_cache_mb=prefix_cache_mb(p))


def prefix_cache_mb(p: dict[str, str]) -> float:
    """The prefix cache's budget: $SPECDEC_PREFIX_CACHE_MB over the model parameter over the
    default (the decoding benchmarks set 0, so that a mode run after another on the same prompts
    does not find them cached)."""
    raw = os.environ.get("SPECDEC_PREFIX_CACHE_MB") or p.get("prefix_cache_mb") or PREFIX_CACHE_MB
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise ValueError(f"prefix_cache_mb: {raw!r} is not a number of MiB >= 0")
    return mb


def draft_node(args: dict):
    """The DraftNode of the `draft` model: its engine directory's drafter of `draft_kind`."""
    from backend.draft_node import DraftNode
    from backend.engine import make_drafters
    from backend.manifest import EngineManifest

    p = model_parameters(args)
    engine_dir = (Path(args["model_repository"]).resolve().parent / p["engine_dir"]).resolve()
    manifest = EngineManifest.load(engine_dir)
    kind = DrafterKind(p.get("draft_kind") or "draft-model")
    drafters = make_drafters(manifest, SpecConfig(), kinds={kind})
    if kind not in drafters:
        raise ValueError(f"the engines in {engine_dir} have no {kind.value} drafter to serve "
                         f"(built: {sorted(d.value for d in drafters)})")
    return DraftNode(drafters[kind], manifest.model.vocab_size)


class Overloaded(RuntimeError):
    """The server refuses a request it has no room to queue (Triton UNAVAILABLE)."""

    def __init__(self, message: str):
        super().__init__(f"{triton_io.UNAVAILABLE}: {message}")


def error_response(pb, exc: Exception, internal: bool):
    if isinstance(exc, Overloaded):
        return pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.UNAVAILABLE))
    code = pb.TritonError.INTERNAL if internal else pb.TritonError.INVALID_ARG
    msg = f"{type(exc).__name__}: {exc}" if internal else str(exc)
    return pb.InferenceResponse(error=pb.TritonError(msg, code))


def stop_generator(pb, key: str) -> None:
    """Ask `generator` to stop the sequence submitted with `key` (TensorRT-LLM's `stop`)."""
    stop = pb.InferenceRequest(model_name="generator", requested_output_names=[], inputs=[
        pb.Tensor(triton_io.STOP, np.array([[True]])),
        pb.Tensor(triton_io.SEQUENCE_KEY, np.array([[key.encode() if isinstance(key, str) else key]], np.object_)),
        pb.Tensor(triton_io.INPUT_IDS, np.zeros((1, 1), np.int32))])
    for _ in bls_stream(stop):
        pass


def requested_outputs(request) -> frozenset[str]:
    """The outputs a request asked for (Triton fills in every output when a client names none)."""
    return frozenset(request.requested_output_names())


def tensors(pb, arrays: dict, wanted: frozenset[str] | None = None):
    """pb.Tensors of `arrays`, only those in `wanted` when given: never hand send() a tensor it
    would drop without the GIL (module docstring)."""
    return [pb.Tensor(k, v) for k, v in arrays.items() if wanted is None or k in wanted]


class _LateRelease:
    """Finished BLS response iterators, held for `grace_s` after their stream ended.

    The stub's cleanup thread erases its reference to a finished iterator moments after the final
    response (pb_stub.cc SendCleanupId, without the GIL); holding ours longer makes the last
    reference, and with it every stored response's numpy arrays, go under the GIL. The grace is
    orders of magnitude above that moment (a queue of parent round trips, milliseconds)."""

    def __init__(self, grace_s: float = 5.0):
        self.grace_s = grace_s
        self._held: collections.deque = collections.deque()     # (time, iterator), oldest first
        self._lock = threading.Lock()

    def hold(self, obj) -> None:
        now = time.monotonic()
        with self._lock:
            self._held.append((now, obj))
            old = []
            while self._held and now - self._held[0][0] >= self.grace_s:
                old.append(self._held.popleft())
        del old                                                  # dropped here, with the GIL

    def release_all(self) -> None:
        """Wait out the newest iterator's grace, then drop them all (a model's finalize)."""
        with self._lock:
            newest = self._held[-1][0] if self._held else None
        if newest is not None:
            time.sleep(max(0.0, self.grace_s - (time.monotonic() - newest)))
        with self._lock:
            held, self._held = self._held, collections.deque()
        del held

    def __len__(self) -> int:
        return len(self._held)


_LATE = _LateRelease()


def bls_stream(request):
    """The responses of a decoupled BLS request; the iterator outlives the stream by a grace
    period (_LateRelease), so the stub never frees a response's arrays without the GIL."""
    it = request.exec(decoupled=True)
    try:
        yield from it
    finally:
        _LATE.hold(it)


def release_bls() -> None:
    """Drop the held BLS iterators while the stub still runs (a model's finalize)."""
    _LATE.release_all()


def enable_fault_log(args: dict) -> None:
    """On a fatal signal (SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL) dump every thread's Python
    stack before the process ends: into `$SPECDEC_FAULT_DIR/<instance>.<pid>.log` when the
    launcher set that (the supervisor reports its last lines when the process dies; our
    warnings and errors go there too), else to stderr (the server log)."""
    fault_dir = os.environ.get("SPECDEC_FAULT_DIR")
    if not fault_dir:
        faulthandler.enable(file=sys.stderr, all_threads=True)
        return
    name = args.get("model_instance_name", args.get("model_name", "model"))
    f = open(Path(fault_dir) / f"{name}.{os.getpid()}.log", "a", buffering=1)
    faulthandler.enable(file=f, all_threads=True)                 # faulthandler keeps `f` open
    root = logging.getLogger("specdec")
    if not root.handlers:                                         # stderr as before, and the file
        for handler in (logging.StreamHandler(sys.stderr), logging.StreamHandler(f)):
            handler.setLevel(logging.WARNING)
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
            root.addHandler(handler)


class ResponseSink:
    """A request's response sender as a scheduler Sink.

    Streaming: one response per step with the new text. Non-streaming: a single response with
    everything, carrying the final flag (so HTTP /generate works). Always ends with FINAL.
    """

    def __init__(self, pb, sender, encode, stream: bool, batched: bool, split_errors: bool = False,
                 wanted: frozenset[str] | None = None):
        self.pb, self.sender, self.encode = pb, sender, encode
        self.stream, self.batched = stream, batched
        self.wanted = wanted                      # the request's outputs (None: all we make)
        self.split_errors = split_errors
        self.last: StepOutput | None = None
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.failed = False
        self.closed = False
        self._lock = threading.Lock()

    def _tensors(self, out: StepOutput, text: str, whole: bool) -> list:
        arrays = self.encode(out, text, whole, self.ids)
        return tensors(self.pb, triton_io.with_batch_dim(arrays) if self.batched else arrays, self.wanted)

    def send(self, out: StepOutput) -> None:
        self.last = out
        self.ids.extend(out.new_ids)
        if self.stream:
            if out.text or out.finished or out.new_ids:
                self.sender.send(self.pb.InferenceResponse(output_tensors=self._tensors(out, out.text, False)))
        else:
            self.parts.append(out.text)

    def error(self, exc: Exception, internal: bool) -> None:
        """The error with the final flag; to a BLS caller (the `specdec` relay: `split_errors`)
        after data responses, the error and then the final flag on its own. On Triton 2.51 a BLS
        caller receives neither if an error response carries the final flag after data responses
        (and not the error in any case: the relay then reports a stream that ended without a
        finish), while a final flag sent apart from a first-response error keeps the caller's
        model alive until the server's exit timeout."""
        with self._lock:
            if self.closed:
                return
            self.failed = True
            if internal:
                log.error("request failed: %s", "".join(traceback.format_exception(exc)))
            final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if self.split_errors and self.last is not None:
                self.sender.send(error_response(self.pb, exc, internal))
                self.sender.send(flags=final)
            else:
                self.sender.send(error_response(self.pb, exc, internal), flags=final)
            self.closed = True

    def cancelled(self) -> bool:
        # never ask after the final flag: Triton 2.51 would look up the freed response factory
        return self.closed or self.sender.is_cancelled()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if not self.stream and self.last is not None and not self.failed:
                resp = self.pb.InferenceResponse(output_tensors=self._tensors(self.last, "".join(self.parts), True))
                self.sender.send(resp, flags=final)
            else:
                self.sender.send(flags=final)


def fail_request(pb, request, exc: Exception) -> None:
    """Answer a request that never reached the scheduler (bad input, overload) and end its stream."""
    sender = request.get_response_sender()
    internal = not isinstance(exc, (RequestError, Overloaded))
    if internal:
        log.error("request failed: %s", "".join(traceback.format_exception(exc)))
    sender.send(error_response(pb, exc, internal), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def request_inputs(request) -> dict:
    return {t.name(): t.as_numpy() for t in request.inputs()}


class TritonRegistry:
    """backend.metrics Registry over pb_utils.MetricFamily (Triton's metrics port)."""

    def __init__(self, pb):
        self.pb = pb
        self.families: dict[str, object] = {}

    def _family(self, name: str, description: str, kind):
        if name not in self.families:
            self.families[name] = self.pb.MetricFamily(name=name, description=description, kind=kind)
        return self.families[name]

    def counter(self, name, description, labels):
        return self._family(name, description, self.pb.MetricFamily.COUNTER).Metric(labels=labels)

    def gauge(self, name, description, labels):
        return self._family(name, description, self.pb.MetricFamily.GAUGE).Metric(labels=labels)

    def histogram(self, name, description, labels, buckets):
        return self._family(name, description, self.pb.MetricFamily.HISTOGRAM).Metric(
            labels=labels, buckets=[float(b) for b in buckets])

    def close(self) -> None:
        """Delete the families now, while the stub runs: each clears its metrics, so neither a
        family nor a metric has anything left to send when Python drops it at exit (where the
        stub's shared memory is gone: the shutdown segfault)."""
        self.families.clear()


class Service:
    """Decoder + continuous-batching scheduler + metrics behind the `generator` model instance,
    the one process of a server that holds the engines: token ids in (from `preprocessing`, the
    Dynamo worker) or text (from the `specdec` relay, the OpenAI front), per step the new text,
    cumulative ids, text offsets and the statistics (the prompt's token count among them) out. A
    request with `stop` = true stops the sequence named by `sequence_key`; a request beyond
    `max_queue_size` requests waiting to start is refused at once (UNAVAILABLE)."""

    def __init__(self, pb, args: dict):
        from backend.engine import make_decoder
        from backend.metrics import Metrics
        from backend.scheduler import Scheduler

        self.pb = pb
        cfg = serve_config(args)
        self.max_queue = int(model_parameters(args).get("max_queue_size", 256) or 256)
        self.decoder = make_decoder(cfg)
        self.registry = TritonRegistry(pb)
        self.metrics = Metrics(self.registry, {"model": args["model_name"]})
        path = self.decoder.target.kernel_path
        if path:
            self.metrics.on_kernel(path)
            log.info("target matmul path: %s", path)
        from backend.drafters.remote import RemoteDrafter

        for d in self.decoder.drafters.values():
            if isinstance(d, RemoteDrafter):                      # a draft node: count its calls
                d.on_call = self.metrics.on_remote_call
            if hasattr(d, "on_vocab"):                            # a draft with its own vocabulary
                d.on_vocab = self.metrics.on_vocab
        self.scheduler = Scheduler(self.decoder, cfg.max_batch, self.metrics)
        self._count = 0
        self.kv_events = None
        if os.environ.get(kv_events.ENV):              # a node behind a KV-aware router (scale-out)
            self.kv_events = kv_events.attach(getattr(self.decoder.target, "prefix_cache", None),
                                              os.environ[kv_events.ENV])

    def handle(self, request) -> None:
        pb = self.pb
        try:
            inputs = request_inputs(request)
            stop = triton_io.stop_key(inputs)
            if stop is not None:
                self.scheduler.stop(stop)
                request.get_response_sender().send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            parsed = triton_io.parse(inputs, triton_io.prompt_ids(inputs, self.decoder.tok), request.request_id(),
                                     context=self.decoder.target.max_seq_len)
            queued = self.scheduler.queued()
            if queued >= self.max_queue:
                raise Overloaded(f"{queued} requests are waiting to start (max_queue_size "
                                 f"{self.max_queue}); retry later")
        except Exception as exc:
            fail_request(pb, request, exc)
            return
        self._count += 1
        key = request.request_id() or f"seq-{self._count}"
        prompt_tokens = len(parsed.request.prompt_ids)

        def encode(out, text, whole, ids):
            arrays = triton_io.generator_outputs(out, ids, text, key, prompt_tokens)
            if whole:
                arrays[triton_io.TEXT_START][0] = 0
            return arrays
        sink = ResponseSink(pb, request.get_response_sender(), encode, parsed.stream, parsed.batched,
                            split_errors=key.startswith(triton_io.RELAY_KEY_PREFIX),
                            wanted=requested_outputs(request))
        self.scheduler.submit(parsed.request, sink, key)

    def close(self) -> None:
        self.scheduler.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.registry.close()
