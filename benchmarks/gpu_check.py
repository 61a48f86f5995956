"""The GPU check in one run (benchmarks/gpu_check.sh calls it): every step below, each within
its share of a time budget (BUDGET, 420 s; the shares add up to it, so the real run ends within
the budget plus the last step's 30 s grace: under 8 minutes of device time with the start), then
OUTDIR/gpu_summary.md and .json (benchmarks/gpu_summary.py). The correctness steps are
benchmarks/gpu_steps.py, the timing steps benchmarks/gpu_timing.py (each timed point's ms, bytes,
GB/s, fraction of the bandwidth step's copy bandwidth and launches; the summary's roofline).
Needs python3, torch, triton and numpy, no network, installs nothing; the speculative bench also
needs the repository's CPU extras (gguf, tokenizers, jinja2, safetensors) and a GGUF.

    python benchmarks/gpu_check.py --out DIR [--gguf PATH] [--budget 420]
    python benchmarks/gpu_check.py --out DIR --dry-run [--gguf PATH]

--dry-run runs every step on the CPU with small shapes and the same code up to the device calls
(the correctness steps' kernels in Triton's interpreter, CUDA graphs by step_graph.EagerGraph),
the subcommands with small arguments (check-kernels --quick; pytest --collect-only; the build and
the bench, its warm-up pass included, on the real GGUF with 1 prompt of 8 tokens), and exits 1
unless every step was exercised. The real run exits 1 if a step failed or raised. A GGUF too
large to carry comes in parts (benchmarks/gpu_payload.py): --gguf PATH with PATH.part0,
PATH.part1 ... beside it is joined and checked against PATH.sha256; a `site` folder beside it
(the gguf reader) goes on the subcommands' PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from gpu_summary import Check, Summary  # noqa: E402

# step: (what it measures, target, file and function to look at on failure, real budget s). The
# shares add up to BUDGET: the real run, every step at its share, ends within BUDGET + 30 s (the
# grace of the last step's alarm), under 8 minutes of device time with the start.
BUDGET = 420.0
STEPS = {
    "env": ("GPU, driver, library versions", "a CUDA GPU with FP8 (sm >= 8.9)",
            "nvidia-smi; torch.cuda", 5),
    "bandwidth": ("this device's copy bandwidth (a device-to-device copy, read + write bytes): every timing "
                  "step's fraction of bandwidth and roofline are against it", "recorded",
                  "benchmarks/gpu_timing.py bandwidth", 5),
    "kernels": ("`specdec check-kernels`: tree attention, verify, their TensorRT-plugin variants "
                "and the engine graph against the numpy references",
                "attention max |err| <= 1e-3 and bitwise invariant; verify identical",
                "plugins/kernels.py tree_attention / verify (cases: backend/bench/kernel_check.py)", 90),
    "logits": ("the torch runtime on the device (fp32, bf16) vs the CPU runtime (fp32, references), "
               "random 135M-shaped weights, same prompt", "fp32 relative diff <= 1e-3; bf16 top-1 >= 0.9",
               "backend/runtime/torch_model.py TorchModel.forward; backend/runtime/torch_rt.py _SlotKV.attend", 20),
    "tree_invariance": ("bf16, invariant mode: one verify of a 16-node chain vs 16 single steps, both slots "
                        "prefilled with the same prompt (the batch-invariant kernels: linear, rmsnorm, tree "
                        "attention)", "max |logit diff| == 0",
                        "plugins/kernels.py linear / rmsnorm / tree_attention; backend/runtime/torch_model.py "
                        "TorchModel.invariant", 15),
    "cuda_graphs": ("bf16, invariant mode: CUDA-graph replay (padded buckets) vs eager on the same steps from "
                    "the same prompts (prefills, a batch of trees, single tokens, then speculative steps whose "
                    "forward, LM head and verification are one graph: greedy and seeded sampled rows)",
                    "max |logit and hidden diff| == 0, verdicts identical",
                    "backend/runtime/torch_rt.py TorchRuntime._replay / _step; backend/runtime/step_graph.py", 25),
    "verify_cost": ("Llama-3-8B shape, bf16, batch 1, context 512: cost(16 tree nodes) / cost(1 node); "
                    "each width's ms, bytes, GB/s, fraction of bandwidth; launches of T = 1, 16",
                    "<= 1.15", "plugins/kernels.py tree_attention (the nodes' loop over the context); "
                    "backend/runtime/torch_rt.py TorchRuntime._compute", 25),
    "cost_curves": ("cost(T)/cost(1) for T in 1..64 at batch 1, 8, 32: 135M shape, 8B shape at batch 8, 32 "
                    "(each point's ms, bytes, GB/s, fraction of bandwidth)",
                    "recorded (the build measures its own)", "benchmarks/gpu_timing.py cost_curve", 40),
    "fp8_hardware": ("which FP8 recipes torch._scaled_mm runs here, equal to the emulation",
                     "channel-tensor and channel-token in hardware (block128 reported)",
                     "backend/runtime/torch_model.py hardware_fp8, Linear._scaled_mm", 5),
    "fp8_decode": ("Llama-3-8B shape plain decode tokens/s, ms, GB/s, fraction of bandwidth, launches: bf16 by the "
                   "Triton linear, bf16 by cuBLAS (torch's linear) beside it, W8A16 (every linear weight-only, "
                   "plugins/kernels.linear_w8, what the GPU's invariant mode runs for every FP8 engine at decode "
                   "and verify widths) and each FP8 recipe as W8A8 (torch._scaled_mm where it runs, else "
                   "emulated; batch 1, 8); for the first recipe torch._scaled_mm runs, W8A8 vs W8A16 by "
                   "prefill width (devices/cuda/w8a8.py: what sets an FP8 engine's w8a8_from)",
                   "best native FP8 (hardware recipe or W8A16) >= 1.5x bf16 at batch 1",
                   "plugins/kernels.py linear_w8_kernel; backend/runtime/torch_model.py Linear._scaled_mm; "
                   "backend/runtime/fp8.py quantize_input", 70),
    "spec_bench": ("the real GGUF built (--device cuda, bf16) and `specdec bench --drafter prompt-lookup` "
                   "after a warm-up pass of every prompt in every mode; ratio by tokens/s and per token (TPOT)",
                   "speculative output identical to plain; speedups recorded",
                   "backend/bench/spec_bench.py; backend/runtime/torch_rt.py forward / verify", 75),
    "plugin_kernel_tests": ("pytest tests/test_kernels.py -k 'not ptx' on the device (the kernels compiled and "
                            "run; the sm_90 PTX compiles are CI's, under both Triton versions)", "all pass",
                            "plugins/kernels.py *_plugin_kernel; tests/test_kernels.py", 45),
}

class Budget(Exception):
    pass


def _alarm(seconds: float):
    def fire(*_):
        raise Budget(f"over its time share ({seconds:.0f} s)")
    signal.signal(signal.SIGALRM, fire)
    signal.alarm(max(1, int(seconds)))


def _sub(args: list[str], timeout: float, log: Path) -> subprocess.CompletedProcess:
    """A subcommand with the repository on PYTHONPATH, its output in `log`."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "w") as f:
        p = subprocess.run(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    return p


def machine(dry: bool) -> dict:
    import torch
    import triton

    m = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
         "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        m.update(gpu=torch.cuda.get_device_name(0), capability=f"{major}.{minor}")
    else:
        m.update(gpu=f"none: CPU {platform.processor() or platform.machine()} (dry run)" if dry else "none",
                 capability="-")
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        m["driver"] = q.stdout.strip() or q.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        m["driver"] = f"nvidia-smi: {type(exc).__name__}"
    return m


class Run:
    """The steps' implementations; each returns (value, passed: bool | None)."""

    def __init__(self, out: Path, dry: bool, gguf: str | None, log=print):
        import gpu_steps
        import gpu_timing

        self.out, self.dry, self.gguf, self.log, self.S, self.T = out, dry, gguf, log, gpu_steps, gpu_timing
        self.plan = gpu_steps.Plan.dry() if dry else gpu_steps.Plan.real()
        self.bw = None                  # the bandwidth step's, for every timing step's fraction and roofline
        self.py = sys.executable
        self.scratch = Path(tempfile.mkdtemp(prefix="specdec_gpu_check_"))   # big files stay out of OUTDIR

    def env(self, t):
        m = machine(self.dry)
        cap = tuple(int(x) for x in m["capability"].split(".")) if m["capability"] != "-" else (0, 0)
        return m, cap >= (8, 9)

    def kernels(self, t):
        quick = ["--quick"] if self.dry else []
        p = _sub([self.py, "-m", "backend.cli", "check-kernels", "--json", str(self.out / "kernels.json"), *quick], t,
                 self.out / "kernels.log")
        if not (self.out / "kernels.json").exists():
            tail = (self.out / "kernels.log").read_text().strip().splitlines()[-1:]
            raise RuntimeError(f"check-kernels wrote no JSON (exit {p.returncode}): {' '.join(tail)}")
        r = json.loads((self.out / "kernels.json").read_text())
        value = {k["name"]: {"max_abs_err": k["max_abs_err"], "ok": k["ok"], **({"skipped": k["skipped"]}
                                                                                if "skipped" in k else {})}
                 for k in r["kernels"]}
        return value, p.returncode == 0

    def bandwidth(self, t):
        self.bw = self.T.bandwidth(self.plan)
        return self.bw, None

    def logits(self, t):
        r = self.S.logits(self.plan)
        return r, r["fp32"]["max_rel_logit_diff"] <= 1e-3 and r["bf16"]["top1_agreement"] >= 0.9

    def tree_invariance(self, t):
        r = self.S.invariance(self.plan)
        return r, r["greedy_identical"] and r["max_abs_logit_diff"] == 0.0

    def cuda_graphs(self, t):
        r = self.S.graphs(self.plan)
        return r, (r["max_abs_logit_diff"] == 0.0 and r["verdicts_identical"] and r["graphs_captured"] > 0
                   and r["step_graphs_captured"] > 0)

    def verify_cost(self, t):
        r = self.T.cost_curve(self.plan, "llama3-8b", batches=(1,), bw=self.bw, log=self.log)["b1"]
        by = r["by_width"]
        lines = [self.T.roofline(f"8B bf16 B=1 T={w}", by[w]) for w in ("1", "16") if w in by]
        return {"ratio_T16": r["ratio"].get("16"), "b1": r, "roofline": lines}, (r["ratio"].get("16") or 9) <= 1.15

    def cost_curves(self, t):
        b = self.plan.batches
        r = {"smollm2-135m": self.T.cost_curve(self.plan, "smollm2-135m", bw=self.bw, log=self.log),
             "llama3-8b": self.T.cost_curve(self.plan, "llama3-8b", batches=b[1:], bw=self.bw, log=self.log)}
        r["roofline"] = [self.T.roofline(f"{name} bf16 B={bk[1:]} T={w}", c["by_width"][w])
                         for name, curves in r.items() for bk, c in curves.items() for w in ("1", "16")
                         if w in c["by_width"]]
        return r, None

    def fp8_hardware(self, t):
        r = self.S.fp8_hardware(self.plan)
        self.hw = r
        return r, r["channel-tensor"] and r["channel-token"]

    def fp8_decode(self, t):
        """bf16 by the Triton linear and by cuBLAS, W8A16, then each recipe while its share of
        the budget lasts (a format is skipped when less than 1.5x the last one's time is left)."""
        from backend.runtime import fp8

        deadline = time.time() + t
        n = self.plan.shapes["llama3-8b"].num_layers
        w8a16 = fp8.recipe("g32-token").with_weight_only(      # every linear weight-only: kernels.linear_w8
            [f"layers.{i}.{k}" for i in range(n) for k in ("qkv", "o", "gate_up", "down")])
        formats = [("bf16", "bf16", None, None), ("bf16_cublas", "bf16", None, False), ("w8a16", "fp8", w8a16, None),
                   *((r.name, "fp8", r, False) for r in fp8.RECIPES)]   # W8A8: invariant mode runs W8A16
        r, last, width = {}, 0.0, None
        for name, fmt, rec, invariant in formats:
            if time.time() + 1.5 * last > deadline:
                r[name] = {"skipped": "time budget"}
                continue
            t0 = time.time()
            # the first W8A8 recipe torch._scaled_mm runs also measures the build's W8A8 width
            wmax = None if width is not None or invariant is not False else (64 if self.dry else 2048)
            r[name] = self.T.decode_speed(self.plan, fmt, rec, invariant, bw=self.bw, log=self.log, w8a8_max=wmax)
            if r[name]["hardware_fp8"] and "w8a8_width" in r[name]:
                width = r[name]["w8a8_width"]
            last = time.time() - t0
        base = r["bf16"]["b1_tokens_per_s"]
        speedups = {k: round(v["b1_tokens_per_s"] / base, 3) for k, v in r.items()
                    if k != "bf16" and "skipped" not in v}
        lines = [self.T.roofline(f"8B decode {k} B={b}", v[f"b{b}"]) for k, v in r.items() if "skipped" not in v
                 for b in (1, 8)]
        # run natively: torch._scaled_mm's recipes, and W8A16 by its own kernel (not an emulation)
        best = max((s for k, s in speedups.items() if k == "w8a16" or r[k]["hardware_fp8"]), default=0.0)
        return {"speedup_b1": speedups, "by_format": r, "roofline": lines,
                "w8a8_width": width or "no recipe ran torch._scaled_mm here"}, best >= 1.5

    def spec_bench(self, t):
        gguf = self._gguf()
        if gguf is None:
            return "skipped: no GGUF given (--gguf)", "skip"
        repo = self.scratch / "repo"
        t0 = time.time()
        build = [self.py, "-m", "backend.cli", "build", "--device", "cuda", "--target", str(gguf), "--weights",
                 "bf16", "--no-invariance-check", "--no-cost-model", "--max-seq-len", "1024", "--output", str(repo)]
        p = _sub(build, t, self.out / "build.log")
        if p.returncode:
            raise RuntimeError(f"build exited {p.returncode} (build.log)")
        limit, new = (1, 8) if self.dry else (0, 128)
        code = ("import sys; sys.path.insert(0, 'benchmarks'); import gpu_steps; "
                "gpu_steps.spec_bench(sys.argv[1], sys.argv[2], int(sys.argv[3]) or None, int(sys.argv[4]))")
        bench = [self.py, "-c", code, str(repo), str(self.out / "spec_bench.json"), str(limit), str(new)]
        p = _sub(bench, max(10, t - (time.time() - t0)), self.out / "spec_bench.log")
        if p.returncode:
            raise RuntimeError(f"bench exited {p.returncode} (spec_bench.log)")
        r = json.loads((self.out / "spec_bench.json").read_text())
        return spec_value(r), bool(r.get("all_identical_to_plain"))

    def plugin_kernel_tests(self, t):
        args = [self.py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_kernels.py",
                "-k", "not ptx"]                # the sm_90 PTX compiles are CI's (.ci/run)
        p = _sub(args + (["--collect-only"] if self.dry else []), t, self.out / "kernel_tests.log")
        tail = (self.out / "kernel_tests.log").read_text().strip().splitlines()[-1:]
        return (tail[0] if tail else ""), p.returncode == 0

    def _gguf(self) -> Path | None:
        if not self.gguf:
            return None
        from gpu_payload import join

        return join(Path(self.gguf), self.scratch)


def spec_value(r: dict) -> dict:
    """The spec bench step's value: the speedup by tokens/s and per token (plain TPOT / speculative
    TPOT: the decoding a drafter changes, first token apart), each mode's TPOT and first token,
    and the warm-up pass's first token (what compilation cost before the clock ran)."""
    p, s = r["plain"], r["spec"]
    value = {k: r.get(k) for k in ("speedup", "acceptance_rate", "mean_accepted_tokens", "all_identical_to_plain")}
    value.update(speedup_per_token=round(p["tpot_ms"] / s["tpot_ms"], 3) if s["tpot_ms"] else None,
                 plain_tokens_per_s=p["tokens_per_s"], spec_tokens_per_s=s["tokens_per_s"],
                 plain_tpot_ms=p["tpot_ms"], spec_tpot_ms=s["tpot_ms"], plain_ttft_ms=p["ttft_ms"],
                 spec_ttft_ms=s["ttft_ms"],
                 warmup_plain_ttft_ms=r.get("warmup_pass", {}).get("plain", {}).get("ttft_ms"))
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--gguf", default=None, help="the speculative bench's model (or the stem of its parts)")
    ap.add_argument("--budget", type=float, default=BUDGET, help="seconds for all steps (real run)")
    ap.add_argument("--steps", default=None, help="comma-separated subset (default: all)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")        # before plugins.kernels is imported
    site = Path(args.gguf).parent / "site" if args.gguf else None
    if site is not None and site.is_dir():                    # the GGUF reader carried beside the parts
        os.environ["PYTHONPATH"] = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.steps.split(",") if args.steps else list(STEPS)
    summary = Summary(dry_run=args.dry_run)
    t_start = time.time()
    run = Run(out, args.dry_run, args.gguf)
    total_share = sum(STEPS[n][3] for n in names) or 1
    for name in names:
        what, target, look_at, share = STEPS[name]
        c = Check(name, what, target, look_at)
        summary.checks.append(c)
        left = args.budget - (time.time() - t_start)
        limit = 600.0 if args.dry_run else min(left, max(share, share / total_share * args.budget))
        t0 = time.time()
        if not args.dry_run and summary.machine.get("gpu") == "none":
            c.status, c.detail = "skipped", "no CUDA GPU here (on a CPU: --dry-run)"
        elif limit < min(share, 15) and not args.dry_run:
            c.status, c.detail = "skipped", f"time budget spent ({left:.0f} s left)"
        else:
            print(f"== {name}: {what}", flush=True)
            try:
                _alarm(limit + 30)          # a subcommand's own timeout fires first
                c.value, passed = getattr(run, name)(limit)
                signal.alarm(0)
                if passed == "skip":
                    c.status, c.detail = "skipped", str(c.value)
                elif args.dry_run:
                    c.status = "exercised"
                else:
                    c.status = "pass" if passed or passed is None else "fail"
            except Exception as exc:                        # keep what the other steps measure
                signal.alarm(0)
                c.status, c.detail = "error", f"{type(exc).__name__}: {exc}"[:400]
        c.seconds = round(time.time() - t0, 1)
        if name == "env" and isinstance(c.value, dict):
            summary.machine = c.value
        summary.seconds = time.time() - t_start
        summary.write(out)                                  # after every step: a killed run keeps it
        print(f"   {c.status} in {c.seconds} s {c.detail}", flush=True)
    print((out / "gpu_summary.md").read_text())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
