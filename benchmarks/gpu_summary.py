"""The GPU check's summary, the page a person reads first: OUTDIR/gpu_summary.md and .json.

The head says what ran where: the code (commit and the hash of uncommitted changes, from git or
the carried provenance.json whose files were hashed again on the machine), the exact command,
torch / Triton / CUDA versions, the GPU and the copy bandwidth measured there. Then TARGETS:
each target of issue 49 with its measured value and met / not met / not measured. Then one row
per step (benchmarks/gpu_check.py STEPS, in order): what it measured, the value, the target,
its seconds and time limit, and its status:
    pass / fail       the real run: the measured value against the target
    exercised         the dry run (`--dry-run`, on a CPU): the step ran to its end and launched the
                      GPU kernels required of it (its values are the CPU's, small shapes; not judged)
    error             it raised, or (dry run) the GPU's code did not run: the message, and the
                      file and function to look at
    skipped           not run (its prerequisite is missing, or the time budget ran out): why
    not run           a step that never reported (the run was cut; the dry run fails on it)
Then the kernels each step launched, by name (benchmarks/gpu_count.py), the roofline (a line per
timed point: what it took, what it would take at the measured bandwidth), and last the verdict,
one line.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Check:
    step: str
    what: str
    target: str
    look_at: str
    status: str = "not run"
    value: object = None
    seconds: float = 0.0
    limit: float | None = None
    cpu_seconds: float | None = None
    detail: str = ""
    kernels: dict | None = None

    def line(self) -> str:
        val = json.dumps(self.value, separators=(",", ":"), default=str) if self.value is not None else "-"
        if len(val) > 160:
            val = val[:157] + "..."
        look = self.look_at if self.status in ("fail", "error") else ""
        secs = f"{self.seconds:.1f}" + (f" / {self.limit:.0f}" if self.limit is not None else "")
        cells = [self.step, self.status, val, self.target, secs, f"{look} {self.detail}".strip()]
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _get(value, *keys):
    for k in keys:
        if not isinstance(value, dict) or k not in value:
            return None
        value = value[k]
    return value


@dataclass(frozen=True)
class Target:
    name: str
    bound: str
    step: str
    keys: tuple                       # where the value sits in the step's value
    met: object                       # value -> bool
    floor: bool = False               # a step time: its row's floor at the measured bandwidth beside it


TARGETS = (
    Target("8B-shape bf16 decode step, batch 1 (ms)", "<= 4.6", "fp8_decode", ("by_format", "bf16", "b1", "ms"),
           lambda v: v <= 4.6, floor=True),
    Target("8B-shape bf16 decode step, batch 1 (fraction of the copy bandwidth)", ">= 0.65", "fp8_decode",
           ("by_format", "bf16", "b1", "of_bandwidth"), lambda v: v >= 0.65),
    Target("8B-shape W8A16 decode step, batch 1 (ms)", "<= 2.9", "fp8_decode", ("by_format", "w8a16", "b1", "ms"),
           lambda v: v <= 2.9, floor=True),
    Target("embedded 135M-shape decode step, batch 1 (ms)", "<= 0.6", "cost_curves",
           ("smollm2-135m", "b1", "by_width", "1", "ms"), lambda v: v <= 0.6, floor=True),
    Target("verify of 16 nodes / one step, 8B shape, batch 1", "<= 1.15", "verify_cost", ("ratio_T16",),
           lambda v: v <= 1.15),
    Target("speculative output identical to plain (spec bench)", "true", "spec_bench", ("all_identical_to_plain",),
           lambda v: v is True),
    Target("graph replay identical to eager (logits, hidden, verdicts)", "0, true", "cuda_graphs",
           ("max_abs_logit_diff",), lambda v: v == 0.0),
    Target("fused step bitwise invariant across batch and verify widths (max |logit diff|)", "0", "tree_invariance",
           ("max_abs_logit_diff",), lambda v: v == 0.0),
    Target("W8A8 width (the build's w8a8_from on this GPU)", "measured", "fp8_decode", ("w8a8_width",),
           lambda v: isinstance(v, dict) and "w8a8_from" in v),
)


@dataclass
class Summary:
    dry_run: bool
    machine: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    command: str = ""
    budget: float | None = None
    code: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Dry run: every step exercised. Real run: every step passed (skips are reported, not
        failures: a run without a model for the spec bench still judges the rest)."""
        if self.dry_run:
            return all(c.status == "exercised" for c in self.checks)
        return all(c.status in ("pass", "skipped") for c in self.checks)

    def step(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.step == name), None)

    def targets(self) -> list[dict]:
        """Each target: its measured value and met (True / False; None: not measured)."""
        rows = []
        for t in TARGETS:
            c = self.step(t.step)
            v = _get(c.value, *t.keys) if c is not None else None
            if t.step == "cuda_graphs" and v is not None:
                v = v if c.value.get("verdicts_identical") else f"{v} (verdicts differ)"
            met = None if v is None or self.dry_run else (bool(t.met(v)) if not isinstance(v, str) else False)
            row = {"target": t.name, "bound": t.bound, "step": t.step, "measured": v, "met": met}
            if t.floor and c is not None:          # what the bound asks against what the memory allows
                row["floor_ms"] = _get(c.value, *t.keys[:-1], "floor_ms")
            rows.append(row)
        return rows

    def verdict(self) -> str:
        counts = {}
        for c in self.checks:
            counts[c.status] = counts.get(c.status, 0) + 1
        steps = ", ".join(f"{n} {s}" for s, n in counts.items())
        code = f"commit {str(self.code.get('commit'))[:12]}" + (" + changes" if self.code.get("dirty_diff_sha256") else "")
        if self.dry_run:
            bad = [f"{c.step} ({c.detail or c.status})" for c in self.checks if c.status != "exercised"]
            head = "DRY RUN OK: every step ran the GPU's code" if not bad else "DRY RUN NOT OK: " + "; ".join(bad)
            return f"{head} [{steps}; {code}]"[:1000]
        rows = self.targets()
        met = [r for r in rows if r["met"]]
        missed = [f"{r['target']} {r['measured']} (want {r['bound']})" for r in rows if r["met"] is False]
        unmeasured = [r["target"] for r in rows if r["met"] is None]
        return (f"VERDICT: {len(met)} of {len(rows)} targets met"
                + (f"; NOT MET: {'; '.join(missed)}" if missed else "")
                + (f"; not measured: {'; '.join(unmeasured)}" if unmeasured else "")
                + f" [steps: {steps}; {self.machine.get('gpu', '?')}; {code}]")

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run, "ok": self.ok, "verdict": self.verdict(), "seconds": round(self.seconds, 1),
                "budget": self.budget, "command": self.command, "code": self.code, "machine": self.machine,
                "targets": self.targets(), "checks": [asdict(c) for c in self.checks]}

    def markdown(self) -> str:
        m, code = self.machine, self.code
        bw = _get((self.step("bandwidth") or Check("", "", "", "")).value, "GB_per_s")
        head = "GPU check, DRY RUN on the CPU (small shapes; values not judged)" if self.dry_run else "GPU check"
        lines = [f"# {head}: {'ok' if self.ok else 'NOT OK'}", "",
                 f"- code: commit {code.get('commit')}, uncommitted changes sha256 {code.get('dirty_diff_sha256')} "
                 f"({code.get('how')}{', files match' if code.get('files_match') else ''}"
                 f"{', FILES DIFFER from the prepared provenance' if code.get('files_match') is False else ''})",
                 f"- command: `{self.command}`",
                 f"- machine: {m.get('gpu', '?')} (sm {m.get('capability', '?')}, {m.get('sms', '?')} SMs), "
                 f"nvidia-smi: {m.get('nvidia_smi', '?')}; copy bandwidth measured: {bw} GB/s",
                 f"- versions: torch {m.get('torch', '?')}, triton {m.get('triton', '?')}, CUDA {m.get('cuda', '?')}, "
                 f"python {m.get('python', '?')}",
                 f"- date {m.get('date', '?')}, {self.seconds:.0f} s of steps (budget {self.budget} s)", "",
                 "## Targets", "", "| target | bound | measured | met |", "|---|---|---|---|"]
        yes = {True: "met", False: "NOT MET", None: "not judged (dry run)" if self.dry_run else "not measured"}
        floor = lambda r: f" (floor {r['floor_ms']} ms at the measured bandwidth)" if r.get("floor_ms") else ""
        short = lambda v: (s if len(s := json.dumps(v, default=str)) <= 90 else s[:87] + "...")
        lines += [f"| {r['target']} | {r['bound']} | {short(r['measured'])}{floor(r)} | {yes[r['met']]} |"
                  for r in self.targets()]
        lines += ["", "## Steps", "", "| step | status | value | target | s / limit | look at / detail |",
                  "|---|---|---|---|---|---|"]
        lines += [c.line() for c in self.checks]
        bad = [c for c in self.checks if c.status in ("fail", "error", "not run")]
        if bad:
            lines += ["", "## To fix first", ""]
            lines += [f"- **{c.step}** ({c.status}): {c.detail or c.what}. Look at {c.look_at}." for c in bad]
        lines += ["", "## Kernels each step launched (by name; a graph's replay counts once)", ""]
        lines += [f"- {c.step}: " + (", ".join(f"{k} {n}" for k, n in sorted(c.kernels.items())) or "none")
                  for c in self.checks if c.kernels is not None]
        lines += self.roofline()
        lines += ["", self.verdict()]
        return "\n".join(lines) + "\n"

    def roofline(self) -> list[str]:
        rows = [r for c in self.checks if isinstance(c.value, dict) for r in c.value.get("roofline") or []]
        if not rows:
            return []
        bw = _get((self.step("bandwidth") or Check("", "", "", "")).value, "GB_per_s")
        out = ["", f"## Roofline: what each timed step took vs its floor at the measured copy bandwidth "
                   f"({bw or 'not measured'} GB/s)", "",
               "| timed step | took ms | floor ms | of bandwidth | GB/s | MB read | kernels |",
               "|---|---|---|---|---|---|---|"]
        cell = lambda x: "-" if x is None else f"{x:g}"
        out += [f"| {r['step']} | {cell(r['ms'])} | {cell(r.get('floor_ms'))} | {cell(r.get('of_bandwidth'))} | "
                f"{cell(r['GB_per_s'])} | {r['bytes'] / 1e6:.1f} | {cell(r.get('kernels'))} |" for r in rows]
        return out

    def write(self, out: Path) -> None:
        (out / "gpu_summary.json").write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")
        (out / "gpu_summary.md").write_text(self.markdown())
