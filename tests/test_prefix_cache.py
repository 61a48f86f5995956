"""The prefix cache (backend/prefix_cache.py, runtime/slot_blocks.py): the policy (hash chain,
LRU, pins, budget), the block copies on every slot layout, a suffix prefilled after a cached
prefix bitwise equal to the whole prompt's prefill, and output identical with the cache on and
off on the native and torch runtimes (greedy and seeded, alone and batched, every drafter with
state), under eviction and hostile prompts, and on the real tritonserver."""
from __future__ import annotations

import numpy as np
import pytest

from backend.config import DrafterKind, RuntimeOptions, SamplingParams, ServeConfig, SpecConfig
from backend.kv_slots import SlotTable
from backend.manifest import Device, WeightFormat
from backend.prefix_cache import PrefixCache, block_keys
from backend.runtime.slot_blocks import SlotBlocks
from backend.sequence import Request
from conftest import chain, device_env, run_batch, tiny_with_head

B = 16


class _TokenStore:
    """A BlockStorage whose 'KV' of a token is the token id: a load shows what was reused."""

    def __init__(self, nbytes: int = 100):
        self.nbytes, self.seqs, self.pool = nbytes, {}, None

    def block_bytes(self, block):
        return self.nbytes

    def allocate(self, capacity, block):
        self.pool = np.full((capacity, block), -1, np.int64)

    def save(self, seq_id, first, handles):
        for j, h in enumerate(handles):
            self.pool[h] = self.seqs[seq_id][(first + j) * B: (first + j + 1) * B]

    def load(self, seq_id, handles):
        self.seqs[seq_id] = np.concatenate([self.pool[h] for h in handles])


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


def _serve(cache, sid, tokens, hidden=None, need_hidden=False):
    """One sequence's life in the cache: attach, 'prefill' the rest, publish -> tokens reused."""
    hit = cache.attach(sid, tokens, need_hidden)
    if hit.tokens:
        assert cache.storage.seqs[sid].tolist() == list(tokens[: hit.tokens])    # the right KV
    cache.storage.seqs[sid] = np.asarray(tokens, np.int64)
    cache.publish(sid, tokens, hidden)
    return hit.tokens


def test_keys_chain_the_whole_prefix():
    a = _prompt(0, 5 * B)
    b = list(a)
    b[2 * B + 3] += 1                                               # block 2 differs
    ka, kb = block_keys(a, B), block_keys(b, B)
    assert len(ka) == 5 and ka[:2] == kb[:2] and not set(ka[2:]) & set(kb[2:])
    assert len(set(block_keys([7] * (8 * B), B))) == 8             # one block repeated: 8 keys
    assert block_keys(a, B, limit=2) == ka[:2] and block_keys(a[: 3 * B - 1], B) == ka[:2]


def test_reuse_leaves_the_last_token_to_prefill_and_stops_at_the_first_difference():
    cache = PrefixCache(_TokenStore(), 10_000, B)
    p = _prompt(1, 4 * B)
    assert _serve(cache, 0, p) == 0 and len(cache) == 4
    assert _serve(cache, 1, p) == 3 * B                             # not the last block: its last token
    assert _serve(cache, 2, p + [5]) == 4 * B
    q = p[:B] + [p[B] + 1] + p[B + 1:]
    assert _serve(cache, 3, q) == B
    st = cache.stats
    assert (st.lookups, st.hits, st.hit_tokens) == (4, 3, 3 * B + 4 * B + B)


