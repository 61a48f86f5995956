"""One CUDA graph per speculative step (issue 41, point 4), proven on the CPU as far as a CPU can:
the torch runtime in its invariant mode with the Triton kernels (interpreted), its step graph
(backend/runtime/step_graph.py: forward, LM head and verification on a padded bucket's static
buffers) run by `EagerGraph`, the graph's CPU stand-in.

- Equality: `forward_verify` through the step graph gives, bit for bit, the logits and hidden
  rows of the eager, unpadded forward, and the verdicts of the host's verification
  (backend/verify.py, the kernel's spec), greedy and seeded sampled rows in one batch.
- Capturable: the function a graph captures (`TorchRuntime._step`) makes no host sync (no
  .item(), no data-dependent shapes, no host arrays) and launches the same kernels with the same
  grids, scalars, shapes and static-buffer addresses whatever the inputs: so a graph captured on
  one step's inputs and replayed on another's computes the eager step of the other.
What no CPU shows: a real capture and replay on a GPU (benchmarks/gpu_steps.py `graphs`,
the check's cuda_graphs step, compares replay and eager bitwise there)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import make_tiny_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from backend.config import SamplingParams  # noqa: E402
from backend.drafters.base import Draft  # noqa: E402
from backend.kv_cache import PAD_PARENT  # noqa: E402
from backend.runtime import step_graph  # noqa: E402
from backend.runtime.base import forward_verify  # noqa: E402
from backend.sampling import PositionNoise  # noqa: E402
from backend.tree import TokenTree  # noqa: E402
from plugins import kernels as K  # noqa: E402

# ops that make the host wait for the device or give an output shape read from the data
SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
            "is_nonzero", "equal", "_assert_async", "repeat_interleave", "bincount",
            "lift_fresh", "lift_fresh_copy"}          # torch.tensor(host data): a host-to-device copy
PARAMS = (SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=7),
          SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=2 ** 63 + 5))


def runtime(tmp_path, graphs: bool):
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.buildlib.fp8 import engine_tensors as _tensors
    from backend.config import RuntimeOptions
    from backend.manifest import WeightFormat
    from backend.runtime.torch_rt import TorchRuntime

    ck = load_checkpoint(make_tiny_checkpoint(tmp_path / "llama", "llama", layers=2))
    rt = TorchRuntime(None, ck.config, 2, 64, RuntimeOptions(max_sequences=4, cuda_graphs=False), "cpu",
                      tensors=_tensors(ck, WeightFormat.BF16, 2, None), dtype=torch.bfloat16)
    rt.kernels, rt.model.invariant, rt.use_graphs = True, True, graphs
    return rt


def _drafts(rng, roots, greedy_chain) -> list[Draft]:
    """Row 0: a chain (the greedy continuation at the first step: accepted in full); row 1: a
    branching tree of random tokens; row 2: a single node. At most 4 nodes a row: the graph's
    bucket is 4 x 4 (3 rows padded to 4, rows of 1 node padded to 4); a 5-node tree made it 4 x 8,
    twice the interpreter's work for no other branch."""
    trees = [TokenTree.chain(len(greedy_chain)), TokenTree.from_parents(np.array([-1, 0, 0, 1], np.int32)),
             TokenTree.chain(0)]
    toks = [np.array([roots[0], *greedy_chain]), np.array([roots[1], *rng.integers(3, 300, 3)]), np.array([roots[2]])]
    return [Draft(t, np.asarray(k, np.int64)) for t, k in zip(trees, toks)]


def _pack(drafts):
    from backend.decoder import pack_drafts

    return pack_drafts(drafts)


