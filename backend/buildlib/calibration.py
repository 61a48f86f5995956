"""Calibration shared by every device's build: the prompts (the Python standard library's
docstrings, buildlib/prompts.py; never the benchmark prompts) and the fp32 model's activation scales
and Hessians on them (FP8 on cuda and tensorrt; the native build's wide-activation probe reads
the prompts).
Knows: checkpoints, the tokenizer, the fp32 torch model. Does not know: devices, engine files.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from backend.buildlib.checkpoint import Checkpoint
from backend.manifest import WeightFormat
from backend.runtime import fp8

def _fp32_runtime(ck: Checkpoint, max_seq_len: int, features: tuple[int, ...] = ()):
    """The fp32 torch model of `ck` on the CPU (the torch engine's tensors, no file written)."""
    from backend.buildlib.fp8 import engine_tensors
    from backend.config import RuntimeOptions
    from backend.runtime.torch_rt import TorchRuntime

    n = ck.config.num_layers
    return TorchRuntime(None, ck.config, n, max_seq_len, RuntimeOptions(max_sequences=1), "cpu",
                        tensors=engine_tensors(ck, WeightFormat.FP32, n, None), feature_layers=features)


def calibrate(ck: Checkpoint, prompts: list[list[int]], max_seq_len: int, margin: float = 1.0,
              head: Checkpoint | None = None, head_fc=None, features: tuple[int, ...] = (),
              hessians: bool = False) -> dict:
    """Per-tensor activation scales, "layers.<i>.<input>.act_scale" -> amax / 448, from the fp32
    model on `prompts` (token id lists), run on the CPU; with `hessians` also each linear's input
    Hessian, "layers.<i>.<linear>.hessian" -> float32 [K, K] sum of x^T x over every prompt
    position (GPTQ's, buildlib/fp8_gptq.py; never written to a file). With `head` (an EAGLE head as a
    1-layer checkpoint, buildlib/heads/eagle.head_checkpoint): the head's, run on the target's
    features of the same prompts, as it drafts (x_{t+1} with the feature of x_t; an EAGLE-3 head:
    its fc `head_fc` over the target's `features` layers, drafters/eagle.head_features)."""
    from backend.drafters.eagle import HostFC, head_features

    rt = _fp32_runtime(ck, max_seq_len, features)
    probe = _fp32_runtime(head, max_seq_len) if head is not None else rt
    fc = None if head_fc is None else HostFC(head_fc, probe)          # repacked once, not per prompt
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
    """Prompts from the Python standard library's docstrings (buildlib/prompts.py): chat-templated,
    or for a model without a template (a base model: Gemma-3-270M) their text with the
    tokenizer's special tokens, as bench/prompt_sets.prompt_ids makes a prompt."""
    from backend.buildlib.prompts import build_prompts

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
