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
of buildlib/prompts.py, never the benchmark's), PROBE_TOKENS tokens each, one prefill forward per
prompt. Candidates, in order: none wide; then, from all wide, each family made narrow again,
the largest first (the most dot products saved), kept narrow where the agreement stays at BAR
or above. The families do not add up: int8 errors of different matrices partly cancel, so one
family wide alone can agree less than none (SmolLM2-135M: none 0.977, `down` alone 0.976,
every family 1.000 against transformers' float logits on the same weights), which is why the
search removes from the reference rather than adding to nothing.

Then the price (issue 44: a default costs no speed; issue 53: as a user pays it): the chosen
families against int8 on this machine's matmul path (AMX tiles or VNNI), in three forwards after
a prefilled context: a plain decode step (T=1), a speculative verify of 8 rows and a 64-token
prefill chunk, the settings alternated forward by forward at the engine's serving thread count,
timed by the wall clock where other processes leave the cores idle (else on one engine thread by
its CPU time: price.py says why). The cost is the worst of the three:
wide doubles the integer dots of what it covers, which a step bound by the weight read hides and
a prefill pays (the 3B shape's all-wide choice read +0.5% on a one-thread step and cost its
prefill x1.82, perf-notes §37, §45). Where wide costs more than MAX_COST, the default is int8 and
the report says what `--wide-activations` would buy (its agreement) and what it would cost.

At the sizes users run (issue 53: an 8B's forward over a probe is minutes, and the search runs up
to seven), the default measures no more than it needs: where int8 misses the bar, the family
with the fewest dot products is priced alone first; every choice holds at least one family, so
where that one already costs more than MAX_COST the default is int8 whatever the search would
find, and the search is not run (`--wide-activations fidelity` runs it). A model reading more than
SAMPLE_BYTES a token probes a sample of the prompts' positions (at least MIN_POSITIONS), and the
price reads each shape as few times as its time allows (price.SHAPE_S: the 3B shape's price
took 44.5 s on a loaded machine, perf-notes §45). The report (the choice, the bar, every
candidate measured, the price) goes into the manifest
(NativeRecord.activations).
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
# the most a default's wide families may cost the worst of a step, a verify and a prefill chunk
# (the developers' guide: a build choice that trades speed for anything else is not the default
# past a 3% speed cost)
MAX_COST = 0.03
# the probe's positions past SAMPLE_BYTES of weights a token: PROBE_PROMPTS x PROBE_TOKENS scaled
# down with the bytes, never below MIN_POSITIONS (the bar's sampling error there ~0.002)
SAMPLE_BYTES, MIN_POSITIONS = 1_000_000_000, 1024


FIDELITY = "fidelity"


def parse(value: str) -> tuple[str, ...] | str | None:
    """`--wide-activations`: "auto" -> None (measured by fidelity, then priced: decide),
    "fidelity" -> FIDELITY (measured by fidelity alone, whatever it costs: choose), "none" -> (),
    "all", or families by comma ("qkv,lm_head"); a ValueError naming the unknown ones."""
    if value == "auto":
        return None
    if value == FIDELITY:
        return FIDELITY
    if value in ("none", ""):
        return ()
    if value == "all":
        return tuple(WIDE_FAMILIES)
    names = tuple(dict.fromkeys(v.strip() for v in value.split(",")))
    unknown = [n for n in names if n not in WIDE_FAMILIES]
    if unknown:
        raise ValueError(f"unknown matrix families {unknown}; choose from {list(WIDE_FAMILIES)}, "
                         f"'all', 'none', 'fidelity' or 'auto'")
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


def probe_positions(weight_bytes: int | None) -> int | None:
    """The most positions the probe reads for an engine of `weight_bytes` a token (None: all)."""
    if not weight_bytes or weight_bytes <= SAMPLE_BYTES:
        return None
    return max(MIN_POSITIONS, PROBE_PROMPTS * PROBE_TOKENS * SAMPLE_BYTES // weight_bytes)


def _sample(prompts: list[list[int]], max_tokens: int, positions: int | None) -> list[np.ndarray]:
    """The probe: the first PROBE_PROMPTS prompts cut to max_tokens, and the whole of them no
    longer than `positions` (the last one cut)."""
    probe, left = [], positions if positions is not None else float("inf")
    for p in prompts[:PROBE_PROMPTS]:
        ids = np.asarray(p[:min(max_tokens, left)], np.int64)
        if ids.size:
            probe.append(ids)
            left -= ids.size
    return probe


def choose(rt, prompts: list[list[int]], log, max_tokens: int = PROBE_TOKENS, positions: int | None = None,
           gate=None) -> tuple[tuple[str, ...], dict]:
    """The wide families for the engine `rt` runs (runtime/native.py NativeRuntime; left with
    none wide) and the report for the manifest; each prompt cut to max_tokens (at most the
    engine's positions), all of them to `positions` (probe_positions). gate: asked once int8 has
    missed the bar, before the search; a report to end with int8 (decide's price of the cheapest
    family), or None to search."""
    t0 = time.time()
    probe = _sample(prompts, max_tokens, positions)
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
    stop = gate() if gate is not None and best < BAR else None
    if stop is not None:
        rt.model.set_wide(())
        return (), {"wide": [], "chosen_by": "measured, priced", "bar": BAR, "meets_bar": False,
                    "reference": "every family wide", "prompts": len(probe), "positions": int(reference.size),
                    "measured": measured, "searched": False, "price": stop, "seconds": round(time.time() - t0, 1)}
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


def price(rt, wide: tuple[str, ...], prompt: list[int], log) -> dict:
    """What `wide` costs against int8 on this machine's matmul path (AMX tiles or VNNI), as a user
    pays it: a plain step, a verify of a speculative chain and a prefill chunk after a context of
    the prompt's first tokens, at the engine's serving thread count, the worst of the three
    (price.py: the shapes, the pairs, the clock) -> {"families", "path", "threads", "shapes",
    "cost", "worst", "max_cost", "seconds"}; rt left with none wide."""
    from backend.devices.native import price as reading
    from backend.runtime import native

    t0 = time.time()
    got = reading.read(rt, wide, prompt)
    out = {"families": list(wide), "path": native.isa(), **got, "max_cost": MAX_COST,
           "seconds": round(time.time() - t0, 1)}
    each = ", ".join(f"{k} {100 * v['cost']:+.1f}% ({v['ms_wide']:.2f} vs {v['ms_int8']:.2f} ms, "
                     f"{v['threads']} thread{'s' if v['threads'] > 1 else ''}{'' if v['threads'] > 1 else ' CPU'})"
                     for k, v in got["shapes"].items())
    log(f"wide activations {list(wide)} cost {100 * out['cost']:+.1f}% ({out['worst']}; {each}; {out['path']}; "
        f"the default allows {100 * MAX_COST:.0f}%; priced in {out['seconds']}s)")
    return out


def decide(rt, prompts: list[list[int]], log, max_tokens: int = PROBE_TOKENS,
           positions: int | None = None) -> tuple[tuple[str, ...], dict]:
    """The default: the families `choose` finds by fidelity, priced on this machine; int8 where
    they cost more than MAX_COST, the report saying what they would buy and cost. The search runs
    only where the family with the fewest dot products, priced alone, costs MAX_COST or less."""
    sizes = family_sizes(rt.config)
    cheapest = min(WIDE_FAMILIES, key=sizes.get)

    def gate():
        p = price(rt, (cheapest,), prompts[0][:max_tokens], log)
        if p["cost"] <= MAX_COST:
            return None
        log(f"wide activations: int8 by default here, the search not run (every choice holds a family, and "
            f"{cheapest}, the cheapest, alone costs {100 * p['cost']:.1f}% of a {p['worst']}); "
            f"--wide-activations fidelity runs it")
        return p

    wide, report = choose(rt, prompts, log, max_tokens, positions, gate)
    if not wide:
        return wide, report
    report["price"] = price(rt, wide, prompts[0][:max_tokens], log)
    if report["price"]["cost"] <= MAX_COST:
        return wide, report
    report.update({"wide": [], "chosen_by": "measured, priced", "by_fidelity": list(wide)})
    agreement = next(m["top1_agreement"] for m in report["measured"] if m["wide"] == [])
    log(f"wide activations: int8 by default here (wide costs {100 * report['price']['cost']:.1f}% of a "
        f"{report['price']['worst']}); --wide-activations {','.join(wide)} would raise top-1 agreement with all "
        f"wide from {agreement:.4f} to >= {BAR}")
    return (), report
