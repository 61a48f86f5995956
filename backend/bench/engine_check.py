"""The engine graph (backend/buildlib/engine_graph.py) run by the engine runtime on ONNX Runtime's
CPU provider with its `specdec::` ops implemented by the numpy references (runtime/engine_rt.py
OrtExecutor), against the standard CPU graph: the proof on a CPU of the graph TensorRT builds.
Used by tests and by `specdec check-kernels` (entry "engine_graph").
Knows: random checkpoints, the cases. Does not know: TensorRT.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from backend.buildlib.checkpoint import Checkpoint, SourceTensor, TokenizerSource
from backend.kv_cache import PAD_PARENT
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


def chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)


def compare(ck: Checkpoint | None = None, seed: int = 0) -> dict:
    """The engine graph against the standard graph on prefill chains, single steps, a chain
    verify, a branching tree and a padded batch, greedy and sampled rows -> {"cases",
    "max_abs_err" (logits), "verify_equal" (the graph's rejection_sample == backend/verify.py on
    the standard graph's logits, float32 parameters)}."""
    from backend.buildlib.graph import GraphSpec, build_decoder, save_model
    from backend.config import RuntimeOptions, SamplingParams
    from backend.decoder import pack_drafts as pack
    from backend.drafters.base import Draft
    from backend.runtime.engine_rt import EngineRuntime, OrtExecutor, float32_params
    from backend.runtime.ort import OrtRuntime
    from backend.sampling import PositionNoise
    from backend.tree import TokenTree
    from backend.verify import verify_tree

    ck = ck or random_checkpoint(seed)
    cfg, max_len = ck.config, 256
    rng = np.random.default_rng(seed + 1)
    with tempfile.TemporaryDirectory() as tmp:
        std_path, eng_path = Path(tmp) / "std.onnx", Path(tmp) / "engine.onnx"
        save_model(build_decoder(ck, GraphSpec(WeightFormat.FP32, cfg.num_layers, max_len)), std_path)
        save_model(build_decoder(ck, GraphSpec(WeightFormat.FP32, cfg.num_layers, max_len, plugins=True)), eng_path)
        std = OrtRuntime(std_path, cfg, cfg.num_layers, max_len)
        eng = EngineRuntime(OrtExecutor(eng_path, cfg, cfg.num_layers), cfg, cfg.num_layers, max_len,
                            RuntimeOptions(max_sequences=4))
        errs, verify_ok, cases = [], True, 0
        sids = [0, 1, 2]
        for sid, n in zip(sids, (23, 9, 40)):            # prefill, three lengths
            std.alloc(sid)
            eng.alloc(sid)
            ids = rng.integers(0, cfg.vocab_size, (1, n))
            a = std.forward([sid], ids, chain(n)[None], np.arange(n)[None]).logits
            b = eng.forward([sid], ids, chain(n)[None], np.arange(n)[None]).logits
            errs.append(np.abs(a - b).max())
            std.commit([sid], [np.arange(n)])
            eng.commit([sid], [np.arange(n)])
            cases += 1
        tree = TokenTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
        shapes = [[TokenTree.chain(0)] * 3,                                  # single steps
                  [TokenTree.chain(3)] * 3,                                  # chain verify
                  [tree] * 3,                                                # branching trees
                  [tree, TokenTree.chain(3), TokenTree.chain(0)]]            # a padded batch
        params = [SamplingParams(), SamplingParams(temperature=0.75, top_p=0.875),
                  SamplingParams(temperature=1.25, top_k=20, min_p=0.0625)]
        for trees in shapes:
            drafts = [Draft(tr, rng.integers(0, cfg.vocab_size, tr.num_nodes)) for tr in trees]
            ids, parents, index = pack(drafts)
            noises = [PositionNoise(int(x), cfg.vocab_size) for x in rng.integers(0, 2 ** 63, 3, dtype=np.uint64)]
            positions = [int(x) for x in rng.integers(0, 500, 3)]
            a = std.forward(sids, ids, parents, index).logits
            out = eng.forward(sids, ids, parents, index)
            verdicts = eng.verify(out, drafts, params, noises, positions)    # the graph's rejection_sample
            real = parents != PAD_PARENT
            errs.append(np.abs(a - out.logits)[real].max())
            p32 = float32_params(params)
            ref = [verify_tree(d.tree, d.tokens, a[r, : d.tree.num_nodes], p,
                               None if p.greedy else (lambda dd, nz=nz, pos=pos: nz.at(pos + dd)))
                   for r, (d, p, nz, pos) in enumerate(zip(drafts, p32, noises, positions))]
            verify_ok &= out.verdict is not None and all(
                np.array_equal(x.accepted_nodes, y.accepted_nodes) and np.array_equal(x.output_ids, y.output_ids)
                for x, y in zip(verdicts, ref))
            keep = [v.accepted_nodes for v in verdicts]
            std.commit(sids, keep)
            eng.commit(sids, keep)
            cases += 1
        eng.close()
    return {"cases": cases, "max_abs_err": float(max(errs)), "verify_equal": bool(verify_ok)}
