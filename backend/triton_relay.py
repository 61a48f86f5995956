"""The `specdec` Triton model as a relay to `generator`, so a server holds one copy of the engines.

`specdec` takes text and streams text; `generator` (the ensemble's middle step) holds the engines,
the tokenizer, the scheduler and the metrics. For each request `specdec` opens a streaming BLS
request to `generator` with the same inputs and streams its text back (one response per step, or
all of it in one for a non-streaming request). So this process holds no engine and no tokenizer.
A client cancel becomes a `stop` request for the generator's sequence (the same path as the
ensemble's). BLS loses an error's code on Triton 2.51 (it arrives as INTERNAL), so the relay
restores it from the message: our client errors start with the input's name (`top_p: ...`),
overload with `unavailable:` (triton_io.error_code). Each request's thread is the only one that
touches its response sender; the BLS stream and the responses follow triton_glue's rules for
Triton 2.51 (only requested outputs, BLS iterators released late), and `close` (the model's
finalize) waits for every relay thread, so none runs on while the stub tears down.
Knows: BLS, the generator's tensors. Does not know: tokens, decoding.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time

import numpy as np

from backend import request_schema, triton_glue, triton_io

log = logging.getLogger("specdec.relay")

GENERATOR = request_schema.GENERATOR
# every input of `specdec` but `stream` (the relay always streams from the generator)
FORWARDED = tuple(f.name for f in request_schema.inputs_of(request_schema.SPECDEC) if f.name != "stream")


class TextRelay:
    def __init__(self, pb, args: dict):
        self.pb = pb
        self._keys = itertools.count()
        self._prefix = f"{triton_io.RELAY_KEY_PREFIX}{os.getpid()}-"
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def handle(self, request) -> None:
        try:
            inputs = triton_glue.request_inputs(request)
            stream, batched = triton_io.flags(inputs)
            wanted = triton_glue.requested_outputs(request)
        except Exception as exc:
            triton_glue.fail_request(self.pb, request, exc)
            return
        key = f"{self._prefix}{next(self._keys)}"
        thread = threading.Thread(target=self._run, args=(request, inputs, stream, batched, wanted, key),
                                  daemon=True, name=f"relay-{key}")
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the relay threads (Triton finalizes a model once its streams have ended, so
        they are past their final response), then drop the held BLS iterators."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.error("%d relay thread(s) still running at finalize: %s", len(alive), alive[:4])
        triton_glue.release_bls()

    def _run(self, *args) -> None:
        try:
            self._relay(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _generator_request(self, inputs: dict, key: str):
        pb = self.pb
        tensors = [pb.Tensor("stream", np.array([[True]]))]
        for name in FORWARDED:
            if name in inputs:
                tensors.append(pb.Tensor(name, np.asarray(inputs[name]).reshape(1, -1)))
        return pb.InferenceRequest(model_name=GENERATOR, inputs=tensors, request_id=key,
                                   requested_output_names=[triton_io.TEXT_OUTPUT, *triton_io.STAT_OUTPUTS])

    def _relay(self, request, inputs, stream: bool, batched: bool, wanted: frozenset[str], key: str) -> None:
        pb = self.pb
        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        parts, last, done, sent = [], None, False, False
        try:
            for resp in triton_glue.bls_stream(self._generator_request(inputs, key)):
                if done:
                    continue                                  # drain after a cancel or an error
                if resp.has_error():
                    msg = resp.error().message()
                    code = getattr(pb.TritonError, triton_io.error_code(msg))
                    sender.send(pb.InferenceResponse(error=pb.TritonError(msg, code)), flags=final)
                    done = sent = True                        # the generator's final flag follows
                    continue
                if sender.is_cancelled():
                    triton_glue.stop_generator(pb, key)
                    done = True
                    continue
                out = {t.name(): t.as_numpy() for t in resp.output_tensors()}
                if triton_io.TEXT_OUTPUT not in out:
                    continue                                  # the empty final response
                last = out
                if stream:
                    self._send(sender, out, batched, wanted)
                else:
                    parts.append(np.asarray(out[triton_io.TEXT_OUTPUT]).reshape(-1)[0].decode("utf-8"))
            if done:
                if not sent:
                    sender.send(flags=final)
            elif not triton_io.finished(last):
                # the generator ended the stream without a finish: an error it could not deliver
                # through BLS (see ResponseSink.error); never leave the client without one
                sender.send(pb.InferenceResponse(error=pb.TritonError(
                    "generator ended the stream without finishing it (an internal error: see the "
                    "server log)", pb.TritonError.INTERNAL)), flags=final)
            elif not stream and last is not None:
                last[triton_io.TEXT_OUTPUT] = np.array(["".join(parts).encode("utf-8")], np.object_)
                self._send(sender, last, batched, wanted, flags=final)
            else:
                sender.send(flags=final)
        except Exception as exc:
            log.exception("relay to %s failed", GENERATOR)
            sender.send(triton_glue.error_response(pb, exc, internal=True), flags=final)

    def _send(self, sender, out: dict, batched: bool, wanted: frozenset[str], flags: int = 0) -> None:
        arrays = triton_io.relay_outputs(out)
        arrays = triton_io.with_batch_dim(arrays) if batched else arrays
        sender.send(self.pb.InferenceResponse(output_tensors=triton_glue.tensors(self.pb, arrays, wanted)), flags=flags)
