"""The build for `--device cuda`: checkpoint -> torch engine files (safetensors, canonical names
of build/checkpoint.py) in fp32, bf16 or FP8 E4M3, and what the GPU runtime needs to know.

FP8: the recipe (runtime/fp8.py: how weights and linear inputs are scaled) is chosen by measured
quality (build/fp8_choice.py) or named by `--fp8-recipe`, written into the file's metadata and
the manifest (EngineFile.fp8); the static recipe's input scales are amax / 448 over calibration
prompts run through the fp32 model (the stdlib-docstring prompts of train/prompts.py, never the
benchmark prompts). The embedding, norms, LM head and an EAGLE head's fc stay in bf16.
Knows: checkpoints, the engine file layout, calibration, which GPU this is. Does not know:
serving.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from backend.build.checkpoint import Checkpoint
from backend.manifest import EngineFile, WeightFormat
from backend.runtime import fp8

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
# the linears as the runtime multiplies them (q|k|v and gate|up fused): FP8 scales are per fused linear
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def gpu_info() -> dict | None:
    """The GPU this build runs on (name, compute capability, library versions), or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    import triton

    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def _tensors(ck: Checkpoint, fmt: WeightFormat, num_layers: int, act_scales: dict | None,
             recipe: fp8.Recipe | None = None) -> dict:
    """The engine file's tensors; FP8: each fused linear (FUSED) quantized by `recipe` (its parts
    stored under their own names, the scale once per fused linear, "<linear>.w_scale"), with the
    static recipe's input scales `act_scales`."""
    import torch

    keep = torch.float32 if fmt is WeightFormat.FP32 else torch.bfloat16
    f32 = lambda name: torch.from_numpy(np.array(ck.tensors[name].float32()))
    out = {}
    for name in ck.tensors:
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) >= num_layers:
            continue
        if not (fmt is WeightFormat.FP8 and parts[0] == "layers" and parts[2] in LINEARS):
            out[name] = f32(name).to(keep).contiguous()
    if fmt is not WeightFormat.FP8:
        return out
    recipe = recipe or fp8.LEGACY
    for i in range(num_layers):
        for key, names in FUSED.items():
            parts = [f"layers.{i}.{n}" for n in names]
            w = torch.cat([f32(n) for n in parts])
            q, out[f"layers.{i}.{key}.w_scale"] = quantize_fp8(w, recipe, act_scales, f"layers.{i}.{key}")
            out.update(zip(parts, q.split([ck.tensors[n].shape[0] for n in parts])))
    if recipe.static:
        assert act_scales is not None, "a static FP8 recipe needs calibrated activation scales"
        out.update({k: torch.tensor(v, dtype=torch.float32) for k, v in act_scales.items()
                    if k.endswith(".act_scale") and int(k.split(".")[1]) < num_layers})
    return out


def quantize_fp8(w, recipe: fp8.Recipe, calibration: dict | None, linear: str):
    """A fused linear's [N, K] weight -> (float8 codes, scale) by `recipe`: rounded by GPTQ on its
    input's Hessian (build/fp8_gptq.py) where the recipe says so and the calibration holds one
    ("<linear>.hessian": a target calibrated with `hessians`; another model's draft has none and
    rounds to nearest, which changes its acceptance, never the target's output), else to nearest."""
    h = (calibration or {}).get(f"{linear}.hessian") if recipe.gptq else None
    if h is None:
        return fp8.quantize_weight(w, recipe)
    from backend.build import fp8_gptq

    return fp8_gptq.quantize_weight(w, recipe, h)


def export(ck: Checkpoint, fmt: WeightFormat, num_layers: int, engine_dir: Path, stem: str,
           act_scales: dict | None = None, recipe: fp8.Recipe | None = None) -> EngineFile:
    """One engine file; an FP8 one names its recipe in the file's metadata (the runtime reads it)."""
    from safetensors.torch import save_file

    path = Path(engine_dir) / f"{stem}.safetensors"
    meta = {"fp8_recipe": json.dumps((recipe or fp8.LEGACY).to_json())} if fmt is WeightFormat.FP8 else None
    save_file({k: v.contiguous() for k, v in _tensors(ck, fmt, num_layers, act_scales, recipe).items()},
              str(path), metadata=meta)
    return EngineFile(path=path.name, weights=fmt, num_layers=num_layers, size_bytes=path.stat().st_size)


