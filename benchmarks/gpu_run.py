"""The steps of the GPU check (benchmarks/gpu_check.py STEPS runs them in order): each method
takes its time limit in seconds and returns (value, passed: bool | None | "skip"); a long step
hands its partial value to `self.partial` as it goes (the summary is rewritten). The correctness
steps' code is benchmarks/gpu_steps.py, the timing steps' gpu_timing.py. Subcommands run under
benchmarks/gpu_count.py (their launches by name) with their output appended to OUT/steps.log.

OUT holds at most six files (a device call brings back eight): gpu_summary.md and .json,
gpu_check.log (gpu_check.sh's output), steps.log, kernels.json, spec_bench.json.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = "tests/test_kernels.py"
# tests/test_kernels.py's evidence, first in the file and first on the device: the invariant
# runtime, the linear / W8A16 kernels and the fused kernels bit for bit (pytest -k names)
EVIDENCE = ("invariant_runtime", "weight_only", "linear_and_rmsnorm", "add_rmsnorm", "rope_kv", "gate_up_act",
            "lm_head_embed")
TEST_GROUPS = {"tests_evidence": f"not ptx and ({' or '.join(EVIDENCE)})",
               "tests_rest": f"not ptx and not ({' or '.join(EVIDENCE)})"}
DRY_MODEL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}   # the dry run's spec bench


def dry_run_setup():
    """The dry run's CPU runs the GPU's code: the kernels in Triton's interpreter (set before
    plugins.kernels is imported; the subcommands inherit it) and the hardware FP8 GEMM by this
    CPU's torch._scaled_mm. Returns the function that undoes the latter (a test's process goes on)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from backend.runtime import torch_model

    torch_model.SCALED_MM_ON_CPU = True
    return lambda: setattr(torch_model, "SCALED_MM_ON_CPU", False)


def machine(dry: bool) -> dict:
    import torch
    import triton

    m = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
         "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                 memory_gib=round(p.total_memory / 2 ** 30, 1))
    else:
        m.update(gpu=f"none: CPU {platform.processor() or platform.machine()} (dry run)" if dry else "none",
                 capability="-")
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.memory",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        m["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        m["nvidia_smi"] = f"nvidia-smi: {type(exc).__name__}"
    return m


def results_of_tests(log_text: str) -> dict:
    """pytest -v's lines (`path::test STATUS`) -> {"passed": n, "failed": [...], "skipped": n,
    "last": the last test reported} (what ran before a cut, too)."""
    rows = [ln.split(" ", 1) for ln in log_text.splitlines() if "::" in ln and ln.startswith("tests/")]
    status = {name: rest.split()[0] for name, rest in rows if rest.split()}
    failed = [n.split("::", 1)[1] for n, s in status.items() if s in ("FAILED", "ERROR")]
    return {"passed": sum(s == "PASSED" for s in status.values()), "failed": failed,
            "skipped": sum(s == "SKIPPED" for s in status.values()),
            "last": next(reversed(status), None)}


