"""A specdec node as an engine of NVIDIA Dynamo: `python -m backend.serve.dynamo.worker`.

One worker process per node, beside the node's tritonserver. It registers the node's model with
Dynamo as a token-in engine (`dynamo.common.backend.LLMEngine`; the frontend tokenizes with the
node's card, card.py), with the engine's context length and the prefix cache's block size, and
forwards each request to the node's `generator` model over Triton's HTTP `generate_stream` (token
ids in, cumulative token ids out: protocol.py), streaming the new ids back. The router learns
which node holds which prompt blocks from the generator's KV events (backend/kv_events.py), read
by Dynamo's own ZMQ source, and the load from this worker's snapshots (the blocks of the
sequences in flight here, the prefix cache's hit rate).

When Dynamo cancels a request (its client went away), the worker closes the request's Triton
connection and Triton cancels it: the generator frees the sequence at its next step. When the
node's tritonserver is gone (killed, crashed: a stream cut short and the server not ready), the
request fails as `EngineShutdown`, which Dynamo's frontend migrates: it re-sends the prompt with
the tokens produced so far to another node, which continues it exactly (the noise is keyed to
the sequence position). The worker then stops itself (SIGTERM: Dynamo's graceful shutdown,
which first takes the node out of discovery), so the router sends nothing more to a node that
cannot serve; whoever started it (`specdec serve`, launch.py) starts it again once the server
is back. A request the node refuses is Dynamo's `InvalidArgument` (a 400 naming the field);
an overloaded node's refusal is `WorkerUnavailable`.
Knows: Dynamo's engine contract, the generator's HTTP door. Does not know: decoding.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import urllib.request
from pathlib import Path

from backend import triton_io
from backend.manifest import EngineManifest
from backend.prefix_cache import BLOCK_TOKENS
from backend.request_schema import GENERATOR
from backend.serve.dynamo import install, protocol
from backend.serve.dynamo.card import write_card
from backend.serve.openai_triton import TritonFailure, TritonHTTP

install.importable()
from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig  # noqa: E402
from dynamo.common.backend.health_check import build_health_check_payload  # noqa: E402
from dynamo.common.backend.publisher import ComponentSnapshot, ZmqSource  # noqa: E402
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown, WorkerUnavailable  # noqa: E402

log = logging.getLogger("specdec.dynamo")
MODEL = GENERATOR
SNAPSHOT_S = 0.5            # how often the router's load signal is refreshed
DEFAULT_BATCH = 32          # the generator's max_active_batch when its config does not say


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m backend.serve.dynamo.worker", description=__doc__.split("\n")[0])
    ap.add_argument("--triton-url", required=True, help="the node's tritonserver HTTP host:port")
    ap.add_argument("--model-repository", required=True)
    ap.add_argument("--kv-events", default="", help="the generator's KV-event endpoint (tcp://host:port)")
    ap.add_argument("--model-name", default="specdec", help="the model name clients send")
    ap.add_argument("--namespace", default="specdec")
    ap.add_argument("--component", default="node")
    ap.add_argument("--discovery-backend", default="file", choices=["file", "etcd", "kubernetes", "mem"])
    ap.add_argument("--request-plane", default="tcp", choices=["tcp", "nats"])
    ap.add_argument("--event-plane", default="zmq", choices=["zmq", "nats"])
    return ap.parse_args(argv)


def max_batch(repo: Path) -> int:
    """The sequences the generator decodes at once (its model parameter max_active_batch)."""
    try:
        text = (repo / "generator" / "config.pbtxt").read_text()
    except OSError:
        return DEFAULT_BATCH
    m = re.search(r'key:\s*"max_active_batch"\s*value:\s*\{\s*string_value:\s*"(\d+)"', text)
    return int(m.group(1)) if m else DEFAULT_BATCH


def triton_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


class SpecdecEngine(LLMEngine):
    def __init__(self, args: argparse.Namespace, card: Path):
        from backend.builder.pipeline import ENGINE_SUBDIR

        self.args, self.card = args, card
        self.manifest = EngineManifest.load(Path(args.model_repository) / ENGINE_SUBDIR)
        self.max_batch = max_batch(Path(args.model_repository))
        self.triton: TritonHTTP | None = None
        self.inflight: dict[str, list[int]] = {}      # request id -> [prompt tokens, produced]
        self.hits = [0, 0]                            # prompt tokens cached, prompt tokens seen
        self.snapshots = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @classmethod
    async def from_args(cls, argv=None):
        from backend.builder.pipeline import ENGINE_SUBDIR

        args = parse_args(argv)
        card = write_card(Path(args.model_repository) / ENGINE_SUBDIR)
        config = WorkerConfig(namespace=args.namespace, component=args.component, endpoint="generate",
                              model_name=str(card), served_model_name=args.model_name,
                              discovery_backend=args.discovery_backend, request_plane=args.request_plane,
                              event_plane=args.event_plane)
        return cls(args, card), config

    @property
    def total_blocks(self) -> int:
        return self.max_batch * math.ceil(self.manifest.max_seq_len / BLOCK_TOKENS)

    async def start(self, worker_id: int) -> EngineConfig:
        while not triton_ready(self.args.triton_url):          # started after it is ready: a restart races
            await asyncio.sleep(0.5)
        self.triton = TritonHTTP(self.args.triton_url)
        await self.triton.open()
        self._tasks.append(asyncio.get_running_loop().create_task(self._publish_load()))
        log.info("node %s (Triton %s) registered as worker %s", self.args.model_name, self.args.triton_url, worker_id)
        return EngineConfig(model=str(self.card), served_model_name=self.args.model_name,
                            llm=LlmRegistration(context_length=self.manifest.max_seq_len,
                                                kv_cache_block_size=BLOCK_TOKENS, total_kv_blocks=self.total_blocks,
                                                max_num_seqs=self.max_batch))

    async def kv_event_sources(self):
        return [ZmqSource(endpoint=self.args.kv_events)] if self.args.kv_events else []

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher) -> None:
        self.snapshots = publisher

    async def health_check_payload(self):
        return build_health_check_payload(self.manifest.model.bos_token_id or 0)

    async def _publish_load(self) -> None:
        """The router's load signal: KV blocks of the sequences in flight here, and the prefix
        cache's hit rate (prompt tokens reused / prompt tokens, over this worker's requests)."""
        while True:
            await asyncio.sleep(SNAPSHOT_S)
            if self.snapshots is None:
                continue
            used = sum(math.ceil((p + n) / BLOCK_TOKENS) for p, n in self.inflight.values())
            rate = self.hits[0] / self.hits[1] if self.hits[1] else None
            self.snapshots.publish(0, ComponentSnapshot(kv_used_blocks=used, kv_total_blocks=self.total_blocks,
                                                        gpu_cache_usage=used / self.total_blocks, dp_rank=0,
                                                        kv_cache_hit_rate=rate))

    async def generate(self, request, context):
        try:
            fields = protocol.generator_fields(request)
        except protocol.Refused as exc:
            log.info("refused: %s", exc)
            raise InvalidArgument(str(exc)) from None
        rid = context.id() or str(id(request))
        stream = protocol.Stream(len(request["token_ids"]))
        self.inflight[rid] = [stream.prompt_tokens, 0]
        try:
            async with contextlib.aclosing(self.triton.events(MODEL, fields)) as events:
                async for event in events:
                    chunk = stream.chunk(event)
                    self.inflight[rid][1] = stream.sent
                    yield chunk
        except TritonFailure as exc:
            raise await self._failure(exc) from None
        finally:
            self.inflight.pop(rid, None)
        self.hits[0] += int(stream.stats.get("cached_prompt_tokens", 0))
        self.hits[1] += stream.prompt_tokens

    async def _failure(self, exc: TritonFailure) -> Exception:
        """A failed Triton request as Dynamo's error: the node's refusal, or the node is gone."""
        code = triton_io.error_code(exc.message)
        if code == "INVALID_ARG":
            return InvalidArgument(exc.message)
        if code == "UNAVAILABLE":
            return WorkerUnavailable(exc.message)
        if exc.unreachable or not await asyncio.to_thread(triton_ready, self.args.triton_url):
            self._leave(exc.message)
            return EngineShutdown(f"the node's tritonserver is gone ({exc.message})")
        return Unknown(exc.message)

    def _leave(self, why: str) -> None:
        """Take this node out of the deployment (Dynamo's graceful shutdown, on SIGTERM)."""
        if not self._stopping:
            self._stopping = True
            log.warning("the node's tritonserver at %s is gone (%s): leaving the deployment", self.args.triton_url, why)
            os.kill(os.getpid(), signal.SIGTERM)

    async def cleanup(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.triton is not None:
            await self.triton.close()
            self.triton = None


def main(argv=None) -> None:
    from dynamo.common.backend.run import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(SpecdecEngine, argv)


if __name__ == "__main__":
    main()
