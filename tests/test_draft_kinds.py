"""Drafter kinds own their build side (issue 25, point 2): a kind declares its `--draft` form,
writes its manifest entry, times its cost and makes its drafter, and the build, the cost model
and the assembly iterate over the registry. A toy kind with weights of its own (a bigram table:
each token's most likely successor), defined only in this file and registered for the test,
builds, is priced by the build and serves losslessly with no edit anywhere else."""
import json
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from backend import draft_kinds  # noqa: E402
from backend.config import DrafterKind, RuntimeOptions, SamplingParams, ServeConfig, SpecConfig  # noqa: E402
from backend.drafters.base import Draft, DrafterTraits  # noqa: E402
from backend.manifest import DraftEntry, WeightFormat  # noqa: E402
from backend.tree import TokenTree  # noqa: E402
from conftest import assert_greedy_identity, generate, make_tiny_checkpoint  # noqa: E402

TABLE = "draft_bigram.npy"


class BigramDrafter:
    """A chain that follows the table from the root: free of forwards, point-mass (lossless for
    every sampling parameter)."""
    name = "bigram"

    def __init__(self, table: np.ndarray, max_budget: int = 6):
        self.table = table
        self.traits = DrafterTraits(tree=False, max_budget=max_budget, max_forwards=1, cost_key="bigram")

    def check_params(self, params):
        return None

    def begin(self, seq, prompt_hidden):
        pass

    def preview(self, seq, limit):
        return None

    def backlog(self, seq):
        return 0

    def propose(self, seqs, max_tokens):
        out = []
        for seq, k in zip(seqs, max_tokens):
            tokens = [seq.root]
            for _ in range(max(0, k)):
                tokens.append(int(self.table[tokens[-1]]))
            out.append(Draft(TokenTree.chain(len(tokens) - 1), np.array(tokens, np.int64)))
        return out

    def observe(self, seq, draft, accepted_nodes, hidden):
        pass

    def end(self, seq):
        pass


class BigramKind(draft_kinds.DraftKind):
    name = "bigram table"
    spec_form = "bigram:FILE"
    prefix = "bigram:"
    entry_kinds = ("bigram",)
    drafter = DrafterKind.register("bigram")

    def export(self, ctx, spec, backend, serving):
        table = np.load(spec.split(":", 1)[1])
        if table.shape != (ctx.ck.config.vocab_size,):
            raise ValueError(f"{spec}: a table of {ctx.ck.config.vocab_size} tokens, got {table.shape}")
        np.save(ctx.engine_dir / TABLE, table.astype(np.int64))
        return "bigram", DraftEntry("bigram", TABLE, 0, spec)

    def time(self, manifest, context, reps):
        if "bigram" not in manifest.drafts:
            return {}
        d = self.make(manifest, SpecConfig(), None, {}, lambda k: True)[self.drafter]

        class Seq:
            root = 5
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            d.propose([Seq()], [d.traits.max_budget])
            times.append(time.perf_counter() - t0)
        return {"bigram": (statistics.median(times), None)}

    def make(self, manifest, spec, options, made, want):
        if "bigram" not in manifest.drafts or not want(self.drafter):
            return {}
        return {self.drafter: BigramDrafter(np.load(manifest.resolve(manifest.drafts["bigram"].path)))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices import load_runtime

    d = tmp_path_factory.mktemp("bigram")
    ckpt = make_tiny_checkpoint(d / "ckpt", seed=5)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    # the table: the target's own greedy successor of each token, so drafts get accepted
    plain = build(BuildConfig(target=str(ckpt), output=d / "plain", weights=(WeightFormat.FP32,), quiet=True,
                              check_invariance=False, measure_costs=False))
    rt = load_runtime(plain)
    table = np.zeros(vocab, np.int64)
    for t in range(vocab):
        rt.alloc(t)
        table[t] = int(np.argmax(rt.forward([t], np.array([[t]]), np.array([[-1]], np.int32),
                                            np.array([[0]])).logits[0, -1]))
        rt.free(t)
    rt.close()
    np.save(d / "table.npy", table)
    with draft_kinds.registered(BigramKind()):
        m = build(BuildConfig(target=str(ckpt), output=d / "repo", weights=(WeightFormat.FP32,),
                              drafts=(f"bigram:{d / 'table.npy'}",), quiet=True))
        assert "bigram:FILE" in draft_kinds.spec_forms()
        yield m
    DrafterKind.unregister("bigram")
    assert "bigram" not in draft_kinds.spec_forms() and "bigram" not in [k.value for k in DrafterKind]


def test_a_new_kind_builds_is_priced_and_serves_losslessly(built):
    from backend.engine import make_decoder

    m = built
    assert m.drafts["bigram"].kind == "bigram" and (Path(m.root) / TABLE).exists()
    assert m.cost_model["draft_step_s"]["bigram"] > 0                  # priced by the build
    dec = make_decoder(ServeConfig(engine_dir=str(m.root), weight_format="fp32", spec=SpecConfig(num_draft_tokens=4),
                                   runtime=RuntimeOptions(max_sequences=4)))
    assert isinstance(dec.drafters[DrafterKind("bigram")], BigramDrafter)
    assert_greedy_identity(dec, "bigram")
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=24, seed=11, ignore_eos=True)
    prompt = [5, 9, 13, 5, 9, 13, 21]
    assert generate(dec, prompt, DrafterKind("bigram"), params) == generate(dec, prompt, DrafterKind.NONE, params)


def test_a_request_can_name_the_new_kind_and_an_unknown_one_is_refused(built):
    from backend import triton_io
    from backend.config import RequestError

    req = triton_io.parse({"drafter": np.array([b"bigram"], object), "max_tokens": np.array([4])}, [5, 6]).request
    assert req.drafter is DrafterKind("bigram")
    with pytest.raises(RequestError, match="drafter"):
        triton_io.parse({"drafter": np.array([b"trigram"], object)}, [5, 6])


def test_a_spec_no_kind_takes_is_a_draft_checkpoint_path():
    assert draft_kinds.kind_for("eagle:/x").prefix == "eagle:"
    assert draft_kinds.kind_for("self:3").prefix == "self:"
    assert draft_kinds.kind_for("/models/draft.gguf").entry_kinds == ("model", "self")
