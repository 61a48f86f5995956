"""The GPU check's machinery (benchmarks/gpu_check.py, gpu_steps.py, gpu_timing.py,
gpu_summary.py, gpu_payload.py; issues 30 and 41), quickly: every step has its implementation; a
dry run of cheap steps writes the summary with each step exercised and exits 0; a step that
raises is reported with the file and function to look at and fails the run, as does a step that
never ran; a GGUF in parts is joined and checked, and a missing part is named; the invariance
steps read exactly 0 on the dry run's shapes (the same prompts in both runs compared); the shares
fit the budget; bytes, GB/s, the fraction of bandwidth and the roofline line; launches (null on a
CPU, with why); the spec bench's ratio per token. CI runs the whole dry run
(`bash benchmarks/gpu_check.sh --dry-run`)."""
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
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


# --- issue 41: the check fixed and honest ------------------------------------------------------

def test_the_invariance_steps_read_exactly_zero_on_the_dry_runs_shapes():
    """verify vs single steps and graph replay vs eager, bf16 in the invariant mode (the Triton
    kernels in the interpreter): the same prompts, so every logit is the same bits. Before the
    fix the two slots were prefilled from one generator (1.13 apart) and a stubbed replay did
    nothing (146.8 apart)."""
    import gpu_steps

    plan = gpu_steps.Plan.dry()
    inv = gpu_steps.invariance(plan)
    assert inv["nodes"] == plan.chain and inv["greedy_identical"]
    assert inv["max_abs_logit_diff"] == 0.0
    g = gpu_steps.graphs(plan)
    assert g["graphs_captured"] == 3 and g["step_graphs_captured"] == 1
    assert g["max_abs_logit_diff"] == 0.0 and g["verdicts_identical"]


def test_slots_prefilled_with_one_prompt_hold_the_same_kv_bits():
    import gpu_steps

    cfg = gpu_steps.TINY["smollm2-135m"]
    rt = gpu_steps.runtime(cfg, gpu_steps.random_tensors(cfg, "bf16", "cpu"), "cpu", slots=3, graphs=False)
    gpu_steps.prefill(rt, [0, 1], gpu_steps.prompt_ids(cfg, 7, 1))
    gpu_steps.prefill(rt, [2], gpu_steps.prompt_ids(cfg, 7, 2))
    kv = rt.cache[:, :, :, :, :7]
    assert torch.equal(kv[:, :, 0], kv[:, :, 1]) and not torch.equal(kv[:, :, 0], kv[:, :, 2])


def test_the_steps_fit_the_budget_and_the_run_fits_eight_minutes():
    shares = [s for *_, s in gpu_check.STEPS.values()]
    assert sum(shares) <= gpu_check.BUDGET and gpu_check.BUDGET + 30 <= 8 * 60
    assert all(s > 0 for s in shares)


def test_the_plugin_step_leaves_the_ptx_compiles_to_ci(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--steps", "plugin_kernel_tests"]) == 0
    value = json.loads((tmp_path / "gpu_summary.json").read_text())["checks"][0]["value"]
    assert "deselected" in value
    collected = [ln for ln in (tmp_path / "kernel_tests.log").read_text().splitlines() if "::" in ln]
    assert collected and not any("ptx" in ln for ln in collected)


def test_bytes_per_step_speed_and_the_roofline_line():
    import gpu_steps
    import gpu_timing

    cfg = gpu_steps.TINY["llama3-8b"]
    rt = gpu_steps.runtime(cfg, gpu_steps.random_tensors(cfg, "bf16", "cpu"), "cpu", slots=2, graphs=False)
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    assert rt.model.dtype.itemsize == 4               # the CPU's compute dtype: fp32
    assert gpu_timing.weight_bytes(rt) == 4 * (layers * (per_layer + 2 * h) + cfg.vocab_size * h + h)
    kv = gpu_timing.kv_bytes(rt, 2, 3, 10)
    assert kv == layers * 2 * cfg.num_kv_heads * d * 4 * 2 * 13
    row = gpu_timing.speed(0.002, 4_000_000_000, {"GB_per_s": 4000.0})
    assert row == {"ms": 2.0, "bytes": 4_000_000_000, "GB_per_s": 2000.0, "of_bandwidth": 0.5, "floor_ms": 1.0}
    line = gpu_timing.roofline("8B decode bf16 B=1", {**row, "launches": {"kernels": 290}})
    s = Summary(dry_run=False, checks=[Check("bandwidth", "w", "t", "x", status="pass", value={"GB_per_s": 4000.0}),
                                       Check("fp8_decode", "w", "t", "x", status="pass", value={"roofline": [line]})])
    md = s.markdown()
    assert "(4000.0 GB/s)" in md and "| 8B decode bf16 B=1 | 2 | 1 | 0.5 | 2000 | 4000.0 | 290 |" in md


def test_launches_on_a_cpu_are_null_with_the_reason_and_bandwidth_is_measured():
    import gpu_steps
    import gpu_timing

    x = torch.ones(8, 8)
    got = gpu_timing.launches(lambda: (x @ x).sum(), "cpu")
    assert got["kernels"] is None and "no device kernels" in got["why"] and "2 top-level torch ops" in got["why"]
    bw = gpu_timing.bandwidth(gpu_steps.Plan.dry())
    assert bw["GB_per_s"] > 0 and bw["copy_MiB"] == 64


def test_the_spec_bench_value_gives_the_ratio_per_token_beside_tokens_per_s():
    r = {"speedup": 2.031, "acceptance_rate": 0.59, "mean_accepted_tokens": 1.72, "all_identical_to_plain": True,
         "plain": {"tokens_per_s": 168.65, "tpot_ms": 5.7, "ttft_ms": 214.0},
         "spec": {"tokens_per_s": 342.5, "tpot_ms": 3.75, "ttft_ms": 37.0},
         "warmup_pass": {"plain": {"ttft_ms": 900.0}}}
    v = gpu_check.spec_value(r)
    assert v["speedup"] == 2.031 and v["speedup_per_token"] == 1.52
    assert v["plain_ttft_ms"] == 214.0 and v["warmup_plain_ttft_ms"] == 900.0