def _fp32_runtime(ck: Checkpoint, max_seq_len: int, tmp: str, features: tuple[int, ...] = ()):
    from backend.config import RuntimeOptions
    from backend.runtime.torch_rt import TorchRuntime

    n = ck.config.num_layers
    ef = export(ck, WeightFormat.FP32, n, Path(tmp), f"calibrate_{id(ck)}")
    return TorchRuntime(Path(tmp) / ef.path, ck.config, n, max_seq_len, RuntimeOptions(max_sequences=1), "cpu",
                        feature_layers=features)


def calibrate(ck: Checkpoint, prompts: list[list[int]], max_seq_len: int, margin: float = 1.0,
              head: Checkpoint | None = None, head_fc=None, features: tuple[int, ...] = (),
              hessians: bool = False) -> dict:
    """Per-tensor activation scales, "layers.<i>.<input>.act_scale" -> amax / 448, from the fp32
    model on `prompts` (token id lists), run on the CPU; with `hessians` also each linear's input
    Hessian, "layers.<i>.<linear>.hessian" -> float32 [K, K] sum of x^T x over every prompt
    position (GPTQ's, build/fp8_gptq.py; never written to a file). With `head` (an EAGLE head as a
    1-layer checkpoint, build/heads/eagle.head_checkpoint): the head's, run on the target's
    features of the same prompts, as it drafts (x_{t+1} with the feature of x_t; an EAGLE-3 head:
    its fc `head_fc` over the target's `features` layers, drafters/eagle.head_features)."""
    from backend.drafters.eagle import HostFC, head_features

    with tempfile.TemporaryDirectory() as tmp:
        rt = _fp32_runtime(ck, max_seq_len, tmp, features)
        probe = _fp32_runtime(head, max_seq_len, tmp) if head is not None else rt
    fc = None if head_fc is None else HostFC(head_fc)                 # repacked once, not per prompt
    linears = probe.model.linears()
    amax = {name: [] for name in linears}
    gram: dict = {}

    def observe(x, name):
        amax[name].append(float(x.abs().max()))
        if hessians:
            x = x.reshape(-1, x.shape[-1]).float()
            gram[name] = gram[name] + x.T @ x if name in gram else x.T @ x
    for name, lin in linears.items():
        lin.observe = lambda x, name=name: observe(x, name)
    for i, ids in enumerate(prompts):
        ids = np.asarray(ids[: max_seq_len - 1], np.int64)
        rt.alloc(i)
        out = rt.forward([i], ids[None], np.arange(-1, ids.size - 1, dtype=np.int32)[None], np.array([[ids.size - 1]]))
        if head is not None:
            feats = head_features(out.hidden[0, :-1], ck.config.hidden_size, fc)
            probe.alloc(i)
            probe.forward([i], ids[None, 1:], np.arange(-1, ids.size - 2, dtype=np.int32)[None],
                          np.array([[ids.size - 2]]), {"features": feats[None]})
            probe.free(i)
        rt.free(i)
    rt.close()
    if head is not None:
        probe.close()
    return {**{f"{name}.act_scale": margin * max(a) / fp8.FP8_MAX for name, a in amax.items()},
            **{f"{name}.hessian": h for name, h in gram.items()}}


CALIBRATION_PROMPTS = 24
# an FP8 build's calibration: static input scales and GPTQ's Hessians. GPTQ fits the weights to
# these inputs, and more of them generalize better (SmolLM2-135M, weights alone in FP8 blocks of
# 128 x 128, public prompts: 24 prompts top-1 0.9714 / KL 0.0117, 64 prompts 0.9714 / 0.0096;
# 1 x 32: 0.9661 / 0.0097 -> 0.9701 / 0.0072)
FP8_CALIBRATION_PROMPTS = 64


