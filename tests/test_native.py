"""The native CPU engine (`--weights gguf`: our C decode step over the GGUF's own blocks): the
kernel against its numpy reference, row invariance by construction, a tiny build's logits
against transformers, batch invariance measured by the build, and the losslessness tests every
runtime passes (greedy identity for each drafter, seeded sampling equal to plain sampling)."""
from pathlib import Path

import numpy as np
import pytest

from backend.manifest import Device, WeightFormat
from conftest import assert_seeded_sampling_matches_plain, assert_spec_is_plain, chain, spec_decoder, tiny_with_head

native = pytest.importorskip("backend.runtime.native")


def _random_blocks(kind, n, k, rng):
    d = (rng.uniform(0.002, 0.02, (n, k // 32))).astype(np.float16).view(np.uint16)
    if kind == "q4":
        m = (-8 * rng.uniform(0.002, 0.02, (n, k // 32))).astype(np.float16).view(np.uint16)
        return d, m, rng.integers(0, 16, (n, k)).astype(np.uint8)
    return d, None, rng.integers(-128, 128, (n, k)).astype(np.int8)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_blocked_matmul_matches_reference_and_rows_are_independent(kind):
    from backend.devices.native.export import repack
    from plugins.reference import blocked_matmul_ref

    rng = np.random.default_rng(1)
    n, k = 44, 96                                     # 44: the last group of 16 is padding
    d, m, ints = _random_blocks(kind, n, k, rng)
    data = repack(kind, d, m, ints)
    x = rng.standard_normal((9, k)).astype(np.float32)
    x[3, :32] = 0.0                                   # an all-zero block: scale 0
    y = native.blocked_matmul(kind, data, data.shape[0] * 16, k, x, threads=2)[:, :n]
    ref = blocked_matmul_ref(kind, d.view(np.float16), None if m is None else m.view(np.float16), ints, x)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(y - ref).max()
    # a row's bits do not depend on the other rows, their number, or the thread count
    for r in (0, 4, 8):
        alone = native.blocked_matmul(kind, data, data.shape[0] * 16, k, x[r:r + 1], threads=1)[0, :n]
        assert np.array_equal(alone, y[r])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_with_head(tmp_path_factory.mktemp("tiny_native"), Device.CPU, (WeightFormat.GGUF, WeightFormat.FP32))


def test_build_logits_and_invariance(tiny):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from backend.devices import load_runtime

    m, ckpt, repo = tiny
    ef = m.engine("gguf")
    assert ef.batch_invariant is True and m.default_format is WeightFormat.GGUF
    assert ef.weight_bytes_per_token < m.engine("fp32").weight_bytes_per_token / 3     # 8-bit blocks
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, m.model.vocab_size, 29)
    with torch.no_grad():
        ref = hf(torch.tensor([ids.tolist()])).logits[0].numpy()
    rt = load_runtime(m, "gguf")
    rt.alloc(0)
    out = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None])
    # float weights become Q8_0 blocks and activations int8 blocks: close, not equal
    assert np.abs(out.logits[0] - ref).max() / np.abs(ref).max() < 0.05
    assert (out.logits[0].argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    rt.close()


@pytest.mark.parametrize("kind", ["prompt-lookup", "draft-model", "eagle", "lookup+eagle"])
def test_greedy_speculation_is_identical_to_plain(tiny, kind, plain_tokens):
    assert_spec_is_plain(plain_tokens, tiny[0], "gguf", kind, num_draft_tokens=4)


def test_seeded_sampling_matches_plain(tiny):
    assert_seeded_sampling_matches_plain(spec_decoder(tiny[0], "gguf", num_draft_tokens=3))


def test_ragged_rows_match_rows_alone_and_padding_is_not_computed(tiny):
    """Rows of one forward with different node counts (PAD_PARENT padding after a row's nodes):
    every real node's logits and features are bitwise those of its row run alone; padding nodes
    read zero (they are skipped, not computed)."""
    from backend.kv_cache import PAD_PARENT
    from backend.devices import load_runtime

    m = tiny[0]
    rt = load_runtime(m, "gguf")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, m.model.vocab_size, n) for n in (19, 7)]
    new = rng.integers(3, m.model.vocab_size, (2, 4))
    parents = np.array([[-1, 0, 1, 1], [-1, 0, PAD_PARENT, PAD_PARENT]], np.int32)   # a tree; a chain of 2
    alone = []
    for sid, (p, ids, par) in enumerate(zip(prompts, new, parents)):
        rt.alloc(sid)
        rt.forward([sid], p[None], chain(p.size), np.array([[p.size - 1]]))
        rt.commit([sid], [np.arange(p.size)])
        n = int((par != PAD_PARENT).sum())
        out = rt.forward([sid], ids[None, :n], par[None, :n], np.arange(n)[None])
        alone.append((out.logits[0].copy(), out.hidden[0].copy()))
        rt.commit([sid], [np.zeros(0, np.int64)])
    out = rt.forward([0, 1], new, parents, np.broadcast_to(np.arange(4), (2, 4)).copy())
    for r, (logits, hidden) in enumerate(alone):
        n = logits.shape[0]
        assert np.array_equal(out.logits[r, :n], logits) and np.array_equal(out.hidden[r, :n], hidden), r
    assert not out.logits[1, 2:].any() and not out.hidden[1, 2:].any()
    rt.close()


def test_an_eagle_entry_written_before_its_shape_was_recorded_loads_the_same(tiny):
    """A manifest whose EAGLE entry lacks the head's description (built before the build wrote
    it) loads the head with the shape the build records today (ModelConfig.eagle_head)."""
    from dataclasses import replace

    from backend.devices import load_runtime

    m, _, _ = tiny
    d = m.drafts["eagle"]
    old = m.with_updates(drafts={**m.drafts, "eagle": replace(d, model=None)})
    assert d.model is not None and load_runtime(old, engine="eagle").config == d.model


def test_eagle_head_on_the_native_kernel_agrees_with_its_onnx_export(tiny, tmp_path):
    """With gguf serving, the build puts the EAGLE head on the native kernel too (Q8_0 blocks,
    int8 activations): its draft-vocabulary argmax agrees with the float ONNX head's."""
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.buildlib.heads.eagle import export_eagle_head
    from backend.devices import load_runtime
    from backend.runtime.ort import OrtRuntime

    m, ckpt, _ = tiny
    d = m.drafts["eagle"]
    assert d.weights == "gguf" and d.path.endswith(".bin")
    path, _, cfg = export_eagle_head(Path(d.source), load_checkpoint(ckpt), tmp_path, m.max_seq_len)
    assert d.model == cfg and cfg.vocab_size == d.draft_vocab_size    # the build recorded the head's shape
    rng = np.random.default_rng(2)
    t = 17
    toks = rng.integers(3, m.model.vocab_size, (1, t))
    feats = rng.standard_normal((1, t, m.model.hidden_size)).astype(np.float32)
    outs = []
    for rt in (load_runtime(m, engine="eagle"), OrtRuntime(path, cfg, 1, m.max_seq_len)):
        rt.alloc(0)
        outs.append(rt.forward([0], toks, chain(t), np.arange(t)[None], {"features": feats}).logits[0].copy())
        rt.close()
    native, onnx = outs
    assert (native.argmax(-1) == onnx.argmax(-1)).mean() >= 0.8
    assert np.abs(native - onnx).max() <= 0.1 * np.abs(onnx).max()


def test_the_ctypes_boundary_refuses_what_would_write_out_of_bounds(tiny):
    """Slot indices, columns, positions, ids, feature shapes and a closed runtime are checked
    before the kernel writes (forward.c check_step, NativeRuntime._check_shapes): a Python error,
    never a write past a buffer, and the runtime serves on (issue 31)."""
    from backend.devices import load_runtime

    m = tiny[0]
    rt = load_runtime(m, "gguf")
    ids = np.arange(3, 10)[None]
    rt.alloc(0)
    seq = rt.slots._seqs[0]
    for field, bad, error in (("slot", rt.capacity + 3, IndexError), ("length", rt.columns + 5, (IndexError, ValueError))):
        good = getattr(seq, field)
        setattr(seq, field, bad)                          # a corrupted slot table
        with pytest.raises(error):
            rt.forward([0], ids, chain(ids.size), np.array([[ids.size - 1]]))
        setattr(seq, field, good)
    with pytest.raises(IndexError, match="input id"):
        rt.forward([0], np.array([[3, m.model.vocab_size + 10 ** 6]]), chain(2), np.array([[1]]))
    out = rt.forward([0], ids, chain(ids.size), np.array([[ids.size - 1]]))
    assert np.isfinite(out.logits).all()                  # the table repaired, the runtime serves
    rt.close()
    with pytest.raises(RuntimeError, match="after close"):
        rt.forward([0], ids, chain(ids.size), np.array([[0]]))
    head = load_runtime(m, engine="eagle")
    head.alloc(0)
    with pytest.raises(ValueError, match="features"):
        head.forward([0], ids, chain(ids.size), np.array([[0]]),
                     {"features": np.zeros((1, ids.size, m.model.hidden_size * 3), np.float32)})
    head.close()


def test_close_waits_for_a_forward_in_flight(tiny):
    """A server stopping mid-step: close() frees the KV cache only after the forward running on
    another thread has returned (before, the kernel wrote into the freed cache: ASan's
    heap-use-after-free, perf-notes §14)."""
    import threading
    import time

    from backend.devices import load_runtime

    rt = load_runtime(tiny[0], "gguf")
    rt.alloc(0)
    entered, events = threading.Event(), []

    class SlowLib:                                   # the kernel, entered and then slow
        def __init__(self, lib):
            self.lib = lib

        def sd_forward(self, *args):
            entered.set()
            time.sleep(0.3)
            rc = self.lib.sd_forward(*args)
            events.append("forward returned")
            return rc

    rt.lib = SlowLib(rt.lib)
    ids = np.arange(3, 40)[None]
    th = threading.Thread(target=rt.forward, args=([0], ids, chain(ids.size), np.array([[ids.size - 1]])))
    th.start()
    assert entered.wait(10)
    rt.close()
    events.append("closed")
    th.join()
    assert events == ["forward returned", "closed"]
    with pytest.raises(RuntimeError, match="after close"):
        rt.forward([0], ids, chain(ids.size), np.array([[0]]))


def test_the_workspace_grows_for_a_bigger_forward_only_and_reuse_changes_no_bit(tiny):
    """sd_forward carves its buffers from the runtime's workspace (forward.c): a big forward grows
    it, the decode steps after it reuse it as it is (no allocation), and their outputs are bitwise
    those of a fresh runtime's, so nothing is read from scratch an earlier forward left. close()
    frees it, and a refusal leaves it as it was."""
    from backend.devices import load_runtime

    m = tiny[0]
    used, fresh = load_runtime(m, "gguf"), load_runtime(m, "gguf")
    rng = np.random.default_rng(11)
    big = rng.integers(3, m.model.vocab_size, 64)
    used.alloc(1)
    used.forward([1], big[None], chain(big.size), np.arange(big.size)[None])
    grown = used._workspace.capacity
    assert grown > 0 and used._workspace.data
    prompt, steps = rng.integers(3, m.model.vocab_size, 9), rng.integers(3, m.model.vocab_size, 6)
    outs = []
    for rt in (used, fresh):
        rt.alloc(0)
        out = [rt.forward([0], prompt[None], chain(prompt.size), np.arange(prompt.size)[None]).logits.copy()]
        rt.commit([0], [np.arange(prompt.size)])
        for tok in steps:
            out.append(rt.forward([0], np.array([[tok]]), chain(1), np.array([[0]])).logits.copy())
            rt.commit([0], [np.arange(1)])
        outs.append(out)
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
    assert used._workspace.capacity == grown                    # decode steps: no regrowth
    with pytest.raises(IndexError, match="input id"):
        used.forward([0], np.array([[m.model.vocab_size + 5]]), chain(1), np.array([[0]]))
    assert used._workspace.capacity == grown
    for rt in (used, fresh):
        rt.close()
        assert rt._workspace.capacity == 0 and not rt._workspace.data
    used.close()                                                # a second close frees nothing twice


class _Sink:
    """A client stream: records tokens; `cancel_after` sends, it reports a closed connection."""
    def __init__(self, cancel_after=None):
        self.cancel_after, self.ids, self.sends, self.closes, self.errors = cancel_after, [], 0, 0, []

    def send(self, out):
        self.sends += 1
        self.ids.extend(out.new_ids)

    def error(self, exc, internal):
        self.errors.append((exc, internal))

    def cancelled(self):
        return self.cancel_after is not None and self.sends >= self.cancel_after

    def close(self):
        self.closes += 1


def test_mixed_load_with_cancels_and_slot_reuse_stays_lossless(tiny):
    """The kernel under a serving load, in process (the sanitizer run's workload, issue 31): more
    requests than KV slots (every slot freed and reused many times), ragged batches of every
    drafter (chains and trees), greedy and seeded sampling, clients that leave mid-stream, stops by
    key before and after a request starts, prompts near the context end. Every request is closed
    once, none fails, every slot comes back, and each finished request equals plain decoding of it
    alone."""
    import random

    from backend.config import DrafterKind, SamplingParams
    from backend.scheduler import Scheduler
    from backend.sequence import Request

    dec = spec_decoder(tiny[0], "gguf", max_tree_nodes=12, prompt_lookup_width=2, draft_width=2)
    slots, limit = dec.target.room(), dec.target.max_seq_len
    kinds = [DrafterKind.NONE, DrafterKind.AUTO, *(k for k in dec.drafters)]
    rng = random.Random(31)
    reqs = []
    for i in range(36):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randint(1, 20))] * rng.randint(1, 3)
        if i % 9 == 4:                                       # the length limit reached mid-draft
            prompt = (prompt * limit)[:limit - rng.randint(2, 10)]
        temp = rng.choice([0.0, 0.9])
        params = SamplingParams(temperature=temp, top_p=rng.choice([1.0, 0.9]), seed=i if temp else None,
                                max_tokens=rng.randint(1, 24), ignore_eos=True)
        reqs.append(Request(tuple(prompt), params, kinds[i % len(kinds)], rng.choice([None, 1, 4]), request_id=f"r{i}"))
    sinks = [_Sink(rng.randint(1, 4) if i % 4 == 1 else None) for i in range(len(reqs))]
    stopped = {i for i in range(len(reqs)) if i % 11 == 7}
    sched = Scheduler(dec, max_batch=4, start=False)
    pending = list(range(len(reqs)))
    while pending or sched.has_work():
        for _ in range(rng.randint(0, 3) if sched.has_work() else 1):
            if pending:
                i = pending.pop(0)
                sched.submit(reqs[i], sinks[i], key=f"k{i}")
                if i in stopped and i % 2:
                    sched.stop(f"k{i}")                      # stopped before it starts
        for i in stopped:
            if sinks[i].sends == 1:
                sched.stop(f"k{i}")                          # stopped mid-stream
        sched.iterate()
    sched.close()
    assert [s.closes for s in sinks] == [1] * len(sinks)
    assert [e for s in sinks for e in s.errors] == []
    assert dec.target.room() == slots
    assert sum(s.closes for s in sinks) > 3 * slots          # slots were reused
    whole = [i for i, s in enumerate(sinks) if s.cancel_after is None and i not in stopped]
    assert len(whole) >= 20
    for i in whole:
        r = reqs[i]
        alone = [t for o in dec.generate(Request(r.prompt_ids, r.params, DrafterKind.NONE)) for t in o.new_ids]
        assert sinks[i].ids == alone, (i, r.drafter)
    assert dec.stats.num_draft_tokens > 0
    dec.target.close()


