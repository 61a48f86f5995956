"""The engine graph (backend/build/engine_graph.py) run on ONNX Runtime's CPU provider with its
`specdec::` ops implemented by the numpy references (plugins/ort_ops.py), against the standard
CPU graph: the proof on a CPU of the graph TensorRT builds. Used by tests and by
`specdec check-kernels` (entry "engine_graph").
Knows: both graphs' inputs, slot caches in numpy. Does not know: TensorRT.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from backend.build.checkpoint import Checkpoint, SourceTensor, TokenizerSource
from backend.kv_cache import PAD_PARENT
from backend.kv_slots import SlotTable
from backend.manifest import ModelConfig, WeightFormat


def random_checkpoint(seed: int = 0, vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, head_dim: int = 16, intermediate: int = 128) -> Checkpoint:
    """A random Llama-shaped checkpoint in memory."""
    rng = np.random.default_rng(seed)
    cfg = ModelConfig("llama", vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, 1e-5, 10000.0,
                      512, True)
    shapes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden), "v": (kv_heads * head_dim, hidden),
              "o": (hidden, heads * head_dim), "gate": (intermediate, hidden), "up": (intermediate, hidden),
              "down": (hidden, intermediate)}
    arrays = {"embed": rng.standard_normal((vocab, hidden)), "norm": 1 + 0.1 * rng.standard_normal(hidden)}
    for i in range(layers):
        arrays[f"layers.{i}.attn_norm"] = 1 + 0.1 * rng.standard_normal(hidden)
        arrays[f"layers.{i}.mlp_norm"] = 1 + 0.1 * rng.standard_normal(hidden)
        for n, shape in shapes.items():
            arrays[f"layers.{i}.{n}"] = rng.standard_normal(shape) / np.sqrt(shape[1])
    tensors = {k: SourceTensor(k, "F32", a.shape, a.astype(np.float32)) for k, a in arrays.items()}
    return Checkpoint(cfg, tensors, TokenizerSource(), "random")


class EngineGraphRunner:
    """The engine graph's session with numpy KV slots: what the TensorRT runtime does with its
    buffers (write the new nodes' KV, move accepted columns on commit), on the CPU."""

    def __init__(self, path: Path, cfg: ModelConfig, max_seq_len: int, capacity: int = 4):
        import onnxruntime as ort

        from plugins import ort_ops

        self.session = ort.InferenceSession(str(path), ort_ops.session_options(), providers=["CPUExecutionProvider"])
        self.cfg = cfg
        self.slots = SlotTable(capacity, max_seq_len + 32, max_seq_len)
        shape = (capacity + 1, cfg.num_kv_heads, self.slots.columns, cfg.head_dim)
        self.cache = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(cfg.num_layers)]

    def forward(self, seq_ids, input_ids, parents, logits_index, params=None, seeds=None, positions=None):
        """-> (logits [B, R, V], (accepted_nodes, output_ids, num_accepted))."""
        b, t = input_ids.shape
        host, new_paths = self.slots.layout(seq_ids, parents)
        feeds = {"input_ids": np.asarray(input_ids, np.int64), "position_ids": host["pos"],
                 "logits_index": np.asarray(logits_index, np.int64), "slots": host["slots"],
                 "ctx_len": host["ctx"], "n_prior": host["n_prior"], "paths": host["paths"],
                 "parents": np.asarray(parents, np.int32)}
        params = params or [(0.0, 0, 1.0, 0.0)] * b
        for j, (name, dt) in enumerate((("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
                                        ("min_p", np.float32))):
            feeds[name] = np.array([p[j] for p in params], dt)
        feeds["seeds"] = np.asarray(seeds if seeds is not None else np.zeros(b), np.uint64).view(np.int64)
        feeds["out_positions"] = np.asarray(positions if positions is not None else np.zeros(b), np.int64)
        for i, (kc, vc) in enumerate(self.cache):
            feeds[f"k_cache_{i}"], feeds[f"v_cache_{i}"] = kc, vc
        names = ["logits", "accepted_nodes", "output_ids", "num_accepted"]
        names += [f"present_{kind}_{i}" for i in range(self.cfg.num_layers) for kind in ("key", "value")]
        out = dict(zip(names, self.session.run(names, feeds)))
        for i, (kc, vc) in enumerate(self.cache):          # the plugin's in-place writes
            for r in range(b):
                kc[host["wslot"][r], :, host["wcol"][r]] = out[f"present_key_{i}"][r]
                vc[host["wslot"][r], :, host["wcol"][r]] = out[f"present_value_{i}"][r]
        self.slots.extend(seq_ids, new_paths)
        return out["logits"], (out["accepted_nodes"], out["output_ids"], out["num_accepted"])

    def commit(self, seq_ids, keep) -> None:
        sl, src, dst = self.slots.commit(seq_ids, keep)
        for kc, vc in self.cache:
            for c in (kc, vc):
                c[sl, :, dst] = c[sl, :, src]


def chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)