def _run_steps(rt, prompts, steps, greedy_chains) -> list:
    """Prefill rows 0-2, then `steps` speculative steps through runtime/base.forward_verify."""
    for s, p in enumerate(prompts):                 # the last prompt token is the first step's root
        rt.alloc(s)
        rt.forward([s], p[None, :-1], np.arange(-1, p.size - 2, dtype=np.int32)[None], np.array([[p.size - 2]]))
        rt.commit([s], [np.arange(p.size - 1)])
    rng = np.random.default_rng(3)
    noises = [PositionNoise(p.seed or 0, rt.config.vocab_size) for p in PARAMS]
    roots, out, emitted = [int(p[-1]) for p in prompts], [], [p.size for p in prompts]
    for i in range(steps):
        drafts = _drafts(rng, roots, greedy_chains[i])
        ids, parents, index = _pack(drafts)
        fwd, verdicts = forward_verify(rt, [0, 1, 2], ids, parents, index, drafts, list(PARAMS), noises, emitted)
        out.append((np.asarray(fwd.logits).copy(), np.asarray(fwd.hidden).copy(),
                    [(v.accepted_nodes.tolist(), v.output_ids.tolist(), v.num_accepted) for v in verdicts]))
        rt.commit([0, 1, 2], [v.accepted_nodes for v in verdicts])
        roots = [int(v.output_ids[-1]) for v in verdicts]
        emitted = [e + v.output_ids.size for e, v in zip(emitted, verdicts)]
    return out


def _greedy_chains(tmp_path, prompt, steps: int, k: int) -> list[list[int]]:
    """Plain greedy decoding of row 0's prompt on an eager runtime, cut into each step's draft
    (k tokens after the step's root, which is the previous draft's bonus)."""
    rt = runtime(tmp_path, graphs=False)
    rt.alloc(0)
    toks = []
    fwd = rt.forward([0], prompt[None], np.arange(-1, prompt.size - 1, dtype=np.int32)[None], np.array([[prompt.size - 1]]))
    rt.commit([0], [np.arange(prompt.size)])
    need = (steps - 1) * (k + 1) + k                # the last chain's last token
    while True:
        toks.append(int(np.asarray(fwd.logits)[0, -1].argmax()))
        if len(toks) == need:
            break
        fwd = rt.forward([0], np.array([[toks[-1]]]), np.array([[-1]], np.int32), np.zeros((1, 1), np.int64))
        rt.commit([0], [np.array([0])])
    return [toks[i * (k + 1): i * (k + 1) + k] for i in range(steps)]


