"""The build for `--device cuda`: checkpoint -> torch engine files (safetensors, canonical names
of build/checkpoint.py) in fp32, bf16 or FP8 E4M3, and what the GPU runtime needs to know.

FP8 recipe (runtime/torch_model.py applies it): each linear weight gets one scale per output
channel, amax / 448; each linear input one scale, amax / 448 over calibration prompts run
through the fp32 model (the stdlib-docstring prompts of train/prompts.py, never the benchmark
prompts). The embedding, norms, LM head and an EAGLE head's fc stay in bf16.
Knows: checkpoints, the engine file layout, calibration, which GPU this is. Does not know:
serving.
"""
from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from backend.build.checkpoint import Checkpoint
from backend.manifest import EngineFile, WeightFormat

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
ACT_INPUTS = {"qkv": "q", "o": "o", "gate_up": "gate", "down": "down"}   # input -> first weight


def gpu_info() -> dict | None:
    """The GPU this build runs on (name, compute capability, library versions), or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    import triton

    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def _tensors(ck: Checkpoint, fmt: WeightFormat, num_layers: int, act_scales: dict | None) -> dict:
    import torch

    from backend.runtime.torch_model import fp8_quantize

    keep = torch.float32 if fmt is WeightFormat.FP32 else torch.bfloat16
    out = {}
    for name, t in ck.tensors.items():
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) >= num_layers:
            continue
        w = torch.from_numpy(np.array(t.float32()))
        if fmt is WeightFormat.FP8 and parts[0] == "layers" and parts[2] in LINEARS:
            out[name], out[f"{name}.scale"] = fp8_quantize(w)
        else:
            out[name] = w.to(keep).contiguous()
    if fmt is WeightFormat.FP8:
        assert act_scales is not None, "FP8 needs calibrated activation scales"
        out.update({k: torch.tensor(v, dtype=torch.float32) for k, v in act_scales.items()
                    if int(k.split(".")[1]) < num_layers})
    return out


def export(ck: Checkpoint, fmt: WeightFormat, num_layers: int, engine_dir: Path, stem: str,
           act_scales: dict | None = None) -> EngineFile:
    from safetensors.torch import save_file

    path = Path(engine_dir) / f"{stem}.safetensors"
    save_file(_tensors(ck, fmt, num_layers, act_scales), str(path))
    return EngineFile(path=path.name, weights=fmt, num_layers=num_layers, size_bytes=path.stat().st_size)


def _fp32_runtime(ck: Checkpoint, max_seq_len: int, tmp: str, features: tuple[int, ...] = ()):
    from backend.config import RuntimeOptions
    from backend.runtime.torch_rt import TorchRuntime

    n = ck.config.num_layers
    ef = export(ck, WeightFormat.FP32, n, Path(tmp), f"calibrate_{id(ck)}")
    return TorchRuntime(Path(tmp) / ef.path, ck.config, n, max_seq_len, RuntimeOptions(max_sequences=1), "cpu",
                        feature_layers=features)


def calibrate(ck: Checkpoint, prompts: list[list[int]], max_seq_len: int, margin: float = 1.0,
              head: Checkpoint | None = None, head_fc=None, features: tuple[int, ...] = ()) -> dict:
    """Per-tensor activation scales, "layers.<i>.<input>.act_scale" -> amax / 448, from the fp32
    model on `prompts` (token id lists), run on the CPU. With `head` (an EAGLE head as a
    1-layer checkpoint, build/heads/eagle.head_checkpoint): the head's, run on the target's
    features of the same prompts, as it drafts (x_{t+1} with the feature of x_t; an EAGLE-3 head:
    its fc `head_fc` over the target's `features` layers, drafters/eagle.head_features)."""
    from backend.drafters.eagle import HostFC, head_features
    from backend.runtime.torch_model import FP8_MAX

    with tempfile.TemporaryDirectory() as tmp:
        rt = _fp32_runtime(ck, max_seq_len, tmp, features)
        probe = _fp32_runtime(head, max_seq_len, tmp) if head is not None else rt
    fc = None if head_fc is None else HostFC(head_fc)                 # repacked once, not per prompt
    linears = probe.model.linears()
    for lin in linears.values():
        lin.amax = []
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
    return {f"{name}.act_scale": margin * max(lin.amax) / FP8_MAX for name, lin in linears.items()}


def calibration_prompts(tokenizer, n: int = 24, max_tokens: int = 384) -> list[list[int]]:
    """Chat-templated prompts from the Python standard library's docstrings (train/prompts.py)."""
    from backend.train.prompts import build_prompts

    return [tokenizer.encode(tokenizer.apply_chat_template(m), add_special_tokens=False)[:max_tokens]
            for m in build_prompts(n, seed=1)]


def export_all(ck: Checkpoint, formats, max_seq_len: int, engine_dir: Path, tokenizer_json: Path, log,
               features: tuple[int, ...] = ()):
    """The target in every format (FP8 calibrated first) -> ({format: EngineFile}, {format: s});
    `features`: EAGLE-3's layers, which the torch runtime outputs (EngineFile.feature_layers)."""
    import time

    from backend.tokenizer import Tokenizer

    act = None
    if WeightFormat.FP8 in formats:
        t0 = time.time()
        tok = Tokenizer(tokenizer_json, ck.tokenizer.chat_template, ck.config.eos_token_ids,
                        ck.config.bos_token_id, ck.tokenizer.add_bos_token)
        prompts = calibration_prompts(tok)
        act = calibrate(ck, prompts, max_seq_len)
        log(f"FP8 activation scales calibrated on {len(prompts)} prompts in {time.time() - t0:.1f}s")
    engines, timings = {}, {}
    for fmt in formats:
        t0 = time.time()
        engines[fmt.value] = replace(export(ck, fmt, ck.config.num_layers, engine_dir, f"target_{fmt.value}", act),
                                     feature_layers=features)
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
