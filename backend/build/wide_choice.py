"""Which matrices of a native (gguf) engine take wide activations, chosen by measured agreement:
the fewest that keep the model's answers.

The native kernel quantizes each matrix's input to int8 blocks of 32 (scale amax / 127, as
llama.cpp's Q8 activations). On most models that keeps the top-1 token; on a model with outlier
activations it does not: Gemma-3-270M's native logits agreed 0.978 top-1 with transformers on
the same dequantized weights, and transformers itself with only its linears' inputs quantized
that way 0.976 (perf-notes §17). Wide activations (kernels.h act_q.wide) add a second int8 row,
the residual x - dx q, so the input carries ~14 bits (its error ~300x smaller): the weights are
still read once, the dot products of that matrix double.

The measure: the engine with every family wide is the reference (float activations on the same
weights, within the residual's rounding); each candidate's top-1 token is compared with the
reference's at every position of PROBE_PROMPTS calibration prompts (the stdlib-docstring prompts
of train/prompts.py, never the benchmark's), PROBE_TOKENS tokens each, one prefill forward per
prompt. Candidates, in order: none wide; then, from all wide, each family made narrow again,
the largest first (the most dot products saved), kept narrow where the agreement stays at BAR
or above. The families do not add up: int8 errors of different matrices partly cancel, so one
family wide alone can agree less than none (SmolLM2-135M: none 0.977, `down` alone 0.976,
every family 1.000 against transformers' float logits on the same weights), which is why the
search removes from the reference rather than adding to nothing. The report (the choice, the
bar, every candidate measured) goes into the manifest (EngineFile.activations).
Knows: the measure and the order. Does not know: files beyond the engine it is given, devices.
"""
from __future__ import annotations

import time

import numpy as np

from backend.runtime.native import WIDE_FAMILIES

# top-1 agreement with the all-wide reference. The target is 0.99 against the float model; the
# reference agrees with it (Gemma-3-270M: 1.0000 over the 1,690 public-prompt positions of
# tests/test_gemma3_real.py), and the margin covers the probe's sampling error (~0.0015 at a few
# thousand positions) and its prompts not being the user's: at 0.99 on 430 positions the build
# once kept Gemma's LM head narrow at 0.9907, which read 0.9893 on the public prompts.
BAR = 0.995
PROBE_PROMPTS, PROBE_TOKENS = 24, 256


def parse(value: str) -> tuple[str, ...] | None:
    """`--wide-activations`: "auto" -> None (measured), "none" -> (), "all", or families by
    comma ("qkv,lm_head"); a ValueError naming the unknown ones."""
    if value == "auto":
        return None
    if value in ("none", ""):
        return ()
    if value == "all":
        return tuple(WIDE_FAMILIES)
    names = tuple(dict.fromkeys(v.strip() for v in value.split(",")))
    unknown = [n for n in names if n not in WIDE_FAMILIES]
    if unknown:
        raise ValueError(f"unknown matrix families {unknown}; choose from {list(WIDE_FAMILIES)}, "
                         f"'all', 'none' or 'auto'")
    return names


def _top1(rt, prompts: list[np.ndarray]) -> np.ndarray:
    """The argmax token at every position of every prompt (one prefill forward each)."""
    out = []
    for ids in prompts:
        rt.alloc(0)
        o = rt.forward([0], ids[None], np.arange(-1, ids.size - 1, dtype=np.int32)[None], np.arange(ids.size)[None])
        rt.free(0)
        out.append(np.argmax(o.logits[0], -1))
    return np.concatenate(out)


def family_sizes(cfg) -> dict[str, int]:
    """The weights (elements) of each family over the model: its dot products per row."""
    h, L, d = cfg.hidden_size, cfg.num_layers, cfg.head_dim
    return {"qkv": L * h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d, "o": L * cfg.num_heads * d * h,
            "gate_up": L * 2 * h * cfg.intermediate_size, "down": L * cfg.intermediate_size * h,
            "lm_head": cfg.vocab_size * h}


def choose(rt, prompts: list[list[int]], log, max_tokens: int = PROBE_TOKENS) -> tuple[tuple[str, ...], dict]:
    """The wide families for the engine `rt` runs (runtime/native.py NativeRuntime; left with
    none wide) and the report for the manifest; each prompt cut to max_tokens (at most the
    engine's positions)."""
    t0 = time.time()
    probe = [np.asarray(p[:max_tokens], np.int64) for p in prompts[:PROBE_PROMPTS]]
    families = tuple(WIDE_FAMILIES)
    rt.model.set_wide(families)
    reference = _top1(rt, probe)
    measured: list[dict] = []

    def agreement(wide: tuple[str, ...]) -> float:
        rt.model.set_wide(wide)
        a = round(float(np.mean(_top1(rt, probe) == reference)), 4)
        measured.append({"wide": list(wide), "top1_agreement": a, "meets_bar": a >= BAR})
        log(f"wide activations {list(wide) or 'none'}: top-1 agreement with all wide {a:.4f}"
            f"{'  (meets the bar)' if a >= BAR else ''}")
        return a

    chosen, best = (), agreement(())
    if best < BAR:
        chosen, best = families, 1.0                   # the reference itself
        sizes = family_sizes(rt.config)
        for f in sorted(families, key=sizes.get, reverse=True):
            trial = tuple(x for x in chosen if x != f)
            a = agreement(trial) if trial else best    # () was measured first
            if trial and a >= BAR:
                chosen, best = trial, a
    rt.model.set_wide(())
    report = {"wide": list(chosen), "chosen_by": "measured", "bar": BAR, "meets_bar": best >= BAR,
              "reference": "every family wide", "prompts": len(probe), "positions": int(reference.size),
              "measured": measured, "seconds": round(time.time() - t0, 1)}
    return chosen, report
