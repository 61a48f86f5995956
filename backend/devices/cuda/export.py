"""The build for `--device cuda`: checkpoint -> torch engine files (safetensors, canonical names
of buildlib/checkpoint.py) in fp32, bf16 or FP8 E4M3, and what the GPU runtime needs to know.

FP8: the recipe (runtime/fp8.py: how weights and linear inputs are scaled) is chosen by measured
quality (devices/cuda/fp8_choice.py) or named by `--fp8-recipe`, written into the file's metadata and
the manifest (record.py: Fp8Record); the static recipe's input scales are amax / 448 over calibration
prompts run through the fp32 model (buildlib/calibration.py); the weights' FP8 math is
buildlib/fp8.py (shared with the tensorrt device); from which forward width the GPU runs the
recipe's W8A8 GEMM instead of W8A16 is measured on the GPU at build (w8a8.py). The embedding, norms, LM head and an EAGLE head's fc stay in bf16.
Knows: checkpoints, the engine file layout, which GPU this is. Does not know: serving.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from backend.buildlib.calibration import FP8_CALIBRATION_PROMPTS, calibrate, checkpoint_prompts
from backend.buildlib.checkpoint import Checkpoint
from backend.buildlib.fp8 import engine_tensors
from backend.devices.cuda.record import Fp8Record
from backend.manifest import EngineFile, WeightFormat
from backend.runtime import fp8


def gpu_info() -> dict | None:
    """The GPU this build runs on (name, compute capability, library versions), or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    import triton

    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def export(ck: Checkpoint, fmt: WeightFormat, num_layers: int, engine_dir: Path, stem: str,
           act_scales: dict | None = None, recipe: fp8.Recipe | None = None,
           w8a8=None) -> EngineFile:
    """One engine file; an FP8 one names its recipe in the file's metadata (the runtime reads it).
    `w8a8` (an FP8 target's): a callable given the engine tensors that returns w8a8.py's
    measurement, whose width from which W8A8 runs goes into the metadata too; the EngineFile's
    record (Fp8Record) then holds the measurement (the caller adds the recipe's report)."""
    from safetensors.torch import save_file

    path = Path(engine_dir) / f"{stem}.safetensors"
    tensors = engine_tensors(ck, fmt, num_layers, act_scales, recipe)
    meta, measured = None, None
    if fmt is WeightFormat.FP8:
        meta = {"fp8_recipe": json.dumps((recipe or fp8.LEGACY).to_json())}
        if w8a8 is not None:
            measured = w8a8(tensors)
            meta["w8a8_from"] = json.dumps(measured["w8a8_from"])
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return EngineFile(path=path.name, weights=fmt, num_layers=num_layers, size_bytes=path.stat().st_size,
                      record=Fp8Record.made(None, measured))


def choose_recipe(ck: Checkpoint, prompts: list[list[int]], max_seq_len: int, act: dict, log,
                  choice: str = "auto") -> tuple[fp8.Recipe, dict]:
    """The FP8 recipe of a build and its report (Fp8Record): measured by fp8_choice on
    `prompts` (held out from the calibration: a static scale must hold beyond the prompts it was
    calibrated on) when `choice` is "auto", or the one `--fp8-recipe` names (not measured)."""
    from backend.devices.cuda import fp8_choice

    if choice != "auto":
        rec = fp8.recipe(choice)
        log(f"FP8 recipe {rec.name} (--fp8-recipe; quality not measured)")
        return rec, {"recipe": rec.to_json(), "chosen_by": "--fp8-recipe", "measured": []}
    probe = [p[: fp8_choice.PROBE_PROMPT_TOKENS] for p in prompts]
    rec, report = fp8_choice.choose(ck, probe, max_seq_len, act, log)
    log(f"FP8 recipe {rec.label} chosen in {report['seconds']}s ({report['positions']} positions)")
    return rec, {**report, "chosen_by": "measured"}


