"""The GPU check's summary, the page a person reads first: OUTDIR/gpu_summary.md and .json.

One row per step of the run (benchmarks/gpu_check.py STEPS, in order): what it measured, the
value, the target, and its status:
    pass / fail       the real run: the measured value against the target
    exercised         the dry run (`--dry-run`, on a CPU): the step ran to its end (its values
                      are the CPU's, small shapes; not judged)
    error             it raised: the message, and the file and function to look at
    skipped           not run (its prerequisite is missing, or the time budget ran out): why
    not run           a step of STEPS that never reported (the dry run fails on it)
A failing or erroring step names the file and function to look at. Then the roofline: a line
per timed point of the timing steps (their values' "roofline" lists, benchmarks/gpu_timing.py):
what it took, what it would take at the bandwidth step's measured copy bandwidth, the fraction
and the device kernels of one step.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

JUDGED = ("pass", "fail")


@dataclass
class Check:
    step: str
    what: str
    target: str
    look_at: str
    status: str = "not run"
    value: object = None
    seconds: float = 0.0
    detail: str = ""

    def line(self) -> str:
        val = json.dumps(self.value, separators=(",", ":")) if self.value is not None else "-"
        if len(val) > 160:
            val = val[:157] + "..."
        look = self.look_at if self.status in ("fail", "error") else ""
        cells = [self.step, self.status, val, self.target, f"{self.seconds:.1f}", f"{look} {self.detail}".strip()]
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


@dataclass
class Summary:
    dry_run: bool
    machine: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Dry run: every step exercised. Real run: every step passed (skips are reported, not
        failures: a run without a GGUF still judges the rest)."""
        if self.dry_run:
            return all(c.status == "exercised" for c in self.checks)
        return all(c.status in ("pass", "skipped") for c in self.checks)

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run, "ok": self.ok, "seconds": round(self.seconds, 1), "machine": self.machine,
                "checks": [asdict(c) for c in self.checks]}

    def markdown(self) -> str:
        m = self.machine
        head = "GPU check, DRY RUN on the CPU (small shapes; values not judged)" if self.dry_run else "GPU check"
        lines = [f"# {head}: {'ok' if self.ok else 'NOT OK'}", "",
                 f"- machine: {m.get('gpu', '?')} (sm {m.get('capability', '?')}), driver {m.get('driver', '?')}",
                 f"- versions: torch {m.get('torch', '?')}, triton {m.get('triton', '?')}, CUDA {m.get('cuda', '?')}, "
                 f"python {m.get('python', '?')}",
                 f"- date {m.get('date', '?')}, {self.seconds:.0f} s in all", "",
                 "| step | status | value | target | s | look at / detail |", "|---|---|---|---|---|---|"]
        lines += [c.line() for c in self.checks]
        bad = [c for c in self.checks if c.status in ("fail", "error", "not run")]
        if bad:
            lines += ["", "## To fix first", ""]
            lines += [f"- **{c.step}** ({c.status}): {c.detail or c.what}. Look at {c.look_at}." for c in bad]
        lines += self.roofline()
        if self.dry_run:
            lines += ["", "dry-run: " + ", ".join(f"{c.step} {'exercised' if c.status == 'exercised' else c.status}"
                                               for c in self.checks)]
        return "\n".join(lines) + "\n"

    def roofline(self) -> list[str]:
        rows = [r for c in self.checks if isinstance(c.value, dict) for r in c.value.get("roofline") or []]
        if not rows:
            return []
        bw = next((c.value for c in self.checks if c.step == "bandwidth" and isinstance(c.value, dict)), {})
        out = ["", f"## Roofline: what each timed step took vs its floor at the measured copy bandwidth "
                   f"({bw.get('GB_per_s', 'not measured')} GB/s)", "",
               "| timed step | took ms | floor ms | of bandwidth | GB/s | MB read | kernels |",
               "|---|---|---|---|---|---|---|"]
        cell = lambda x: "-" if x is None else f"{x:g}"
        out += [f"| {r['step']} | {cell(r['ms'])} | {cell(r.get('floor_ms'))} | {cell(r.get('of_bandwidth'))} | "
                f"{cell(r['GB_per_s'])} | {r['bytes'] / 1e6:.1f} | {cell(r.get('kernels'))} |" for r in rows]
        return out

    def write(self, out: Path) -> None:
        (out / "gpu_summary.json").write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")
        (out / "gpu_summary.md").write_text(self.markdown())
