"""A draft node (backend/draft_node.py) and its target-side drafter (drafters/remote.py), in one
process with the JSON round trip of the wire: greedy output identical to plain decoding and
seeded sampling equal to plain sampling whatever the node does: answers, fails, times out,
restarts (resync), or comes back after the back-off; the node's shadows follow the targets'."""
import json
import time

import pytest

from conftest import run_batch

from backend.config import DrafterKind, SamplingParams, SpecConfig
from backend.decoder import SpecDecoder
from backend.draft_node import DraftNode
from backend.drafters.draft_model import DraftModelDrafter
from backend.drafters.prompt_lookup import PromptLookupDrafter
from backend.drafters.remote import RemoteDrafter
from backend.runtime.toy import ToyRuntime, ToyTokenizer
from backend.sequence import Request

PROMPTS = [(1, 2, 3, 1, 2, 4, 1, 2), (3, 3, 2, 1), (5, 6, 7, 5, 6)]


class Wire:
    """The node behind a JSON round trip; `fail` makes calls raise (a dead node or a deadline)."""

    def __init__(self, node):
        self.node, self.fail, self.calls, self.errors = node, False, 0, 0

    def __call__(self, request, features):
        self.calls += 1
        if self.fail:
            self.errors += 1
            raise RuntimeError("Deadline Exceeded")
        return json.loads(json.dumps(self.node.handle(json.loads(json.dumps(request)), features)))


def node(seed=2):
    return DraftNode(DraftModelDrafter(ToyRuntime(vocab=8, seed=seed), max_tokens=8), vocab=8)


def decoder(wire, k=4, retry_s=0.0):
    lookup = PromptLookupDrafter(1, 3, 1)
    remote = RemoteDrafter("draft-model", DraftModelDrafter.make_traits(8), wire, lookup, retry_s=retry_s)
    calls = []
    remote.on_call = lambda outcome, s, rows: calls.append((outcome, rows))
    dec = SpecDecoder(ToyRuntime(vocab=8, seed=1), ToyTokenizer(),
                      {DrafterKind.PROMPT_LOOKUP: lookup, DrafterKind.DRAFT_MODEL: remote},
                      SpecConfig(num_draft_tokens=k))
    return dec, remote, calls


def run(dec, prompt, kind, params):
    return [t for o in dec.generate(Request(prompt, params, kind)) for t in o.new_ids]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=50),
                                    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=50, seed=3)],
                         ids=["greedy", "sampled"])
def test_output_is_plain_decoding_whatever_the_node_does(params):
    plain_dec, _, _ = decoder(Wire(node()))
    plain = [run(plain_dec, p, DrafterKind.NONE, params) for p in PROMPTS]
    wire = Wire(node())
    dec, remote, calls = decoder(wire)
    assert [run(dec, p, DrafterKind.DRAFT_MODEL, params) for p in PROMPTS] == plain
    assert dec.stats.num_accepted_tokens > 0 and all(o == "ok" for o, _ in calls)
    assert len(wire.node) == 1                       # ended sequences are released on the next call
    # the node fails every other step; then it restarts (a new node: every shadow is gone)
    flaky = Wire(node())
    dec, remote, calls = decoder(flaky)
    seqs = [dec.start(Request(p, params, DrafterKind.DRAFT_MODEL)) for p in PROMPTS]
    real_propose = remote.propose

    def propose(ss, budgets, n=[0]):
        n[0] += 1
        flaky.fail = n[0] % 2 == 0
        if n[0] == 7:
            flaky.node = node()
        return real_propose(ss, budgets)
    remote.propose = propose
    assert run_batch(dec, seqs) == plain
    outcomes = {o for o, _ in calls}
    assert {"ok", "timeout", "resync"} <= outcomes, outcomes
    assert sum(rows for o, rows in calls if o != "ok") > 0


def test_a_failed_node_is_left_alone_for_a_back_off_then_used_again():
    wire = Wire(node())
    dec, remote, calls = decoder(wire, retry_s=0.2)
    wire.fail = True
    s = dec.start(Request(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True), DrafterKind.DRAFT_MODEL))
    while dec.prefill(s) is None:
        pass
    dec.step([s])
    assert wire.errors == 1
    for _ in range(5):                               # backing off: no calls, local drafts
        dec.step([s])
    assert wire.errors == 1 and calls[-1][0] == "skipped"
    wire.fail = False
    time.sleep(0.25)
    dec.step([s])
    assert calls[-1][0] in ("ok", "resync") and wire.calls == 2
    dec.step([s])
    assert calls[-1][0] == "ok"
    dec.finish(s)
