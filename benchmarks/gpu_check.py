"""The GPU check in one run (benchmarks/gpu_check.sh calls it; issues 30, 41, 49): the steps of
STEPS in their order, evidence first, each within its time (its share of the budget and what
earlier steps left unused), then OUTDIR/gpu_summary.md and .json (benchmarks/gpu_summary.py),
rewritten after every step and as a step goes (per test, per format), so a run cut short keeps
what it measured. The step implementations are benchmarks/gpu_run.py.

    python benchmarks/gpu_check.py --out DIR [--carry work/gpu] [--gguf PATH] [--budget S]
    python benchmarks/gpu_check.py --out DIR --dry-run --carry DIR

--carry: the folder gpu_payload.py prepared (model/: the spec bench's shape and tokenizer;
provenance.json: the code's commit where no git is). --gguf: a real model for the spec bench
instead of random weights (needs the gguf package). --dry-run runs every step on the CPU with
the GPU's code at small shapes (the kernels in Triton's interpreter, graphs by
step_graph.EagerGraph, the hardware FP8 GEMM by this CPU's torch._scaled_mm) and exits 1 unless
every step ran to its end and reached the GPU branches REQUIRED of it (counted by name,
benchmarks/gpu_count.py). The real run exits 1 if a step failed, raised or was cut.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from gpu_summary import Check, Summary  # noqa: E402

# The real run's steps in seconds (BUDGET) and the device call around them: the machine's start
# and Python's, torch's and CUDA's start-up come on top (under a minute); the call's timeout,
# CALL_TIMEOUT, cuts it if all goes wrong; a rerun after a fix fits in what a 15-minute session
# has left (docs/building.md, "The real run's plan").
BUDGET = 360.0
CALL_TIMEOUT = 420


@dataclass(frozen=True)
class Step:
    what: str
    target: str
    look_at: str
    share: float                  # seconds promised on the GPU (their sources: the table above STEPS)
    required: tuple = ()          # kernel names the dry run must have launched (gpu_count.py)
    host_ok: bool = False         # the step may run the CPU fallbacks (its reference does)
    exact_on_cpu: bool = False    # its target holds on the dry run's CPU too (bitwise): judged there


# the fused step's launches; SPLIT: a split-K linear's (the 8B shape's o and down; on the dry run's
# small shapes only its 8B stand-in splits)
FUSED = ("embed_kernel", "add_rmsnorm_kernel", "rope_kv_kernel", "tree_attention_kernel", "gate_up_act_kernel",
         "lm_head_kernel", "linear_kernel")
SPLIT = ("linear_split_kernel", "add_rmsnorm_kernel[split]")
GRAPHS = ("graph_capture", "graph_replay")
W8 = ("linear_w8_kernel", "linear_split_kernel[W8]", "gate_up_act_kernel[W8]", "torch._scaled_mm")

# Shares: seconds on an H100 / H200, from the one GPU run (H200, 2026-12-04, code 42f69db: its
# step seconds, docs/results/gpu_2026-12-04_h200.json) against the dry run of that same code on
# this CPU today (issue 49's factor: GPU s / dry-run s), scaled by the work each step does now.
#   step            H200 s   dry s (42f69db)  factor  now
#   env              0.4      1.3             0.3     3 (nvidia-smi)
#   bandwidth        -        -               -       3 (a 2 GiB copy, 6 times)
#   compile          -        -               -       45: ~40 kernel variants at 1-2 s each, 3 processes
#   tests_*          58.4     17.0 (collect)  -       45 + 40: 2.2 s a test there (26 tests), 22 + 21 now
#   tree_invariance  0.0      0.0             -       6: 7 prefills, 16 steps, 3 verifies (then 1)
#   cuda_graphs      1.1      2.9             0.38    10: the speculative step's graphs added
#   fp8_decode      12.7     49.0             0.26    50: 8 formats (then 6), the W8A8 width, graphs
#   verify_cost      8.3      2.6             3.2     15: graph captures per width added
#   cost_curves     28.3      9.5             3.0     40: graph captures per bucket added
#   spec_bench      36.6      34.0 (failed)   -       45: a 270 MB random checkpoint, 2 passes of 64 tokens
#   logits           7.1     20.5             0.35    8
#   fp8_hardware     0.1      0.5             0.2     2
#   kernels         65.9     31.6             2.1     30, last: check-kernels' larger cases of tests_rest's
# The factors spread 0.2-3.2 (compilation, which the CPU's interpreter does not do, against
# interpretation, which the GPU does not do), so a step's time comes from its own row and work;
# what a step leaves unused passes to the next (limit_for), and the run's measured seconds (each
# step's `seconds` in gpu_summary.json) replace these estimates after the first run.
STEPS = {
    "env": Step("GPU, driver, library versions, the code's commit", "a CUDA GPU with FP8 (sm >= 8.9)",
                "nvidia-smi; torch.cuda", 3),
    "bandwidth": Step("this device's copy bandwidth (a device-to-device copy, read + write bytes): every timing "
                      "step's fraction of bandwidth and roofline are against it", "recorded",
                      "benchmarks/gpu_timing.py bandwidth", 3),
    "compile": Step("every Triton kernel the later steps launch compiled up front at the real shapes (2-layer "
                    "models), in parallel processes, into Triton's disk cache", "every part ran",
                    "benchmarks/gpu_warm.py", 45, FUSED + SPLIT + GRAPHS + W8),   # verify: the GPU's only (gpu_warm)
    "tests_evidence": Step("pytest tests/test_kernels.py, its first part on the device: the invariant runtime, "
                           "linear / W8A16 and fused kernels bit for bit against the unfused ops", "all pass",
                           "tests/test_kernels.py (the failing test's kernel in plugins/kernels.py, fused.py)", 45),
    "tree_invariance": Step("bf16, the fused step: verifies of a 16-node chain (alone, as a batch of 4 identical "
                            "rows, at 8 nodes) vs 16 single steps, every slot prefilled with the same prompt",
                            "max |logit diff| == 0",
                            "plugins/kernels.py linear / linear_plan; plugins/fused.py; backend/runtime/"
                            "torch_model.py TorchModel._forward_fused", 6, FUSED, exact_on_cpu=True),
    "cuda_graphs": Step("bf16, the fused step: CUDA-graph replay (padded buckets) vs eager on the same steps from "
                        "the same prompts (prefills, a batch of trees, single tokens, then speculative steps whose "
                        "forward, LM head and verification are one graph: greedy and seeded sampled rows)",
                        "max |logit and hidden diff| == 0, verdicts identical",
                        "backend/runtime/torch_rt.py TorchRuntime._replay / _step; backend/runtime/step_graph.py",
                        10, FUSED + GRAPHS + ("verify_kernel",), exact_on_cpu=True),
    "fp8_decode": Step("Llama-3-8B shape plain decode (batch 1, 8) ms, tokens/s, GB/s, fraction of bandwidth, "
                       "launches: bf16 by the Triton linear, W8A16 (plugins/kernels.linear_w8, every FP8 engine's "
                       "decode), bf16 by cuBLAS beside it, each FP8 recipe as W8A8; the build's W8A8 width "
                       "(devices/cuda/w8a8.py) for the first recipe torch._scaled_mm runs",
                       "8B bf16 b1 <= 4.6 ms and >= 65% of bandwidth; W8A16 b1 <= 2.9 ms",
                       "plugins/kernels.py linear_split_kernel / linear_w8_kernel; plugins/fused.py; "
                       "backend/runtime/torch_model.py Linear._scaled_mm", 50, FUSED + SPLIT + GRAPHS + W8),
    "verify_cost": Step("Llama-3-8B shape, bf16, batch 1, context 512: cost(T tree nodes) / cost(1 node), T to 64; "
                        "each width's ms, bytes, GB/s, fraction of bandwidth; launches of T = 1, 16",
                        "cost(16) <= 1.15 x cost(1)", "plugins/kernels.py tree_attention (the nodes' loop over the "
                        "context); backend/runtime/torch_rt.py TorchRuntime._compute", 15, FUSED + SPLIT + GRAPHS),
    "cost_curves": Step("cost(T)/cost(1) for T to 64: the 135M shape at batch 1, 8, 32, the 8B shape at batch 8, 32 "
                        "(each point's ms, bytes, GB/s, fraction of bandwidth)", "135M b1 T=1 <= 0.6 ms",
                        "benchmarks/gpu_timing.py cost_curve", 40, FUSED + SPLIT + GRAPHS),
    "spec_bench": Step("the spec bench's model built (--device cuda, bf16: random weights of the embedded model's "
                       "shape with its tokenizer, or --gguf) and `specdec bench --drafter prompt-lookup` after a "
                       "warm-up pass of every prompt in every mode",
                       "speculative output identical to plain (speedups recorded)",
                       "backend/bench/spec_bench.py; backend/runtime/torch_rt.py forward_verify", 45,
                       FUSED + GRAPHS + ("verify_kernel",)),
    "logits": Step("the GPU runtime (fp32, bf16) vs the CPU runtime (fp32, numpy attention and verification), "
                   "random 135M-shaped weights, same prompt", "fp32 relative diff <= 1e-3; bf16 top-1 >= 0.9",
                   "backend/runtime/torch_model.py TorchModel.forward; backend/runtime/torch_rt.py _SlotKV.attend",
                   8, FUSED, host_ok=True),
    "fp8_hardware": Step("which FP8 recipes torch._scaled_mm runs here, equal to the emulation",
                         "channel-tensor and channel-token in hardware (block128 reported)",
                         "backend/runtime/torch_model.py hardware_fp8, Linear._scaled_mm", 2, ("torch._scaled_mm",)),
    "tests_rest": Step("pytest tests/test_kernels.py, the rest on the device: tree attention and verify against "
                       "their references, the plugin kernels (the sm_90 PTX compiles are CI's)", "all pass",
                       "tests/test_kernels.py; plugins/kernels.py", 40),
    "kernels": Step("`specdec check-kernels`: tree attention, verify and their TensorRT-plugin variants against the "
                    "numpy references on larger cases", "attention max |err| <= 1e-3 and bitwise invariant; verify "
                    "identical", "plugins/kernels.py tree_attention / verify (cases: backend/bench/kernel_check.py)",
                    30, ("tree_attention_kernel", "verify_kernel", "tree_attention_plugin_kernel",
                         "verify_plugin_kernel"), host_ok=True),
}


def limit_for(share: float, left: float, after: float) -> float:
    """A step's seconds: its share plus what earlier steps left unused (the time left beyond the
    shares of the steps after it); where earlier steps overran, its share cut in proportion."""
    if left >= share + after:
        return left - after
    return share * max(0.0, left) / (share + after)


class Budget(Exception):
    pass


def _alarm(seconds: float):
    def fire(*_):
        raise Budget(f"over its time ({seconds:.0f} s)")
    signal.signal(signal.SIGALRM, fire)
    signal.alarm(max(1, int(seconds)))


def judge_dry(c: Check, step: Step, passed, cpu_lacks: dict | None = None) -> None:
    """The dry run's verdict on a step that ran to its end: exercised where it launched every
    kernel REQUIRED of it (but those this CPU's torch cannot run, `cpu_lacks`: name -> why,
    said in the detail), (unless its reference does) no CPU fallback, and (exact_on_cpu) met its
    target."""
    ran, lacks = c.kernels or {}, cpu_lacks or {}
    missing = [k for k in step.required if not ran.get(k) and k not in lacks]
    host = [k for k in ran if k.startswith("host:")] if not step.host_ok else []
    why = ([f"no launch of {', '.join(missing)}"] if missing else []) + \
        ([f"CPU fallback {', '.join(host)}"] if host else [])
    if why:
        c.status, c.detail = "error", "the GPU's code did not run: " + "; ".join(why)
    elif step.exact_on_cpu and not passed:
        c.status, c.detail = "error", f"not met on the CPU, where it holds too: {step.target}"
    else:
        c.status = "exercised"
        c.detail = "; ".join(f"{k} not run: {lacks[k]}" for k in step.required if k in lacks and not ran.get(k))


def _merged(*counts: dict) -> dict:
    out: dict = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished subcommands (a shared machine's load does
    not inflate them, as it does wall time)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_steps(names: list[str], run, summary: Summary, budget: float, dry: bool, out: Path) -> None:
    from gpu_count import Count

    t_start = time.time()
    for i, name in enumerate(names):
        step = STEPS[name]
        c = Check(name, step.what, step.target, step.look_at)
        summary.checks.append(c)
        left = budget - (time.time() - t_start)
        limit = 600.0 if dry else limit_for(step.share, left, sum(STEPS[n].share for n in names[i + 1:]))
        c.limit = round(limit, 1)
        t0, cpu0 = time.time(), _cpu_seconds()
        if not dry and summary.machine.get("gpu") == "none":
            c.status, c.detail = "skipped", "no CUDA GPU here (on a CPU: --dry-run)"
        elif not dry and limit < min(step.share, 5):
            c.status, c.detail = "skipped", f"time budget spent ({left:.0f} s left)"
        else:
            print(f"== {name} (up to {limit:.0f} s): {step.what}", flush=True)
            run.partial = lambda value, c=c: (setattr(c, "value", value), summary.write(out))
            count = Count()
            try:
                _alarm(limit + (0 if dry else 10))          # a subcommand's own timeout fires first
                with count:
                    c.value, passed = getattr(run, name)(limit)
                signal.alarm(0)
                c.kernels = _merged(count.counts, run.sub_counts.pop(name, {}))
                if passed == "skip":
                    c.status, c.detail = "skipped", str(c.value)
                elif dry:
                    judge_dry(c, step, passed, run.cpu_lacks())
                else:
                    c.status = "pass" if passed or passed is None else "fail"
            except Exception as exc:                        # keep what the other steps measure
                signal.alarm(0)
                c.kernels = _merged(count.counts, run.sub_counts.pop(name, {}))
                c.status, c.detail = "error", f"{type(exc).__name__}: {exc}"[:400]
        c.seconds = round(time.time() - t0, 1)
        c.cpu_seconds = round(_cpu_seconds() - cpu0, 1)
        if name == "env" and isinstance(c.value, dict):
            summary.machine = c.value
        summary.seconds = time.time() - t_start
        summary.write(out)                                  # after every step: a killed run keeps it
        print(f"   {c.status} in {c.seconds} s {c.detail}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--carry", default=None, help="the folder benchmarks/gpu_payload.py prepared")
    ap.add_argument("--gguf", default=None, help="a real model for the spec bench (instead of random weights)")
    ap.add_argument("--budget", type=float, default=BUDGET, help="seconds for all steps (real run)")
    ap.add_argument("--steps", default=None, help="comma-separated subset (default: all, in STEPS' order)")
    args = ap.parse_args(argv)
    import gpu_run

    undo = gpu_run.dry_run_setup() if args.dry_run else (lambda: None)
    try:
        return _main(args, ap)
    finally:
        undo()


def _main(args, ap) -> int:
    from gpu_run import Run

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.steps.split(",") if args.steps else list(STEPS)
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        ap.error(f"--steps: unknown {', '.join(unknown)} (steps: {', '.join(STEPS)})")
    command = os.environ.get("GPU_CHECK_COMMAND") or shlex.join([sys.executable, *sys.argv])
    summary = Summary(dry_run=args.dry_run, command=command, budget=args.budget)
    run = Run(out, args.dry_run, Path(args.carry) if args.carry else None, args.gguf)
    summary.code = run.code
    try:
        run_steps(names, run, summary, args.budget, args.dry_run, out)
    finally:
        shutil.rmtree(run.scratch, ignore_errors=True)
    summary.write(out)
    print((out / "gpu_summary.md").read_text(), flush=True)     # its last line: the verdict
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
