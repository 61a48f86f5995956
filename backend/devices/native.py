"""CPU engines on our own C decode step (plugins/native, runtime/native.py): the GGUF's own
blocks, repacked for the kernel. The CPU default where the install compiled the kernel.

Knows: the native engine file (build/native_engine.py writes it), which drafts run on the
kernel beside it (the target's first layers, an EAGLE head, a separate draft model whose
description it implements) and which on ONNX Runtime (any other draft model), loading
runtime/native.py. Does not know: the decode algorithm.
"""
from __future__ import annotations

import time
from dataclasses import replace

from backend.config import RuntimeOptions
from backend.devices.base import EngineBackend, EngineRef
from backend.devices.onnx import export_draft_model, export_eagle
from backend.manifest import Device, DraftEntry, WeightFormat


class NativeBackend(EngineBackend):
    name = "native"
    device = Device.CPU
    formats = (WeightFormat.GGUF,)
    defaults = (WeightFormat.GGUF,)
    any_feature_layers = True            # the kernel outputs whichever layers the runtime names
    model_features = frozenset({"gelu_tanh", "qk_norm", "post_norms", "sliding_window", "local_rope",
                                "embed_scale", "attn_scale", "final_logit_softcap",
                                "attn_logit_softcap"})   # forward.c's flags

    def missing(self):
        from backend.runtime import native

        if native.compiled():
            return None
        return ("needs the native CPU kernel, which the install did not compile (no C compiler with OpenMP?): "
                "install gcc and rerun `.venv/bin/pip install -e '.[all]'`, or build --weights fp32,q4")

    def export_targets(self, ctx, formats):
        from backend.build.native_engine import export_native

        assert formats == (WeightFormat.GGUF,), formats
        t0 = time.time()
        ef = export_native(ctx.ck, ctx.ck.config.num_layers, ctx.max_seq_len, ctx.engine_dir / "target_gguf.bin")
        wide, report = self._wide_activations(ctx, ctx.engine_dir / ef.path)
        ef = replace(ef, feature_layers=ctx.features, wide_activations=wide, activations=report)
        return {WeightFormat.GGUF.value: ef}, {"gguf": time.time() - t0}

    @staticmethod
    def _wide_activations(ctx, path):
        """The matrix families taking wide activations and the report (EngineFile.activations):
        as --wide-activations names them, or measured on the calibration prompts (wide_choice)."""
        from backend.build import wide_choice

        if isinstance(ctx.wide_activations, tuple):
            return ctx.wide_activations, {"wide": list(ctx.wide_activations), "chosen_by": "--wide-activations"}
        from backend.build.torch_engine import checkpoint_prompts
        from backend.runtime.native import NativeRuntime

        ck = ctx.ck
        tokens = min(wide_choice.PROBE_TOKENS, ctx.max_seq_len - 1)    # a tiny model's positions may be fewer
        prompts = checkpoint_prompts(ck, ctx.tokenizer_json, wide_choice.PROBE_PROMPTS, tokens)
        rt = NativeRuntime(path, ck.config, ck.config.num_layers, tokens + 1, RuntimeOptions(max_sequences=1))
        try:
            how = wide_choice.choose if ctx.wide_activations == wide_choice.FIDELITY else wide_choice.decide
            wide, report = how(rt, prompts, ctx.log, tokens)
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

        from backend.build import drafts as drafts_mod
        from backend.build.native_engine import export_native

        dck = drafts_mod.draft_checkpoint(path, ctx.ck.config)
        if self.unsupported(dck.config):
            return export_draft_model(ctx, path)
        ef = export_native(dck, dck.config.num_layers, ctx.max_seq_len,
                           ctx.engine_dir / f"draft_{Path(path).stem.replace('.', '_')}_gguf.bin")
        ctx.log(f"draft model {path}: {dck.config.num_layers} layers, gguf blocks on the native kernel")
        return "model", DraftEntry("model", ef.path, dck.config.num_layers, str(path), weights=WeightFormat.GGUF.value,
                                   model=dck.config)

    def export_head(self, ctx, head, serving):
        return export_eagle(ctx, head, native=True)

    def load(self, manifest, ref: EngineRef, options):
        from backend.runtime.native import NativeRuntime

        return NativeRuntime(ref.path, ref.config, ref.num_layers, manifest.max_seq_len, options, ref.feature_layers,
                             ref.wide_activations)