def test_a_library_built_from_other_sources_is_refused_at_load():
    """The kernel exports its ABI (version, struct sizes, block layout, weight kinds); a mismatch
    with what runtime/native.py mirrors is refused naming the field, never misread (issue 25,
    point 4)."""
    lib, path = native.library(), "plugins/_native.so"
    native.check_abi(lib, path)                                       # this build matches
    size = native.expected_abi()["sizeof sd_step"]
    corrupted = {**native.expected_abi(), "sizeof sd_step": size + 8}
    with pytest.raises(native.NativeABIError, match=rf"sizeof sd_step {size} there, {size + 8} here.*pip install"):
        native.check_abi(lib, path, corrupted)
    with pytest.raises(native.NativeABIError, match="predates the ABI check"):
        native.check_abi(object(), path)                             # a stale build: no sd_abi


def test_two_builds_of_the_kernel_alternate_in_one_process(tiny):
    """`specdec bench-engine --builds`: the same library under two names (an A/A control) runs
    alternately on the same tokens with the same bits; a missing library is refused by name."""
    from backend.bench import engine_bench
    from backend.errors import UserError

    m, _, _ = tiny
    path = native.library()._name
    r = engine_bench.ab_builds(m, {"a": path, "b": path}, ["default", "avx512"], reps=1, out_json=None,
                               tokens=(1, 3), context=20)
    assert r["logits_bitwise_equal_to_first"] and set(r["median_ms"]) == {"a/default", "a/avx512", "b/default", "b/avx512"}
    assert native.library()._name == path
    with pytest.raises(UserError, match="no-such.so: no such file"):
        with native.build_at("/nonexistent/no-such.so"):
            pass
