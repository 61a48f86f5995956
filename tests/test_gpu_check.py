"""The GPU check's machinery (benchmarks/gpu_check.py, gpu_summary.py, gpu_payload.py; issue 30),
quickly: every step has its implementation; a dry run of cheap steps writes the summary with
each step exercised and exits 0; a step that raises is reported with the file and function to look
at and fails the run, as does a step that never ran; a GGUF in parts is joined and checked, and a
missing part is named. CI runs the whole dry run (`bash benchmarks/gpu_check.sh --dry-run`)."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_payload  # noqa: E402
from gpu_summary import Check, Summary  # noqa: E402


def test_every_step_has_an_implementation_and_a_place_to_look():
    for name, (what, target, look_at, share) in gpu_check.STEPS.items():
        assert callable(getattr(gpu_check.Run, name)), name
        assert what and target and look_at and share >= 0, name
    assert sum(s for *_, s in gpu_check.STEPS.values()) > 0


def test_a_dry_run_of_cheap_steps_writes_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--steps", "env,fp8_hardware"]) == 0
    s = json.loads((tmp_path / "gpu_summary.json").read_text())
    assert s["dry_run"] and s["ok"] and [c["status"] for c in s["checks"]] == ["exercised", "exercised"]
    assert s["machine"]["torch"] and s["checks"][1]["value"]["channel-token"] is True   # this CPU's _scaled_mm
    md = (tmp_path / "gpu_summary.md").read_text()
    assert "DRY RUN" in md and "dry-run: env exercised, fp8_hardware exercised" in md


def test_a_step_that_raises_names_where_to_look_and_fails_the_run(tmp_path, monkeypatch):
    def broken(self, t):
        raise ValueError("bad shape")
    monkeypatch.setattr(gpu_check.Run, "fp8_hardware", broken)
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--steps", "env,fp8_hardware"]) == 1
    s = json.loads((tmp_path / "gpu_summary.json").read_text())
    bad = s["checks"][1]
    assert bad["status"] == "error" and "ValueError: bad shape" in bad["detail"]
    md = (tmp_path / "gpu_summary.md").read_text()
    assert "To fix first" in md and "hardware_fp8" in md and "NOT OK" in md


def test_judging_a_real_run_and_a_step_that_never_ran():
    real = Summary(dry_run=False, checks=[Check("a", "w", "t", "x.py f", status="pass"),
                                          Check("b", "w", "t", "y.py g", status="skipped", detail="no GGUF")])
    assert real.ok and "y.py g" not in real.markdown()           # a skip is reported, not a failure
    real.checks.append(Check("c", "w", "<= 1.15", "z.py h", status="fail", value=1.4))
    assert not real.ok and "z.py h" in real.markdown() and "| c | fail | 1.4 | <= 1.15 |" in real.markdown()
    dry = Summary(dry_run=True, checks=[Check("a", "w", "t", "x.py f", status="exercised"),
                                        Check("b", "w", "t", "y.py g")])
    assert not dry.ok and "b not run" in dry.markdown()


def test_a_gguf_in_parts_is_joined_and_checked(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(bytes(range(256)) * 1000)
    parts = gpu_payload.split(src, tmp_path / "carry", part=100_000)
    assert len(parts) == 3 and all(p.stat().st_size <= 100_000 for p in parts)
    out = tmp_path / "out"
    out.mkdir()
    joined = gpu_payload.join(tmp_path / "carry" / "m.gguf", out)
    assert joined.read_bytes() == src.read_bytes()
    parts[-1].unlink()                                 # the last part never arrived
    with pytest.raises(ValueError, match="a part missing"):
        gpu_payload.join(tmp_path / "carry" / "m.gguf", out)
    parts[0].unlink()
    with pytest.raises(FileNotFoundError, match="released"):
        gpu_payload.join(tmp_path / "carry" / "m.gguf", out)