def fp8_plan(ck: Checkpoint, max_seq_len: int, tokenizer_json: Path, log, choice: str = "auto"):
    """Calibrated input scales, the recipe and its report of an FP8 build (the tensorrt backend
    shares them)."""
    import time

    from backend.devices.cuda.fp8_choice import PROBE_PROMPTS

    t0 = time.time()
    n = FP8_CALIBRATION_PROMPTS
    prompts = checkpoint_prompts(ck, tokenizer_json, n + PROBE_PROMPTS)
    act = calibrate(ck, prompts[:n], max_seq_len, hessians=True)
    log(f"FP8 activation scales and GPTQ's Hessians calibrated on {n} prompts in {time.time() - t0:.1f}s")
    return (act, *choose_recipe(ck, prompts[n:], max_seq_len, act, log, choice))


def export_all(ck: Checkpoint, formats, max_seq_len: int, engine_dir: Path, tokenizer_json: Path, log,
               features: tuple[int, ...] = (), fp8_choice: str = "auto", w8a8_device=None):
    """The target in every format (FP8: calibrated and its recipe chosen first) ->
    ({format: EngineFile}, {format: s}); `features`: EAGLE-3's layers, which the torch runtime
    outputs (EngineFile.feature_layers); `w8a8_device`: where the FP8 target's W8A8 width is
    measured (w8a8.for_build: default this machine's GPU, none without one)."""
    import time

    from backend.devices.cuda import w8a8

    act, recipe, report = fp8_plan(ck, max_seq_len, tokenizer_json, log, fp8_choice) \
        if WeightFormat.FP8 in formats else (None, None, None)
    engines, timings = {}, {}
    for fmt in formats:
        t0 = time.time()
        width = (lambda t: w8a8.for_build(ck, t, recipe, ck.config.num_layers, max_seq_len, log, w8a8_device)) \
            if fmt is WeightFormat.FP8 else None
        ef = export(ck, fmt, ck.config.num_layers, engine_dir, f"target_{fmt.value}", act, recipe, width)
        engines[fmt.value] = replace(ef, feature_layers=features, record=Fp8Record.made(
            report, Fp8Record.of(ef).w8a8) if fmt is WeightFormat.FP8 else None)
        timings[fmt.value] = time.time() - t0
    return engines, timings


def _draft_format(target: EngineFile) -> WeightFormat:
    """Drafts are written in bf16 (fp32 beside an fp32 target)."""
    return WeightFormat.FP32 if target.weights is WeightFormat.FP32 else WeightFormat.BF16


def export_layers(ck: Checkpoint, n: int, target: EngineFile, log):
    """A self-draft reads the first n layers of the target's own file: no new file."""
    from backend.manifest import DraftEntry

    log(f"self-draft: first {n} layers + head of {target.path}")
    return f"self{n}", DraftEntry("self", target.path, n, ck.source, weights=target.weights.value)


def export_head(head: Path, ck: Checkpoint, target: EngineFile, engine_dir: Path, log):
    from backend.buildlib.drafts import eagle_entry
    from backend.buildlib.heads.eagle import head_checkpoint

    fmt = _draft_format(target)
    hck, vocab = head_checkpoint(head, ck)
    ef = export(hck, fmt, 1, engine_dir, "draft_eagle")
    log(f"EAGLE head from {head} -> {ef.path} ({fmt.value})")
    return "eagle", eagle_entry(head, engine_dir, ef.path, vocab, hck.config)


def export_draft_model(spec: str, ck: Checkpoint, target: EngineFile, engine_dir: Path, log):
    from backend.buildlib.drafts import draft_checkpoint
    from backend.manifest import DraftEntry

    fmt = _draft_format(target)
    dck = draft_checkpoint(spec, ck.config)
    ef = export(dck, fmt, dck.config.num_layers, engine_dir, f"draft_{Path(spec).stem.replace('.', '_')}_{fmt.value}")
    log(f"draft model {spec}: {dck.config.num_layers} layers, {fmt.value}")
    return "model", DraftEntry("model", ef.path, dck.config.num_layers, str(spec), weights=fmt.value,
                               model=dck.config)
