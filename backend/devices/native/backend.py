"""CPU engines on our own C decode step (plugins/native, runtime/native.py): the GGUF's own
blocks, repacked for the kernel. The CPU default where the install compiled the kernel.

Knows: the native engine file (export.py writes it), its build option (NativeOptions: which
matrices take wide activations, wide.py) and its record of that choice (NativeRecord), which
drafts run on the kernel beside it (the target's first layers, an EAGLE head, a separate draft
model whose description it implements) and which on ONNX Runtime (any other draft model),
loading runtime/native.py. Does not know: the decode algorithm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from backend.config import RuntimeOptions
from backend.devices.base import BuildOptions, DeviceRecord, EngineBackend, EngineRef
from backend.errors import UserError
from backend.devices.onnx.backend import export_draft_model
from backend.manifest import Device, DraftEntry, WeightFormat

EAGLE_FILE = "draft_eagle.bin"       # an EAGLE head's layer on the kernel


@dataclass(frozen=True)
class NativeOptions(BuildOptions):
    wide_activations: str = field(default="auto", metadata={"help": (
        "gguf engines: the matrices whose inputs the native kernel takes as wide activations "
        "(two int8 rows, ~14 bits) instead of int8: fidelity (the fewest that keep top-1 "
        "agreement >= 0.995 with all wide on the calibration prompts), auto (those, where they "
        "cost a plain decode step <= 3%% on this machine; else int8), none, all, or families by "
        "comma: qkv, o, gate_up, down, lm_head (docs/building.md)")})

    def __post_init__(self):
        try:
            self.wide
        except ValueError as exc:
            raise UserError(f"--wide-activations: {exc}") from None

    @property
    def wide(self) -> tuple[str, ...] | str | None:
        """wide.parse's form: the families, None (measured and priced) or wide.FIDELITY (measured)."""
        from backend.devices.native import wide

        return wide.parse(self.wide_activations)


@dataclass(frozen=True)
class NativeRecord(DeviceRecord):
    """A gguf target's choice: the matrix families whose inputs are wide activations (two int8 rows
    per row, ~14 bits; kernels.h act_q.wide): "qkv", "o", "gate_up", "down", "lm_head"; and how the
    build chose them (wide.py: the measured agreement of each candidate, the bar). Drafts record
    none: they run int8 activations."""

    wide_activations: tuple[str, ...] = ()
    activations: dict | None = None


class NativeBackend(EngineBackend):
    name = "native"
    device = Device.CPU
    formats = (WeightFormat.GGUF,)
    defaults = (WeightFormat.GGUF,)
    any_feature_layers = True            # the kernel outputs whichever layers the runtime names
    options = NativeOptions
    record = NativeRecord

    def missing(self):
        from backend.runtime import native

        if native.compiled():
            return None
        return ("needs the native CPU kernel, which the install did not compile (no C compiler with OpenMP?): "
                "install gcc and rerun `.venv/bin/pip install -e '.[all]'`, or build --weights fp32,q4")

    def versions(self):
        from backend.runtime import native

        return {"native_kernel": native.isa()} if native.compiled() else {}   # the ISA it was compiled for

    def export_targets(self, ctx, formats):
        from backend.devices.native.export import export_native

        assert formats == (WeightFormat.GGUF,), formats
        t0 = time.time()
        ef = export_native(ctx.ck, ctx.ck.config.num_layers, ctx.max_seq_len, ctx.engine_dir / "target_gguf.bin")
        wide, report = self._wide_activations(ctx, ctx.engine_dir / ef.path, ef.weight_bytes_per_token)
        ef = replace(ef, feature_layers=ctx.features, record=NativeRecord(wide, report).to_json())
        return {WeightFormat.GGUF.value: ef}, {"gguf": time.time() - t0}

    @staticmethod
    def _wide_activations(ctx, path, weight_bytes: int):
        """The matrix families taking wide activations and the report (NativeRecord):
        as --wide-activations names them, or measured on the calibration prompts (wide.py; a
        sample of their positions past wide.SAMPLE_BYTES of weights a token)."""
        from backend.devices.native import wide

        given = ctx.option(NativeOptions).wide
        if isinstance(given, tuple):
            return given, {"wide": list(given), "chosen_by": "--wide-activations"}
        from backend.buildlib.calibration import checkpoint_prompts
        from backend.runtime.native import NativeRuntime

        ck = ctx.ck
        tokens = min(wide.PROBE_TOKENS, ctx.max_seq_len - 1)    # a tiny model's positions may be fewer
        prompts = checkpoint_prompts(ck, ctx.tokenizer_json, wide.PROBE_PROMPTS, tokens)
        rt = NativeRuntime(path, ck.config, ck.config.num_layers, tokens + 1, RuntimeOptions(max_sequences=1))
        try:
            how = wide.choose if given == wide.FIDELITY else wide.decide
            wide, report = how(rt, prompts, ctx.log, tokens, wide.probe_positions(weight_bytes))
        finally:
            rt.close()
        ctx.log(f"wide activations: {list(wide) or 'none'} ({report['positions']} positions, {report['seconds']}s)")
        return wide, report

    def export_layers(self, ctx, n, serving):      # the serving engine's first n layers, no new file
        ctx.log(f"self-draft: first {n} layers + head of {serving.path}")
        return f"self{n}", DraftEntry("self", serving.path, n, ctx.ck.source, weights=serving.weights.value)

    def export_model(self, ctx, path, serving):
        """A separate draft model on the kernel too (its own engine file), where the kernel
        implements its model description; else on ONNX Runtime."""
        from pathlib import Path

        from backend.buildlib import drafts as drafts_mod
        from backend.devices.native.export import export_native

        dck = drafts_mod.draft_checkpoint(path, ctx.ck.config)
        if self.unsupported(dck.config):
            return export_draft_model(ctx, path)
        ef = export_native(dck, dck.config.num_layers, ctx.max_seq_len,
                           ctx.engine_dir / f"draft_{Path(path).stem.replace('.', '_')}_gguf.bin")
        ctx.log(f"draft model {path}: {dck.config.num_layers} layers, gguf blocks on the native kernel")
        return "model", DraftEntry("model", ef.path, dck.config.num_layers, str(path), weights=WeightFormat.GGUF.value,
                                   model=dck.config)

    def export_head(self, ctx, head, serving):
        """An EAGLE head on the kernel too: its layer in Q8_0 blocks (export.py), beside the target."""
        from backend.buildlib import drafts as drafts_mod
        from backend.buildlib.heads.eagle import head_checkpoint
        from backend.devices.native.export import export_native

        hck, vocab = head_checkpoint(head, ctx.ck)
        path = ctx.engine_dir / EAGLE_FILE
        export_native(hck, 1, ctx.max_seq_len, path)
        entry = drafts_mod.eagle_entry(head, ctx.engine_dir, path.name, vocab, hck.config,
                                       weights=WeightFormat.GGUF.value)
        ctx.log(f"EAGLE head from {head} -> {path.name} (draft vocabulary {entry.draft_vocab_size})")
        return "eagle", entry

    def load(self, manifest, ref: EngineRef, options):
        from backend.runtime.native import NativeRuntime

        return NativeRuntime(ref.path, ref.config, ref.num_layers, manifest.max_seq_len, options, ref.feature_layers,
                             ref.record.wide_activations)
