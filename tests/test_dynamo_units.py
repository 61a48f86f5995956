"""Scale-out's parts that need no server (docs/scale-out.md): a request continued from its
output so far (what Dynamo's migration re-sends) finishes exactly as the uninterrupted one,
greedy and seeded; the prefix cache tells a listener every block it keeps and lets go, once; the
KV events go out in vLLM's format, and a late subscriber is told what is held."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backend.config import DrafterKind, SamplingParams
from backend.kv_events import ZmqBlockEvents, block_hash, tokens_of
from backend.prefix_cache import PrefixCache, block_keys
from test_decoder_toy import PROMPT, make, run
from test_prefix_cache import B, _prompt, _serve, _TokenStore


@pytest.mark.parametrize("kind", [DrafterKind.NONE, DrafterKind.PROMPT_LOOKUP, DrafterKind.DRAFT_MODEL])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_request_continued_from_its_output_so_far_finishes_identically(kind, temperature):
    """Dynamo's migration re-sends the prompt with the tokens produced appended and max_tokens
    lowered by as many: the noise is keyed to the sequence position, so the rest is the same."""
    params = SamplingParams(temperature=temperature, top_k=5, max_tokens=40, seed=11)
    whole, _ = run(make(3, 2), kind, params)
    assert len(whole) == 40
    for cut in (1, 7, 23):
        rest, _ = run(make(3, 2), kind, dataclasses.replace(params, max_tokens=40 - cut), PROMPT + tuple(whole[:cut]))
        assert whole[:cut] + rest == whole, cut


class _Mirror:
    """A BlockEvents listener that keeps what it was told, as a router would."""

    def __init__(self):
        self.held: dict[bytes, tuple[bytes | None, bytes]] = {}

    def stored(self, parent, blocks):
        for key, raw in blocks:
            assert key not in self.held, "a block announced twice"
            assert parent is None or parent in self.held, "a block announced before its parent"
            self.held[key] = (parent, raw)
            parent = key

    def removed(self, keys):
        for key in keys:
            assert key in self.held, "an eviction of a block never announced"
            del self.held[key]


def test_the_listener_hears_each_block_kept_and_evicted_once():
    cache = PrefixCache(_TokenStore(100), 100 * 12, B)               # room for 12 blocks
    cache.events = mirror = _Mirror()
    rng = np.random.default_rng(0)
    bases = [_prompt(s, 5 * B) for s in range(6)]
    for i in range(200):                       # shared prefixes, different tails, evictions
        base = bases[int(rng.integers(len(bases)))]
        tokens = base[: int(rng.integers(1, 5 * B))] + _prompt(1000 + i, int(rng.integers(0, 3 * B)))
        _serve(cache, i, tokens)
    assert cache.stats.evicted_blocks > 20
    assert set(mirror.held) == set(cache._lru)
    for key, (parent, raw) in mirror.held.items():
        e = cache._lru[key]
        assert raw == e.tokens and parent == (e.parent if parent is not None else None)
    cache.clear()
    assert mirror.held == {}


def _receive(sub, timeout_s=5.0) -> list:
    import msgspec
    import zmq

    assert sub.poll(int(timeout_s * 1000), zmq.POLLIN), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"" and len(seq) == 8
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    return events


def test_events_go_out_in_vllm_format_and_a_late_subscriber_is_told_what_is_held():
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    cache = PrefixCache(_TokenStore(100), 100 * 3, B)                 # room for 3 blocks
    pub = ZmqBlockEvents("tcp://127.0.0.1:*", B)
    cache.events = pub
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        assert _receive(sub) == [["AllBlocksCleared"]]               # joined: a clean slate
        a = _prompt(1, 2 * B + 1)
        _serve(cache, 0, a)
        (stored,) = _receive(sub)
        keys = block_keys(a, B)
        assert stored == ["BlockStored", [block_hash(k) for k in keys], None, a[: 2 * B], B, None, None]
        assert all(0 <= h < 2 ** 64 for h in stored[1])
        _serve(cache, 1, _prompt(2, 2 * B + 1))                       # 2 blocks in, 1 of a's out (its leaf)
        events = _receive(sub)
        while len(events) < 2:
            events += _receive(sub)
        b = block_keys(_prompt(2, 2 * B + 1), B)                    # evicted while b's blocks went in: told first
        assert events == [["BlockRemoved", [block_hash(keys[1])], None],
                          ["BlockStored", [block_hash(k) for k in b], None, _prompt(2, 2 * B), B, None, None]]
        late = ctx.socket(zmq.SUB)
        late.setsockopt(zmq.SUBSCRIBE, b"")
        late.connect(pub.endpoint)
        try:
            replay = _receive(late)
            assert replay[0] == ["AllBlocksCleared"]
            told = {h for e in replay[1:] for h in e[1]}
            assert told == {block_hash(k) for k in cache._lru}
            first = next(e for e in replay[1:] if e[1] == [block_hash(keys[0])])
            assert first[2] is None and first[3] == tokens_of(cache._lru[keys[0]].tokens)
        finally:
            late.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.close()


def test_a_dynamo_request_becomes_the_generators_inputs_and_what_cannot_be_honoured_is_refused():
    from backend.serve.dynamo.protocol import Refused, generator_fields

    req = {"token_ids": [1, 2, 3], "annotations": ["drafter:prompt-lookup", "num_draft_tokens:4", "other:x"],
           "sampling_options": {"temperature": 0.7, "top_k": -1, "top_p": 0.9, "min_p": 0.05, "seed": 9,
                                "presence_penalty": 0, "repetition_penalty": 1, "n": 1},
           "stop_conditions": {"max_tokens": 12, "ignore_eos": True, "stop_token_ids_hidden": [2]},
           "output_options": {"logprobs": None}}
    assert generator_fields(req) == {"input_ids": [1, 2, 3], "stream": True, "temperature": 0.7, "top_p": 0.9,
                                     "min_p": 0.05, "top_k": 0, "random_seed": 9, "max_tokens": 12, "end_id": -1,
                                     "drafter": "prompt-lookup", "num_draft_tokens": 4}
    assert generator_fields({"token_ids": [5]})["temperature"] == 1.0          # OpenAI's default, as our door's
    for bad, field in ((dict(req, sampling_options={"presence_penalty": 0.5}), "presence_penalty"),
                       (dict(req, sampling_options={"n": 2}), "n"),
                       (dict(req, output_options={"logprobs": 3}), "logprobs"),
                       (dict(req, stop_conditions={"min_tokens": 4}), "min_tokens"),
                       (dict(req, stop_conditions={"stop_token_ids": [7]}), "stop_token_ids"),
                       (dict(req, annotations=["num_draft_tokens:four"]), "num_draft_tokens"),
                       (dict(req, token_ids=[]), "token_ids")):
        with pytest.raises(Refused, match=field):
            generator_fields(bad)


def test_the_generators_responses_become_new_token_chunks_and_a_last_one_with_usage():
    from backend.serve.dynamo.protocol import Stream

    s = Stream(prompt_tokens=10)
    assert s.chunk({"output_ids": 198, "finish_reason": ""}) == {"token_ids": [198], "index": 0}   # a bare 1-element tensor
    assert s.chunk({"output_ids": [198, 5, 6], "finish_reason": ""}) == {"token_ids": [5, 6], "index": 0}
    last = s.chunk({"output_ids": [198, 5, 6, 7], "finish_reason": "length", "output_token_count": 4,
                    "cached_prompt_tokens": 8})
    assert last == {"token_ids": [7], "index": 0, "finish_reason": "length",
                    "completion_usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                                         "prompt_tokens_details": {"cached_tokens": 8}}}


@pytest.mark.parametrize("flags, says", [(["--nodes", "-1"], "--nodes must be >= 0"),
                                         (["--nodes", "2", "--dynamo-node"], "choose one"),
                                         (["--dynamo-node", "--dynamo-frontend"], "choose one"),
                                         (["--nodes", "2", "--migration-limit", "-1"], "--migration-limit")])
def test_scale_out_flags_that_make_no_sense_are_one_line_and_exit_2(flags, says, tmp_path, capsys):
    from backend.cli import main

    assert main(["serve", "--model-repository", str(tmp_path / "none"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec serve: error:") and says in err and "\n" not in err
    assert not (tmp_path / "none").exists()                     # refused before anything was built


def test_nodes_started_at_once_join_one_file_store(monkeypatch):
    """Nodes start on threads of their own (`specdec serve --nodes N`, scale_out.py): each asks the
    deployment for its environment at once, and every one must name the same discovery store (a
    store chosen lazily gave two racing nodes two, and a frontend that saw 1 of 2 workers)."""
    from concurrent.futures import ThreadPoolExecutor

    from backend.serve.dynamo.launch import Deployment

    monkeypatch.delenv("DYN_FILE_KV", raising=False)
    d = Deployment()
    with ThreadPoolExecutor(8) as pool:
        stores = set(pool.map(lambda _: d.env()["DYN_FILE_KV"], range(64)))
    assert stores == {str(d.store)} and d.store.is_dir(), stores
    monkeypatch.setenv("DYN_FILE_KV", str(d.store))
    assert Deployment().store == d.store                     # joining a deployment on this machine