class Run:
    def __init__(self, out: Path, dry: bool, carry: Path | None, gguf: str | None):
        import gpu_payload
        import gpu_steps
        import gpu_timing

        self.out, self.dry, self.carry, self.gguf = out, dry, carry, gguf
        self.S, self.T = gpu_steps, gpu_timing
        self.plan = gpu_steps.Plan.dry() if dry else gpu_steps.Plan.real()
        self.code = gpu_payload.code_identity(carry)
        self.bw = None                  # the bandwidth step's, for every timing step's fraction and roofline
        self.py = sys.executable
        self.scratch = Path(tempfile.mkdtemp(prefix="specdec_gpu_check_"))   # big files stay out of OUT
        self.sub_counts: dict[str, dict] = {}
        self.partial = lambda value: None
        self._lacks: dict | None = None

    def cpu_lacks(self) -> dict:
        """The GPU code this CPU's torch cannot run (name -> why): the dry run reports it, not a
        failure. torch._scaled_mm's row-wise form (the FP8 recipes' hardware GEMM) is on some
        releases' CPU only per tensor (torch 2.11, the GPU image's)."""
        from backend.runtime import fp8
        from backend.runtime.torch_model import probe_scaled_mm

        if not self.dry:
            return {}
        if self._lacks is None:
            import torch

            ok = probe_scaled_mm(torch.device("cpu"), fp8.recipe("channel-token"))
            self._lacks = {} if ok else {"torch._scaled_mm": f"this CPU's torch {torch.__version__} has no "
                                                             "row-wise torch._scaled_mm (the emulation ran)"}
        return self._lacks

    # --- subcommands ---------------------------------------------------------------------------
    def _start(self, step: str, args: list[str], label: str, log: Path | None = None) -> "_Sub":
        """`args` (a module `-m m ...` or a script) started under gpu_count.py, unbuffered, its
        output appended to `log` (default OUT/steps.log, as it goes) under a header."""
        counts = self.scratch / f"counts_{step}_{label}.json"
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [self.py, "-u", str(ROOT / "benchmarks" / "gpu_count.py"), str(counts), *args]
        f = open(log or self.out / "steps.log", "a")
        f.write(f"\n===== {step} / {label}: {' '.join(args)}\n")
        f.flush()
        return _Sub(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT), f, counts, step,
                    label, log)

    def _finish(self, sub: "_Sub", timeout: float) -> int:
        """Wait for a subcommand up to `timeout` s (then kill it: -9; what it printed stays);
        its launches added to its step's counts, a log of its own appended to OUT/steps.log."""
        try:
            code = sub.proc.wait(max(1.0, timeout))
        except subprocess.TimeoutExpired:
            sub.proc.kill()
            sub.proc.wait()
            sub.log.write(f"\n===== {sub.step} / {sub.label}: killed at its limit ({timeout:.0f} s)\n")
            code = -9
        except BaseException:                    # the step's alarm: no subcommand outlives its step
            sub.proc.kill()
            sub.proc.wait()
            sub.log.close()
            raise
        sub.log.close()
        if sub.own_log is not None:
            with open(self.out / "steps.log", "a") as f:
                f.write(sub.own_log.read_text())
        if sub.counts.exists():
            merged = self.sub_counts.setdefault(sub.step, {})
            for k, v in json.loads(sub.counts.read_text()).items():
                merged[k] = merged.get(k, 0) + v
        return code

    def _sub(self, step: str, args: list[str], timeout: float, label: str) -> int:
        return self._finish(self._start(step, args, label), timeout)

    def _log_section(self, label: str) -> str:
        text = (self.out / "steps.log").read_text()
        return text[text.rfind(f"===== {label}"):]

    # --- steps ---------------------------------------------------------------------------------
    def env(self, t):
        m = machine(self.dry)
        cap = tuple(int(x) for x in m["capability"].split(".")) if m["capability"] != "-" else (0, 0)
        return m, cap >= (8, 9)

    def bandwidth(self, t):
        self.bw = self.T.bandwidth(self.plan)
        return self.bw, None

    def compile(self, t):
        """gpu_warm.py's parts in parallel processes, each within the step's time."""
        import gpu_warm

        deadline, subs, value = time.time() + t, {}, {}
        for part in gpu_warm.PARTS:
            args = [str(ROOT / "benchmarks" / "gpu_warm.py"), part] + (["--dry-run"] if self.dry else [])
            subs[part] = (time.time(), self._start("compile", args, part, self.scratch / f"compile_{part}.log"))
        for part, (t0, sub) in subs.items():
            value[part] = {"exit": self._finish(sub, deadline - time.time()), "seconds": round(time.time() - t0, 1)}
            self.partial(value)
        return value, all(v["exit"] == 0 for v in value.values())

    def _tests(self, step: str, t):
        args = ["-m", "pytest", "-p", "no:cacheprovider", KERNEL_TESTS, "-k", TEST_GROUPS[step]]
        if self.dry:                    # the CPU runs these tests in CI's suite; here: the selection
            code = self._sub(step, args + ["--collect-only", "-q"], t, "pytest")
            names = [ln for ln in self._log_section(f"{step} / pytest").splitlines() if "::" in ln]
            return {"collected": len(names), "first": names[0] if names else None}, code == 0 and bool(names)
        code = self._sub(step, args + ["-v", "-rN"], t, "pytest")
        r = results_of_tests(self._log_section(f"{step} / pytest"))
        if code == -9:
            r["cut"] = f"killed at its limit after {r['last']}"
        return r, code == 0

    def tests_evidence(self, t):
        return self._tests("tests_evidence", t)

    def tests_rest(self, t):
        return self._tests("tests_rest", t)

    def tree_invariance(self, t):
        r = self.S.invariance(self.plan)
        return r, r["greedy_identical"] and r["max_abs_logit_diff"] == 0.0

    def cuda_graphs(self, t):
        r = self.S.graphs(self.plan)
        return r, (r["max_abs_logit_diff"] == 0.0 and r["verdicts_identical"] and r["graphs_captured"] > 0
                   and r["step_graphs_captured"] > 0)

    def fp8_decode(self, t):
        """bf16 by the Triton linear, W8A16, bf16 by cuBLAS, then each recipe as W8A8 while the
        step's time lasts (a format is skipped when less than 1.2x the last one's time is left);
        the summary rewritten after each format."""
        from backend.runtime import fp8

        deadline = time.time() + (t if not self.dry else 10 ** 6)    # the dry run runs every format
        n = self.plan.shapes["llama3-8b"].num_layers
        w8a16 = fp8.recipe("g32-token").with_weight_only(      # every linear weight-only: kernels.linear_w8
            [f"layers.{i}.{k}" for i in range(n) for k in ("qkv", "o", "gate_up", "down")])
        formats = [("bf16", "bf16", None, True), ("w8a16", "fp8", w8a16, True), ("bf16_cublas", "bf16", None, False),
                   *((r.name, "fp8", r, False) for r in fp8.RECIPES)]   # W8A8: invariant mode runs W8A16
        r, last, width = {}, 0.0, None
        for name, fmt, rec, invariant in formats:
            if time.time() + 1.2 * last > deadline:
                r[name] = {"skipped": "time budget"}
                continue
            t0 = time.time()
            # the first W8A8 recipe torch._scaled_mm runs also measures the build's W8A8 width
            wmax = None if width is not None or invariant else (64 if self.dry else 2048)
            r[name] = self.T.decode_speed(self.plan, fmt, rec, invariant, bw=self.bw, log=print, w8a8_max=wmax)
            if r[name]["hardware_fp8"] and "w8a8_width" in r[name]:
                width = r[name]["w8a8_width"]
            last = time.time() - t0
            self.partial({"by_format": r})
        base = r["bf16"]["b1_tokens_per_s"]
        speedups = {k: round(v["b1_tokens_per_s"] / base, 3) for k, v in r.items()
                    if k != "bf16" and "skipped" not in v}
        lines = [self.T.roofline(f"8B decode {k} B={b}", v[f"b{b}"]) for k, v in r.items() if "skipped" not in v
                 for b in self.plan.batches[:2]]
        return {"speedup_b1": speedups, "by_format": r, "roofline": lines,
                "w8a8_width": width or "no recipe ran torch._scaled_mm here"}, None

    def verify_cost(self, t):
        r = self.T.cost_curve(self.plan, "llama3-8b", batches=(1,), bw=self.bw, log=print)["b1"]
        by = r["by_width"]
        lines = [self.T.roofline(f"8B bf16 B=1 T={w}", by[w]) for w in ("1", "16") if w in by]
        return {"ratio_T16": r["ratio"].get("16"), "b1": r, "roofline": lines}, None

    def cost_curves(self, t):
        b = self.plan.batches
        r = {"smollm2-135m": self.T.cost_curve(self.plan, "smollm2-135m", bw=self.bw, log=print)}
        self.partial(r)
        r["llama3-8b"] = self.T.cost_curve(self.plan, "llama3-8b", batches=b[1:], bw=self.bw, log=print)
        r["roofline"] = [self.T.roofline(f"{name} bf16 B={bk[1:]} T={w}", c["by_width"][w])
                         for name, curves in r.items() for bk, c in curves.items() for w in ("1", "16")
                         if w in c["by_width"]]
        return r, None

    def spec_bench(self, t):
        deadline = time.time() + t
        target = self._bench_model()
        if target is None:
            return "skipped: no model (--carry with model/, or --gguf)", "skip"
        repo = self.scratch / "repo"
        build = ["-m", "backend.cli", "build", "--device", "cuda", "--target", str(target), "--weights", "bf16",
                 "--no-invariance-check", "--no-cost-model", "--max-seq-len", "1024", "--output", str(repo)]
        if self._sub("spec_bench", build, deadline - time.time(), "build"):
            raise RuntimeError("the build failed (steps.log)")
        limit, new = (1, 4) if self.dry else (0, 64)
        bench = [str(ROOT / "benchmarks" / "gpu_steps.py"), str(repo), str(self.out / "spec_bench.json"), str(limit),
                 str(new)] + (["--gpu-path"] if self.dry else [])
        if self._sub("spec_bench", bench, deadline - time.time(), "bench"):
            raise RuntimeError("the bench failed (steps.log)")
        r = json.loads((self.out / "spec_bench.json").read_text())
        value = spec_value(r)
        value["weights"] = "the GGUF's" if self.gguf else "random (the model's shape and tokenizer): speedups not the model's"
        return value, bool(r.get("all_identical_to_plain"))

    def logits(self, t):
        r = self.S.logits(self.plan)
        return r, r["fp32"]["max_rel_logit_diff"] <= 1e-3 and r["bf16"]["top1_agreement"] >= 0.9

    def fp8_hardware(self, t):
        r = self.S.fp8_hardware(self.plan)
        return r, r["channel-tensor"] and r["channel-token"]

    def kernels(self, t):
        quick = ["--quick"] if self.dry else []
        code = self._sub("kernels", ["-m", "backend.cli", "check-kernels", "--json", str(self.out / "kernels.json"),
                                     *quick], t, "check-kernels")
        if not (self.out / "kernels.json").exists():
            raise RuntimeError(f"check-kernels wrote no JSON (exit {code}; steps.log)")
        r = json.loads((self.out / "kernels.json").read_text())
        value = {k["name"]: {"max_abs_err": k["max_abs_err"], "ok": k["ok"], **({"skipped": k["skipped"]}
                                                                                if "skipped" in k else {})}
                 for k in r["kernels"]}
        return value, code == 0

    def _bench_model(self) -> Path | None:
        """The spec bench's target: the --gguf, or a checkpoint of random weights written from
        the carried model/ (the dry run's at DRY_MODEL's shape)."""
        if self.gguf:
            return Path(self.gguf)
        if self.carry is None or not (self.carry / "model" / "config.json").exists():
            return None
        import gpu_payload

        return gpu_payload.random_checkpoint(self.carry / "model", self.scratch / "checkpoint",
                                             DRY_MODEL if self.dry else None)


@dataclass
class _Sub:
    proc: subprocess.Popen
    log: object
    counts: Path
    step: str
    label: str
    own_log: Path | None


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