def test_least_recently_used_leaves_go_first_and_pinned_blocks_never():
    cache = PrefixCache(_TokenStore(100), 100 * 4, B)              # room for 4 blocks
    a, b, c = _prompt(2, 2 * B + 1), _prompt(3, 2 * B + 1), _prompt(4, 2 * B + 1)
    _serve(cache, 0, a)
    _serve(cache, 1, b)
    assert _serve(cache, 2, a) == 2 * B                             # a is now the more recent
    _serve(cache, 3, c)                                             # evicts b (leaf first), not a
    assert cache.stats.evicted_blocks == 2 and cache.stats.bytes <= 400
    assert _serve(cache, 4, a) == 2 * B and _serve(cache, 5, b) == 0
    # pinned: a sequence that attached a's chain and has not published yet
    assert cache.attach(6, a).tokens == 2 * B
    for i in range(5):
        _serve(cache, 10 + i, _prompt(20 + i, 2 * B + 1))           # others come and go
    assert cache.stats.bytes <= 400
    hit = cache.attach(7, a)
    assert hit.tokens == 2 * B                                      # never evicted while pinned
    cache.release(6)
    cache.release(7)
    cache.attach(30, a)                                             # a pinned: 2 of 4 blocks
    p = _prompt(40, 4 * B + 1)
    cache.storage.seqs[31] = np.asarray(p)
    assert cache.publish(31, p) == 2                                # only what fits beside the pins
    assert cache.stats.bytes <= 400


def test_features_ride_along_and_a_lookup_that_needs_them_stops_where_they_end():
    cache = PrefixCache(_TokenStore(100), 100_000, B)
    p = _prompt(5, 3 * B + 2)
    _serve(cache, 0, p)                                              # published without features
    assert cache.attach(1, p, need_hidden=True).tokens == 0
    cache.release(1)
    h = np.random.default_rng(0).standard_normal((len(p), 4)).astype(np.float32)
    cache.storage.seqs[2] = np.asarray(p)
    cache.publish(2, p, h)                                           # fills them in
    hit = cache.attach(3, p, need_hidden=True)
    assert hit.tokens == 3 * B and np.array_equal(hit.hidden, h[: 3 * B])
    assert cache.stats.bytes == 3 * 100 + h[: 3 * B].nbytes


def _slot_arrays(xp, layout):
    rng = np.random.default_rng(0)
    if layout == "slots":           # native and torch: one [layers, 2, S + 1, Hkv, L, D]
        parts, axis = [rng.standard_normal((3, 2, 5, 2, 70, 4)).astype(np.float16)], 2
    else:                           # the engine runtime's executor: per layer K and V [S + 1, Hkv, L, D]
        parts, axis = [rng.standard_normal((5, 2, 70, 4)).astype(np.float32) for _ in range(4)], 0
    return ([xp(p) for p in parts], axis)