def test_the_step_graph_is_the_eager_step_bit_for_bit(tmp_path):
    """Two steps: row 0's chain accepted in full at the first (the greedy continuation), random
    at the second (a rejection); the second replays the graph the first captured."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n) for n in (7, 5, 6)]
    chains = _greedy_chains(tmp_path, prompts[0], steps=1, k=3) + [list(rng.integers(3, 300, 3))]
    eager = _run_steps(runtime(tmp_path, graphs=False), prompts, 2, chains)     # host verification
    graphed_rt = runtime(tmp_path, graphs=True)
    graphed = _run_steps(graphed_rt, prompts, 2, chains)
    assert any(k[:3] == (4, 4, "_step") for k in graphed_rt._graphs), graphed_rt._graphs.keys()
    for (la, ha, va), (lb, hb, vb) in zip(eager, graphed):
        assert va == vb
        assert np.array_equal(la, lb) and np.array_equal(ha, hb)
    assert eager[0][2][0][2] == 3, "the greedy row's chain is accepted in full"


class Trace(TorchDispatchMode):
    """Every kernels.launch (kernel, grid, scalars, tensors by shape / strides / dtype / offset in
    the static buffer) and every aten op outside a kernel (name, scalars, tensor shapes); host
    crossings (.numpy(), .tolist(), torch.from_numpy) outside a kernel raise."""

    def __init__(self, static: torch.Tensor):
        super().__init__()
        self.base, self.end = static.data_ptr(), static.data_ptr() + static.numel()
        self.calls, self.inside = [], False

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            where = p - self.base if self.base <= p < self.end else None
            return ("T", tuple(a.shape), a.stride(), str(a.dtype), where)
        if isinstance(a, (list, tuple)):
            return tuple(self._arg(x) for x in a)
        return a if isinstance(a, (int, float, bool, str, type(None))) else str(a)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside:
            assert name not in SYNC_OPS, f"{name}: a host sync inside the captured step"
            self.calls.append(("aten", name, self._arg(tuple(args)), self._arg(tuple((kwargs or {}).items()))))
        return func(*args, **(kwargs or {}))

    def launch(self, kernel, grid, *args, **kwargs):
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        self.calls.append(("launch", name, tuple(grid), self._arg(args), tuple(sorted(kwargs.items()))))
        self.inside = True
        try:
            kernel[grid](*args, **kwargs)
        finally:
            self.inside = False

    def crossing(self, what):
        def refuse(*a, **k):
            assert self.inside, f"{what}: the captured step crossed to the host"
            return getattr(self, f"_orig_{what}")(*a, **k)
        return refuse


def _trace_step(rt, packed, arrays, monkeypatch) -> list:
    packed.load(arrays)
    mode = Trace(packed.device_buf)
    monkeypatch.setattr(K, "launch", mode.launch)
    for owner, what in ((torch.Tensor, "numpy"), (torch.Tensor, "tolist"), (torch, "from_numpy")):
        setattr(mode, f"_orig_{what}", getattr(owner, what))
        monkeypatch.setattr(owner, what, mode.crossing(what))
    with mode:
        rt._step(packed.tensors)
    monkeypatch.undo()
    return mode.calls


def test_the_captured_step_has_no_host_sync_and_launches_what_its_bucket_fixes(tmp_path, monkeypatch):
    """Two steps of one bucket (2 x 4: the smallest that holds a branching tree) with different
    tokens, trees, contexts, positions and sampling: the step function's launches and ops are the
    same call for call (the kernels read everything that differs from the static buffers), and
    none waits for the device."""
    rt = runtime(tmp_path, graphs=True)
    rng = np.random.default_rng(1)
    for s, n in ((0, 9), (1, 4), (2, 12)):
        rt.alloc(s)
        rt.forward([s], rng.integers(3, 300, (1, n)), np.arange(-1, n - 1, dtype=np.int32)[None], np.array([[n - 1]]))
        rt.commit([s], [np.arange(n)])
    noises = [PositionNoise(p.seed or 0, rt.config.vocab_size) for p in PARAMS]

    def arrays(seqs, drafts, params, positions):
        ids, parents, index = _pack(drafts)
        host, _ = rt._layout(seqs, ids, parents, index)
        host.update(rt._verify_inputs(drafts, params, [noises[i] for i in range(len(seqs))], positions, ids.shape[1]))
        return step_graph.padded(host, step_graph.bucket_of(*ids.shape, index.shape[1], host["paths"].shape[2]),
                                 rt.capacity)

    a = arrays([0, 1], [Draft(TokenTree.chain(2), rng.integers(3, 300, 3)), Draft(TokenTree.chain(0), np.array([4]))],
               [PARAMS[0], PARAMS[1]], [9, 4])
    b = arrays([2, 1], [Draft(TokenTree.from_parents(np.array([-1, 0, 0, 1], np.int32)), rng.integers(3, 300, 4)),
                        Draft(TokenTree.chain(2), rng.integers(3, 300, 3))], [PARAMS[2], PARAMS[0]], [12, 30])
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a) and a["ids"].shape == (2, 4)
    assert not all(np.array_equal(a[k], b[k]) for k in a)
    packed = step_graph.Packed(a, rt.device)
    ta, tb = _trace_step(rt, packed, a, monkeypatch), _trace_step(rt, packed, b, monkeypatch)
    assert ta == tb
    launches = [c for c in ta if c[0] == "launch"]
    assert launches[-1][1] == "verify_kernel" and len(launches) == 2 * 8 + 4, [c[1] for c in launches]
    assert (b["parents"][:, :] != PAD_PARENT).sum() > (a["parents"] != PAD_PARENT).sum()


def test_packed_inputs_and_verdicts_round_trip():
    arrays = {"a": np.arange(6, dtype=np.int64).reshape(2, 3), "b": np.array([1.5, -2.0]),
              "c": np.arange(5, dtype=np.int32), "d": np.ones((2, 2, 3), np.float32)}
    p = step_graph.Packed(arrays, torch.device("cpu"))
    p.load(arrays)
    for k, v in arrays.items():
        assert np.array_equal(p.tensors[k].numpy(), v) and p.tensors[k].data_ptr() % 8 == 0
    nodes = torch.tensor([[0, 1, -1], [0, -1, -1]], dtype=torch.int32)
    ids = torch.tensor([[5, 2 ** 40, -1], [7, -1, -1]], dtype=torch.int64)
    num = torch.tensor([1, 0], dtype=torch.int32)
    got = step_graph.unpack_verdicts(step_graph.pack_verdicts(nodes, ids, num).numpy(), 2, 3)
    for g, w in zip(got, (nodes, ids, num)):
        assert np.array_equal(g, w.numpy())