def calibration_prompts(tokenizer, n: int = CALIBRATION_PROMPTS, max_tokens: int = 384) -> list[list[int]]:
    """Prompts from the Python standard library's docstrings (train/prompts.py): chat-templated,
    or for a model without a template (a base model: Gemma-3-270M) their text with the
    tokenizer's special tokens, as bench/prompt_sets.prompt_ids makes a prompt."""
    from backend.train.prompts import build_prompts

    def ids(messages):
        if tokenizer.chat_template:
            return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        return tokenizer.encode("\n\n".join(m["content"] for m in messages), add_special_tokens=True)
    return [ids(m)[:max_tokens] for m in build_prompts(n, seed=1)]


def checkpoint_prompts(ck: Checkpoint, tokenizer_json: Path, n: int = CALIBRATION_PROMPTS,
                       max_tokens: int = 384) -> list[list[int]]:
    """calibration_prompts with the build's tokenizer of checkpoint `ck` (tokenizer_json: the file
    the build wrote); torch-free, shared by every device's build."""
    from backend.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_json, ck.tokenizer.chat_template, ck.config.eos_token_ids,
                    ck.config.bos_token_id, ck.tokenizer.add_bos_token)
    return calibration_prompts(tok, n, max_tokens)


def choose_recipe(ck: Checkpoint, prompts: list[list[int]], max_seq_len: int, act: dict, log,
                  choice: str = "auto") -> tuple[fp8.Recipe, dict]:
    """The FP8 recipe of a build and its report (EngineFile.fp8): measured by fp8_choice on
    `prompts` (held out from the calibration: a static scale must hold beyond the prompts it was
    calibrated on) when `choice` is "auto", or the one `--fp8-recipe` names (not measured)."""
    from backend.build import fp8_choice

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

    from backend.build.fp8_choice import PROBE_PROMPTS

    t0 = time.time()
    n = FP8_CALIBRATION_PROMPTS
    prompts = checkpoint_prompts(ck, tokenizer_json, n + PROBE_PROMPTS)
    act = calibrate(ck, prompts[:n], max_seq_len, hessians=True)
    log(f"FP8 activation scales and GPTQ's Hessians calibrated on {n} prompts in {time.time() - t0:.1f}s")
    return (act, *choose_recipe(ck, prompts[n:], max_seq_len, act, log, choice))


def export_all(ck: Checkpoint, formats, max_seq_len: int, engine_dir: Path, tokenizer_json: Path, log,
               features: tuple[int, ...] = (), fp8_choice: str = "auto"):
    """The target in every format (FP8: calibrated and its recipe chosen first) ->
    ({format: EngineFile}, {format: s}); `features`: EAGLE-3's layers, which the torch runtime
    outputs (EngineFile.feature_layers)."""
    import time

    act, recipe, report = fp8_plan(ck, max_seq_len, tokenizer_json, log, fp8_choice) \
        if WeightFormat.FP8 in formats else (None, None, None)
    engines, timings = {}, {}
    for fmt in formats:
        t0 = time.time()
        ef = export(ck, fmt, ck.config.num_layers, engine_dir, f"target_{fmt.value}", act, recipe)
        engines[fmt.value] = replace(ef, feature_layers=features, fp8=report if fmt is WeightFormat.FP8 else None)
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
    from backend.build.drafts import eagle_entry
    from backend.build.heads.eagle import head_checkpoint

    fmt = _draft_format(target)
    hck, vocab = head_checkpoint(head, ck)
    ef = export(hck, fmt, 1, engine_dir, "draft_eagle")
    log(f"EAGLE head from {head} -> {ef.path} ({fmt.value})")
    return "eagle", eagle_entry(head, engine_dir, ef.path, vocab)


def export_draft_model(spec: str, ck: Checkpoint, target: EngineFile, engine_dir: Path, log):
    from backend.build.drafts import draft_checkpoint
    from backend.manifest import DraftEntry

    fmt = _draft_format(target)
    dck = draft_checkpoint(spec, ck.config)
    ef = export(dck, fmt, dck.config.num_layers, engine_dir, f"draft_{Path(spec).stem.replace('.', '_')}_{fmt.value}")
    log(f"draft model {spec}: {dck.config.num_layers} layers, {fmt.value}")
    return "model", DraftEntry("model", ef.path, dck.config.num_layers, str(spec), weights=fmt.value,
                               model=dck.config)