@pytest.mark.parametrize("layout", ["slots", "per-layer"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_block_copies_round_trip_on_every_slot_layout(layout, lib):
    xp = np.asarray if lib == "numpy" else pytest.importorskip("torch").from_numpy
    parts, axis = _slot_arrays(xp, layout)
    table = SlotTable(4, 70, 60)
    store = SlotBlocks(lambda: parts, axis, table)
    cache = PrefixCache(store, store.block_bytes(B) * 3, B)
    assert cache.capacity == 3 and store.block_bytes(B) == sum(int(p.nbytes) // (5 * 70) for p in parts) * B
    table.alloc(0)
    table.alloc(1)
    table.restore(0, 2 * B + 5)                    # as if prefilled: 2 full blocks and a bit
    tokens = _prompt(6, 2 * B + 5)
    cache.publish(0, tokens)
    assert cache.attach(1, tokens).tokens == 2 * B and table.length(1) == 2 * B
    pre = (slice(None),) * axis
    for p in parts:
        a = np.asarray(p[pre + (table.slot(0),)])[..., : 2 * B, :]
        assert np.array_equal(np.asarray(p[pre + (table.slot(1),)])[..., : 2 * B, :], a)


# --- engines -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target on the native kernel with a self-draft (self:1) and a random EAGLE head."""
    return tiny_with_head(tmp_path_factory.mktemp("tiny_prefix"), Device.CPU, (WeightFormat.GGUF,))


def _decoder(manifest, mb, fmt="gguf", chunk=512, **spec):
    from backend.engine import make_decoder

    return make_decoder(ServeConfig(engine_dir=str(manifest.root), weight_format=fmt, spec=SpecConfig(**spec),
                                    runtime=RuntimeOptions(max_sequences=6), prefix_cache_mb=mb, prefill_chunk=chunk))


SHARED = _prompt(7, 75)                                    # a "system prompt": 4 full blocks and a bit
QUESTIONS = [_prompt(8 + i, 5 + 3 * i) for i in range(3)]


def _prefill(dec, seq) -> list[int]:
    out = None
    while out is None:
        out = dec.prefill(seq)
    return list(out.new_ids)


def _generate(dec, prompt, kind, params):
    outs = list(dec.generate(Request(tuple(prompt), params, DrafterKind(kind))))
    return [t for o in outs for t in o.new_ids], outs[-1].cached_prompt_tokens


def test_a_suffix_after_a_cached_prefix_is_bitwise_the_whole_prompts_prefill(tiny):
    """The native kernel is batch invariant by construction: a token's logits and KV do not depend
    on how many tokens its forward carried, so the suffix prefilled after copied blocks gives
    the bits of the whole prompt at once (and of any prefill chunking)."""
    from backend.devices import load_runtime

    rt = load_runtime(tiny[0], "gguf", options=RuntimeOptions(max_sequences=4))
    cache = rt.enable_prefix_cache(1 << 22)
    ids = np.asarray(SHARED + QUESTIONS[0], np.int64)
    rt.alloc(0)
    whole = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None])
    logits, hidden = whole.logits[0].copy(), whole.hidden[0].copy()
    rt.commit([0], [np.arange(ids.size)])
    cache.publish(0, ids.tolist())
    rt.alloc(1)
    n = cache.attach(1, ids.tolist()).tokens
    assert n == 4 * B
    rest = ids[n:]
    out = rt.forward([1], rest[None], chain(rest.size), np.arange(rest.size)[None])
    assert np.array_equal(out.logits[0], logits[n:]) and np.array_equal(out.hidden[0], hidden[n:])
    rt.commit([1], [np.arange(rest.size)])
    slots = [rt.slots.slot(s) for s in (0, 1)]
    assert np.array_equal(rt.cache[:, :, slots[0], :, : ids.size], rt.cache[:, :, slots[1], :, : ids.size])
    rt.close()


@pytest.mark.parametrize("kind", ["none", "prompt-lookup", "draft-model", "eagle", "lookup+eagle"])
def test_greedy_output_is_identical_with_the_cache_on_and_off(tiny, kind):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    off = _decoder(tiny[0], 0, num_draft_tokens=3)
    on = _decoder(tiny[0], 64, chunk=24, num_draft_tokens=3)    # other prefill chunks too
    assert not on.prefix_stats()["target"].lookups and "target" not in off.prefix_stats()
    for q in QUESTIONS:
        ref, _ = _generate(off, SHARED + q, kind, params)
        got, cached = _generate(on, SHARED + q, kind, params)
        assert got == ref
    assert cached == 4 * B                                        # the later questions reused the prefix
    stats = on.prefix_stats()
    if kind in ("draft-model", "eagle", "lookup+eagle"):          # the drafter's own cache too
        own = stats["draft-model" if kind == "draft-model" else "eagle"]
        assert own.hits >= 1 and own.hit_tokens >= 4 * B, own


def test_seeded_and_greedy_requests_in_a_batch_are_identical_with_the_cache_on_and_off(tiny):
    def batch(dec):
        seqs = [dec.start(Request(tuple(SHARED + q), SamplingParams(temperature=0.9 if i < 2 else 0.0, top_p=0.95,
                                                                   max_tokens=20, seed=11 + i, ignore_eos=True),
                                  DrafterKind(k)))
                for i, (q, k) in enumerate(zip(QUESTIONS, ("draft-model", "eagle", "prompt-lookup")))]
        return run_batch(dec, seqs), [s.cached_prompt_tokens for s in seqs]

    off, on = _decoder(tiny[0], 0, num_draft_tokens=3), _decoder(tiny[0], 64, num_draft_tokens=3)
    ref, _ = batch(off)
    first, _ = batch(on)
    again, cached = batch(on)
    assert first == ref and again == ref
    assert cached == [(len(SHARED + q) - 1) // B * B for q in QUESTIONS]     # their whole prompts now


def test_eviction_under_a_tiny_budget_and_mid_flight_changes_nothing(tiny):
    """A budget of a few blocks: distinct long prompts and a prompt of one repeated block keep the
    cache within it; a request whose cached prefix is evicted while it decodes is unaffected."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    off = _decoder(tiny[0], 0)
    on = _decoder(tiny[0], 0.05)                                  # 52 kB: a few blocks of this model
    cache = on.target.prefix_cache
    assert 2 <= cache.capacity <= 8, cache.capacity
    hostile = [_prompt(50 + i, 120) for i in range(4)] + [[9] * 160]
    for p in hostile:
        assert _generate(on, p, "prompt-lookup", params)[0] == _generate(off, p, "prompt-lookup", params)[0]
        assert cache.stats.bytes <= cache.budget
    assert cache.stats.evicted_blocks > 0
    ref = _generate(off, SHARED + QUESTIONS[1], "none", params)[0]
    _generate(on, SHARED + QUESTIONS[0], "none", params)          # caches the prefix
    seq = on.start(Request(tuple(SHARED + QUESTIONS[1]), params, DrafterKind.NONE))
    got = _prefill(on, seq)
    assert seq.cached_prompt_tokens > 0
    cache.clear()                                                 # its blocks go mid-flight ...
    for p in hostile[:2]:
        _generate(on, p, "none", params)                          # ... and others take their place
    while not seq.finished:
        got += on.step([seq])[0].new_ids
    on.finish(seq)
    assert got == ref


def test_metrics_count_lookups_hits_and_bytes(tiny):
    from backend.metrics import MemoryRegistry, Metrics
    from backend.scheduler import Scheduler

    class Sink:
        def __init__(self):
            self.outs = []

        def send(self, out):
            self.outs.append(out)

        def error(self, exc, internal):
            raise exc

        def cancelled(self):
            return False

        def close(self):
            pass

    reg = MemoryRegistry()
    sched = Scheduler(_decoder(tiny[0], 64), metrics=Metrics(reg, {"model": "generator"}), start=False)
    sinks = [Sink(), Sink()]
    for s in sinks:
        sched.submit(Request(tuple(SHARED + QUESTIONS[0]), SamplingParams(max_tokens=4)), s)
        while sched.has_work():
            sched.iterate()
    assert sinks[0].outs[-1].cached_prompt_tokens == 0 and sinks[1].outs[-1].cached_prompt_tokens == 4 * B
    value = lambda name: reg.metrics[(name, (("engine", "target"), ("model", "generator")))].value
    assert value("specdec_prefix_cache_lookups_total") == 2 and value("specdec_prefix_cache_hits_total") == 1
    assert value("specdec_prefix_cache_hit_tokens_total") == 4 * B
    assert value("specdec_prefix_cache_lookup_tokens_total") == 2 * len(SHARED + QUESTIONS[0])
    assert 0 < value("specdec_prefix_cache_bytes") <= value("specdec_prefix_cache_capacity_bytes")
    heap = {k: reg.metrics[("specdec_heap_bytes", (("kind", k), ("model", "generator")))].value
            for k in ("in_use", "held")}                      # published as the scheduler went idle
    assert 0 < heap["in_use"] <= heap["held"], heap
    assert reg.metrics[("specdec_python_blocks", (("model", "generator"),))].value > 0
    sched.close()


def test_heap_bytes_sees_live_allocations():
    """The leak gauge's reading (the soak's test asks it to stay flat): 64 MiB held by numpy
    shows in `in_use`, and freed it goes."""
    from backend.metrics import heap_bytes, trim_heap

    before = heap_bytes()["in_use"]
    buf = np.ones(64 << 20, np.uint8)
    during = heap_bytes()["in_use"]
    del buf
    trim_heap()
    after = heap_bytes()["in_use"]
    assert during - before >= 63 << 20 and during - after >= 63 << 20, (before, during, after)


def test_the_torch_runtime_reuses_prefixes_exactly(tiny, tmp_path):
    """The torch runtime (here on the CPU, attention by the kernels' numpy reference): the same
    storage code over its slot tensor; output identical with the cache on and off."""
    pytest.importorskip("torch")
    from backend.builder.pipeline import BuildConfig, build

    m = build(BuildConfig(target=str(tiny[1]), output=tmp_path / "repo", device=Device.CUDA,
                          weights=(WeightFormat.FP32,), drafts=("self:1",), quiet=True, measure_costs=False))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    off, on = _decoder(m, 0, "fp32", num_draft_tokens=3), _decoder(m, 64, "fp32", chunk=32, num_draft_tokens=3)
    for q, kind in zip(QUESTIONS[:2], ("draft-model", "none")):
        ref = _generate(off, SHARED + q, kind, params)[0]
        _generate(on, SHARED + QUESTIONS[2], kind, params)
        got, cached = _generate(on, SHARED + q, kind, params)
        assert got == ref and cached == 4 * B


def test_the_engine_runtime_reuses_prefixes_exactly(tiny, tmp_path):
    """The TensorRT engine runtime's slots (here the engine graph on ONNX Runtime, its plugin ops
    by their references): the same storage code over the executor's per-layer caches; a suffix
    after a cached prefix gives the whole prompt's bits (the decoder's side is the native one's)."""
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices import load_runtime

    mp = device_env("tensorrt")
    try:
        m = build(BuildConfig(target=str(tiny[1]), output=tmp_path / "repo", device=Device.TENSORRT,
                              weights=(WeightFormat.FP32,), quiet=True, measure_costs=False))
        rt = load_runtime(m, "fp32", options=RuntimeOptions(max_sequences=2))
        cache = rt.enable_prefix_cache(1 << 22)
        ids = np.asarray(SHARED + QUESTIONS[0], np.int64)
        rt.alloc(0)
        whole = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None]).logits[0].copy()
        rt.commit([0], [np.arange(ids.size)])
        cache.publish(0, ids.tolist())
        rt.alloc(1)
        n = cache.attach(1, ids.tolist()).tokens
        rest = ids[n:]
        out = rt.forward([1], rest[None], chain(rest.size), np.arange(rest.size)[None]).logits[0]
        assert n == 4 * B and np.array_equal(out, whole[n:])
        rt.close()
    finally:
        mp.undo()


