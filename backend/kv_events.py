"""The prefix cache's blocks published as KV events in vLLM's format over ZMQ, for KV-aware routers.

vLLM's KV-event stream (vllm/distributed/kv_events.py) is what NVIDIA Dynamo's ZMQ source
(`ZmqSource`, lib/kv-router/src/zmq_listener.rs) and llm-d's precise prefix scorer read, so one
publisher serves both. A message is three ZMQ frames: topic, an 8-byte big-endian sequence
number, and a msgpack batch `[timestamp, [event, ...], data_parallel_rank]` whose events are
tagged arrays:

    ["BlockStored", [hash, ...], parent_hash | None, [token, ...], block_size, lora_id, medium]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

A block's hash is the first 8 bytes of its prefix-cache key (backend/prefix_cache.py: a hash of
the whole prefix up to the block's end), as an unsigned 64-bit integer; the router hashes the
tokens itself, our hashes only link a block to its parent and name it when it is removed.

The socket is an XPUB bound by the model process: when a subscriber joins (a Dynamo worker
started or restarted, a router replica), it is sent `AllBlocksCleared` and then every block held,
parents first, so a late subscriber knows what an earlier one was told (a PUB socket would drop
everything sent before the subscription). The cache calls `stored` / `removed` from the
scheduler's thread; a thread of this module owns the socket, so the scheduler never waits on it.
Knows: the event format, ZMQ. Does not know: models, requests, Dynamo.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time

log = logging.getLogger("specdec.kv_events")

ENV = "SPECDEC_KV_EVENTS"       # the endpoint a model process binds (the launcher sets it)
FLUSH_S = 0.02                  # events of one scheduler step go out as one batch


def block_hash(key: bytes) -> int:
    """A prefix-cache key as the u64 hash of the event stream."""
    return int.from_bytes(key[:8], "big")


def tokens_of(raw: bytes) -> list[int]:
    """A block's token ids (int64 bytes, as the cache keeps them) as a list."""
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def stored_event(parent: bytes | None, blocks: list[tuple[bytes, bytes]], block_size: int) -> list:
    tokens = [t for _, raw in blocks for t in tokens_of(raw)]
    return ["BlockStored", [block_hash(k) for k, _ in blocks], None if parent is None else block_hash(parent),
            tokens, block_size, None, None]


def removed_event(keys: list[bytes]) -> list:
    return ["BlockRemoved", [block_hash(k) for k in keys], None]


CLEARED = ["AllBlocksCleared"]


def encode_batch(events: list, rank: int = 0) -> bytes:
    import msgspec

    return msgspec.msgpack.encode([time.time(), events, rank])


class ZmqBlockEvents:
    """A prefix cache's `events` listener publishing on an XPUB socket bound at `endpoint`."""

    def __init__(self, endpoint: str, block_size: int, topic: bytes = b""):
        import zmq

        self.block_size, self.topic = block_size, topic
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)        # every subscription, also a repeated one
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: collections.OrderedDict[bytes, tuple[bytes | None, bytes]] = collections.OrderedDict()
        self._seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="specdec-kv-events", daemon=True)
        self._thread.start()

    # --- the cache's side (BlockEvents) ----------------------------------------------------
    def stored(self, parent: bytes | None, blocks: list[tuple[bytes, bytes]]) -> None:
        self._queue.put(("stored", parent, blocks))

    def removed(self, keys: list[bytes]) -> None:
        self._queue.put(("removed", None, keys))

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        self._sock.close(linger=0)

    # --- the socket's thread ---------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        while self._running:
            try:
                if self._sock.poll(int(FLUSH_S * 1000), zmq.POLLIN):
                    self._on_subscriptions()
                self._flush()
            except Exception:                       # never let the publisher die: log and go on
                log.exception("publishing KV events failed")

    def _on_subscriptions(self) -> None:
        """A subscriber joined (`\\x01` + topic): tell everyone what is held, from a clean slate."""
        import zmq

        joined = False
        while self._sock.poll(0, zmq.POLLIN):
            joined |= self._sock.recv()[:1] == b"\x01"
        if joined:
            self._flush()                             # what is queued first, then the state
            held = [stored_event(parent, [(key, raw)], self.block_size) for key, (parent, raw) in self._held.items()]
            self._send([CLEARED, *held])

    def _flush(self) -> None:
        events = []
        while True:
            try:
                kind, parent, items = self._queue.get_nowait()
            except queue.Empty:
                break
            if kind == "stored":
                events.append(stored_event(parent, items, self.block_size))
                for key, raw in items:
                    self._held[key] = (parent, raw)
                    parent = key
            else:
                events.append(removed_event(items))
                for key in items:
                    self._held.pop(key, None)
        if events:
            self._send(events)

    def _send(self, events: list) -> None:
        self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), encode_batch(events)])
        self._seq += 1


def attach(cache, endpoint: str) -> ZmqBlockEvents | None:
    """Publish `cache`'s blocks at `endpoint` (None, with a warning, where there is no cache)."""
    if cache is None:
        log.warning("%s=%s: this engine has no prefix cache, so no KV events are published", ENV, endpoint)
        return None
    events = ZmqBlockEvents(endpoint, cache.block)
    cache.events = events
    log.info("publishing KV events (vLLM format) on %s", events.endpoint)
    return events
