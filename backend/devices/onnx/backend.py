"""CPU engines on ONNX Runtime: fp32 (the exact reference) and q4 (MatMulNBits) graphs.

Knows: how a checkpoint becomes an ONNX decoder graph here (buildlib/graph.py), the draft forms on
this runtime, its record (OrtRecord: a q4 graph's single-token padding), loading runtime/ort.py.
Does not know: the decode algorithm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backend.devices.base import BuildContext, DeviceRecord, EngineBackend, EngineRef
from backend.manifest import Device, DraftEntry, EngineFile, WeightFormat


@dataclass(frozen=True)
class OrtRecord(DeviceRecord):
    """A graph's recorded choice: run T=1 steps as T=2 (q4: keeps MatMulNBits on one kernel path,
    so a single step's logits are a verify row's)."""

    pad_single_token: bool = False


def export_graph(ck, fmt: WeightFormat, num_layers: int, ctx: BuildContext, stem: str,
                 features: tuple[int, ...] = ()) -> EngineFile:
    """One ONNX decoder graph (the first `num_layers` layers + head) -> its EngineFile."""
    import sys

    from tqdm import tqdm

    from backend.buildlib.graph import GraphSpec, build_decoder, save_model, weight_bytes_per_token

    bar = tqdm(total=num_layers, desc=f"export {stem}", unit="layer", disable=ctx.quiet, file=sys.stderr,
               leave=False)
    model = build_decoder(ck, GraphSpec(fmt, num_layers, ctx.max_seq_len, feature_layers=features),
                          progress=bar.update)
    bar.close()
    path = ctx.engine_dir / f"{stem}.onnx"
    per_token = weight_bytes_per_token(model)
    size = save_model(model, path)
    return EngineFile(path=path.name, weights=fmt, num_layers=num_layers, size_bytes=size,
                      weight_bytes_per_token=per_token, feature_layers=features,
                      record=OrtRecord(pad_single_token=fmt is WeightFormat.Q4).to_json())


def export_draft_model(ctx: BuildContext, spec: str) -> tuple[str, DraftEntry]:
    """A separate draft model (its vocabulary the target's or its own: draft_kinds/draft_model.py
    adds the map) as a q4 graph (fp32 where its width is not a multiple of the 4-bit block)."""
    from backend.buildlib import drafts as drafts_mod

    dck = drafts_mod.draft_checkpoint(spec, ctx.ck.config)
    fmt = WeightFormat.Q4 if dck.config.hidden_size % 32 == 0 else WeightFormat.FP32
    stem = f"draft_{Path(spec).stem.replace('.', '_')}_{fmt.value}"
    ef = export_graph(dck, fmt, dck.config.num_layers, ctx, stem)
    ctx.log(f"draft model {spec}: {dck.config.num_layers} layers, {fmt.value}")
    return "model", DraftEntry("model", ef.path, dck.config.num_layers, str(spec), weights=fmt.value,
                               record=ef.record, model=dck.config)


def export_eagle(ctx: BuildContext, head: Path) -> tuple[str, DraftEntry]:
    """An EAGLE head as a 1-layer ONNX engine."""
    from backend.buildlib import drafts as drafts_mod
    from backend.buildlib.heads.eagle import export_eagle_head

    path, vocab, model = export_eagle_head(head, ctx.ck, ctx.engine_dir, ctx.max_seq_len)
    entry = drafts_mod.eagle_entry(head, ctx.engine_dir, path.name, vocab, model)
    ctx.log(f"EAGLE head from {head} -> {path.name} (draft vocabulary {entry.draft_vocab_size})")
    return "eagle", entry


# A graph's build holds its weights about three times over (the numpy arrays, the ONNX protos, the
# external-data write; then ONNX Runtime's session for the batch-invariance check): peaks measured
# on SmolLM2-135M, 2.13 GB for the 0.65 GB fp32 engine, 0.84 GB for the 0.23 GB q4 one
# (perf-notes §37); Llama-3.2-3B's fp32 (12.9 GB) was killed at 24 GB (issue 53).
BUILD_FACTOR = 3
_EIGHT_BIT = {"Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K"}     # kept 8-bit by q4 (buildlib/quant.py), scale per 16


def graph_bytes(ck, fmt: WeightFormat) -> int:
    """About the bytes of the ONNX engine of `fmt`: the embedding float32 (gathered) in both; fp32
    every matrix in float32 (the tied head a second copy); q4 4-bit blocks with a float32 scale and
    offset per 32 (0.75 B a weight), 8-bit ones where the GGUF's are (1.25 B)."""
    total = 0
    for name, t in ck.tensors.items():
        n = int(np.prod(t.shape))
        if name == "embed":
            total += 4 * n * (2 if fmt is WeightFormat.FP32 and "lm_head" not in ck.tensors else 1)
        elif len(t.shape) == 2:
            total += 4 * n if fmt is WeightFormat.FP32 else int(n * (1.25 if t.qtype in _EIGHT_BIT else 0.75))
        else:
            total += 4 * n
    return total


class OrtBackend(EngineBackend):
    name = "onnxruntime"
    device = Device.CPU
    formats = (WeightFormat.FP32, WeightFormat.Q4)
    defaults = (WeightFormat.FP32, WeightFormat.Q4)
    record = OrtRecord

    def build_bytes(self, ck, fmt):
        return BUILD_FACTOR * graph_bytes(ck, fmt)

    def export_targets(self, ctx, formats):
        engines, timings = {}, {}
        for fmt in formats:
            t0 = time.time()
            engines[fmt.value] = export_graph(ctx.ck, fmt, ctx.ck.config.num_layers, ctx, f"target_{fmt.value}",
                                              ctx.features)
            timings[fmt.value] = time.time() - t0
        return engines, timings

    def export_layers(self, ctx, n, serving):
        ef = export_graph(ctx.ck, WeightFormat.Q4, n, ctx, f"draft_self{n}_q4")
        ctx.log(f"self-draft: first {n} layers + head, q4")
        return f"self{n}", DraftEntry("self", ef.path, n, ctx.ck.source, weights="q4", record=ef.record)

    def export_model(self, ctx, path, serving):
        return export_draft_model(ctx, path)

    def export_head(self, ctx, head, serving):
        return export_eagle(ctx, head)

    def load(self, manifest, ref: EngineRef, options):
        from backend.runtime.ort import OrtRuntime

        return OrtRuntime(ref.path, ref.config, ref.num_layers, manifest.max_seq_len, options,
                          pad_single_token=ref.record.pad_single_token)