def test_a_second_request_with_the_same_system_prompt_reuses_it_on_tritonserver(tiny, tmp_path):
    """The real server: the second of two requests with the same long system prompt reports
    cached_prompt_tokens and streams the text of the cache off (offline decoding without it)."""
    pytest.importorskip("tritonclient.grpc")
    from backend.serve import client as spclient
    from backend.serve.launcher import TritonServer

    m, _, repo = tiny
    system = " ".join(f"rule {i}: answer x{i * 7}" for i in range(12))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hello world"}]
    dec = _decoder(m, 0)
    ids = dec.tok.encode(dec.tok.apply_chat_template(messages))
    assert len(ids) > 2 * B
    expected = "".join(o.text for o in dec.generate(Request(tuple(ids), SamplingParams(max_tokens=16))))
    import json

    fields = {"text_input": json.dumps(messages), "apply_chat_template": True, "max_tokens": 16, "stream": True}
    srv = TritonServer(repo, log_file=tmp_path / "server.log", log_verbose=0)
    srv.start()
    try:
        got = []
        for model in ("specdec", "ensemble"):
            chunks = []
            stats = spclient.stream_grpc(srv.grpc_url, model, fields, chunks.append)
            got.append(("".join(chunks), int(stats["cached_prompt_tokens"])))
    finally:
        assert srv.stop() == 0
    assert got[0] == (expected, 0)
    assert got[1][0] == expected and got[1][1] == (len(ids) - 1) // B * B > 0