def compare(ck: Checkpoint | None = None, seed: int = 0) -> dict:
    """The engine graph against the standard graph on prefill chains, single steps, a chain
    verify, a branching tree and a padded batch -> {"cases", "max_abs_err" (logits),
    "verify_equal" (rejection_sample == backend/verify.py on the standard graph's logits)}."""
    from backend.build.graph import GraphSpec, build_decoder, save_model
    from backend.runtime.ort import OrtRuntime
    from backend.tree import TokenTree
    from plugins.reference import verify_ref

    ck = ck or random_checkpoint(seed)
    cfg, max_len = ck.config, 256
    rng = np.random.default_rng(seed + 1)
    with tempfile.TemporaryDirectory() as tmp:
        std_path, eng_path = Path(tmp) / "std.onnx", Path(tmp) / "engine.onnx"
        save_model(build_decoder(ck, GraphSpec(WeightFormat.FP32, cfg.num_layers, max_len)), std_path)
        save_model(build_decoder(ck, GraphSpec(WeightFormat.FP32, cfg.num_layers, max_len, plugins=True)), eng_path)
        std = OrtRuntime(std_path, cfg, cfg.num_layers, max_len)
        eng = EngineGraphRunner(eng_path, cfg, max_len)
        errs, verify_ok, cases = [], True, 0
        sids = [0, 1, 2]
        for sid, n in zip(sids, (23, 9, 40)):            # prefill, three lengths
            std.alloc(sid)
            eng.slots.alloc(sid)
            ids = rng.integers(0, cfg.vocab_size, (1, n))
            a = std.forward([sid], ids, chain(n)[None], np.arange(n)[None]).logits
            b, _ = eng.forward([sid], ids, chain(n)[None], np.arange(n)[None])
            errs.append(np.abs(a - b).max())
            std.commit([sid], [np.arange(n)])
            eng.commit([sid], [np.arange(n)])
            cases += 1
        tree = TokenTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
        shapes = [np.stack([chain(1)] * 3),                                   # single steps
                  np.stack([chain(4)] * 3),                                   # chain verify
                  np.stack([tree.parents] * 3),                               # branching trees
                  np.array([tree.parents, np.r_[chain(4), [PAD_PARENT] * 3],  # a padded batch
                            np.r_[chain(1), [PAD_PARENT] * 6]], np.int32)]
        params = [(0.0, 0, 1.0, 0.0), (0.75, 0, 0.875, 0.0), (1.25, 20, 1.0, 0.0625)]
        for parents in shapes:
            t = parents.shape[1]
            ids = rng.integers(0, cfg.vocab_size, (3, t))
            seeds, positions = rng.integers(0, 2 ** 63, 3, dtype=np.uint64), rng.integers(0, 500, 3)
            a = std.forward(sids, ids, parents, np.broadcast_to(np.arange(t), (3, t)).copy()).logits
            b, verdict = eng.forward(sids, ids, parents, np.broadcast_to(np.arange(t), (3, t)).copy(),
                                     params, seeds, positions)
            real = parents != PAD_PARENT
            errs.append(np.abs(a - b)[real].max())
            p = np.array(params, np.float64).T
            ref = verify_ref(a, ids, parents, np.float32(p[0]), p[1].astype(np.int32), np.float32(p[2]),
                             np.float32(p[3]), seeds, positions)
            verify_ok &= all(np.array_equal(x, y) for x, y in zip(verdict, ref))
            keep = [v[: n + 1] for v, n in zip(verdict[0], verdict[2])]
            std.commit(sids, keep)
            eng.commit(sids, keep)
            cases += 1
    return {"cases": cases, "max_abs_err": float(max(errs)), "verify_equal": bool(verify_ok)}
