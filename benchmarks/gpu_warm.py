"""The GPU check's compile step (issue 49, point 2): every Triton kernel the later steps launch,
compiled once up front at their real shapes, in parallel processes, into Triton's cache on disk,
which the later steps (and their subprocesses) then load instead of compiling inside their own
time shares. A kernel's compiled variant depends on its constants and on which integer
arguments are 1 or multiples of 16 (strides, N, K, widths), not on the number of layers, so
each part runs the later steps' forwards (the same batches, widths, formats and graphs) once on
a 2-layer model of the real shape: the same variants for a fraction of the memory and time.

    python benchmarks/gpu_warm.py PART [--dry-run]        # one part (gpu_check runs them all)

PARTS: "8b-bf16" (verify_cost, cost_curves, fp8_decode's bf16 rows), "8b-fp8" (fp8_decode's
W8A16 and the recipes), "135m" (cost_curves, logits, tree_invariance, cuda_graphs and the spec
bench's shape, with the speculative step's graph). The dry run runs the same parts on the small
shapes, one batch and two widths of each (Triton's interpreter compiles nothing: it proves the
code runs, and the later steps run every point anyway).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

LAYERS = 2


def _forwards(rt, plan, batches, widths) -> None:
    """Each batch prefilled from the context, then one forward of each width (as the timing
    steps run them: gpu_timing._step)."""
    import numpy as np

    from gpu_steps import prefill, prompt_ids
    from gpu_timing import _step, sync

    for b in batches:
        prefill(rt, list(range(b)), prompt_ids(rt.config, plan.context, b))
        for t in widths:
            _step(rt, b, t, 0, np.random.default_rng(t))()
        for s in range(b):
            rt.free(s)
    sync(plan.device)


def _small(plan, name: str):
    return replace(plan.shapes[name], num_layers=min(LAYERS, plan.shapes[name].num_layers))


def warm_8b_bf16(plan) -> None:
    from gpu_steps import random_tensors, runtime

    cfg = _small(plan, "llama3-8b")
    for invariant in (True, False):                     # the Triton linears; cuBLAS's row beside
        rt = runtime(cfg, random_tensors(cfg, "bf16", plan.device), plan.device, invariant=invariant)
        _forwards(rt, plan, plan.batches if invariant else plan.batches[:2], plan.widths if invariant else (1,))
        rt.close()


def warm_8b_fp8(plan) -> None:
    from backend.runtime import fp8
    from gpu_steps import random_tensors, runtime

    cfg = _small(plan, "llama3-8b")
    w8a16 = fp8.recipe("g32-token").with_weight_only(
        [f"layers.{i}.{k}" for i in range(cfg.num_layers) for k in ("qkv", "o", "gate_up", "down")])
    for rec, invariant in ((w8a16, True), *((r, False) for r in fp8.RECIPES)):
        rt = runtime(cfg, random_tensors(cfg, "fp8", plan.device, rec), plan.device, recipe=rec, invariant=invariant)
        _forwards(rt, plan, plan.batches[:2], (1,))
        rt.close()


def warm_135m(plan) -> None:
    import gpu_steps
    from gpu_steps import random_tensors, runtime

    cfg = _small(plan, "smollm2-135m")
    rt = runtime(cfg, random_tensors(cfg, "bf16", plan.device), plan.device)
    _forwards(rt, plan, plan.batches, plan.widths)
    rt.close()
    if plan.device == "cuda":        # the dry run runs these three steps themselves, right after
        small = replace(plan, shapes={**plan.shapes, "smollm2-135m": cfg})
        gpu_steps.graphs(small)                                      # the speculative step's graph
        gpu_steps.invariance(small)
        gpu_steps.logits(small)


PARTS = {"8b-bf16": warm_8b_bf16, "8b-fp8": warm_8b_fp8, "135m": warm_135m}


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in PARTS:
        sys.exit(__doc__)
    dry = sys.argv[2:] == ["--dry-run"]
    if dry:
        import gpu_run

        gpu_run.dry_run_setup()
    from gpu_steps import Plan

    plan = Plan.real()
    if dry:
        plan = replace(Plan.dry(), batches=Plan.dry().batches[:1], widths=Plan.dry().widths[:2])
    PARTS[sys.argv[1]](plan)
