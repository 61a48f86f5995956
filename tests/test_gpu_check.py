"""The GPU check's machinery (benchmarks/gpu_check.py, gpu_run.py, gpu_steps.py, gpu_timing.py,
gpu_summary.py, gpu_payload.py, gpu_count.py, gpu_warm.py; issues 30, 41, 49), quickly: every step
has its implementation, a place to look and a share, the shares fit the budget and the budget a
7-minute device call; unused time passes forward; a dry run of cheap steps writes the summary
(code, command, targets, kernels by name, the verdict last); a dry-run step that does not reach
the GPU kernels required of it, or falls back to the CPU's, fails the run, as does one that raises
or never ran; a real run's targets are met, not met or not measured, each with its value; the
launch counter counts kernels by name, graph captures and replays and the CPU fallbacks; the
kernel tests run evidence first; pytest's per-test lines survive a cut; the code's identity comes
from git or the carried provenance; the spec bench's random checkpoint loads; bytes, GB/s and the
roofline. CI runs the whole dry run (`bash benchmarks/gpu_check.sh --dry-run`), which fails
unless every step ran the GPU's code; there the fused step's invariance and the graphs' replay
read exactly 0 (judged: exact_on_cpu)."""
import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_payload  # noqa: E402
import gpu_run  # noqa: E402
from gpu_count import Count, _kernel_name  # noqa: E402
from gpu_summary import TARGETS, Check, Summary  # noqa: E402


def test_every_step_has_an_implementation_a_place_to_look_and_a_share():
    for name, step in gpu_check.STEPS.items():
        assert callable(getattr(gpu_run.Run, name)), name
        assert step.what and step.target and step.look_at and step.share > 0, name
    assert {t.step for t in TARGETS} <= set(gpu_check.STEPS)


def test_the_shares_fit_the_budget_and_the_call_fits_seven_minutes():
    """The steps' shares add up to at most the budget; the budget, with a minute of start-up
    (Python, torch, CUDA) and the last step's alarm grace, within the call's timeout of 7 minutes."""
    assert sum(s.share for s in gpu_check.STEPS.values()) <= gpu_check.BUDGET
    assert gpu_check.BUDGET + 10 + 45 <= gpu_check.CALL_TIMEOUT <= 7 * 60


def test_unused_time_passes_forward_and_an_overrun_shrinks_the_rest_in_proportion():
    assert gpu_check.limit_for(40, 360, 300) == 60          # 20 s left unused by earlier steps
    assert gpu_check.limit_for(40, 340, 300) == 40          # on time
    assert gpu_check.limit_for(40, 170, 300) == pytest.approx(40 * 170 / 340)   # earlier steps overran
    assert gpu_check.limit_for(40, -5, 300) == 0


def test_a_dry_run_of_cheap_steps_writes_the_summary(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--steps", "env,fp8_hardware"]) == 0
    s = json.loads((tmp_path / "gpu_summary.json").read_text())
    assert s["dry_run"] and s["ok"] and [c["status"] for c in s["checks"]] == ["exercised", "exercised"]
    assert s["machine"]["torch"] and s["checks"][1]["value"]["channel-token"] is True   # this CPU's _scaled_mm
    assert s["checks"][1]["kernels"]["torch._scaled_mm"] >= 2 and s["code"]["commit"]
    assert len(s["targets"]) == len(TARGETS) and s["command"]
    md = (tmp_path / "gpu_summary.md").read_text()
    assert "DRY RUN" in md and "- fp8_hardware: torch._scaled_mm" in md
    assert md.strip().splitlines()[-1].startswith("DRY RUN OK: every step ran the GPU's code")


def test_a_step_that_does_not_run_the_gpus_code_fails_the_dry_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run.Run, "fp8_hardware", lambda self, t: ({"channel-tensor": True}, True))
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--steps", "fp8_hardware"]) == 1
    c = json.loads((tmp_path / "gpu_summary.json").read_text())["checks"][0]
    assert c["status"] == "error" and "no launch of torch._scaled_mm" in c["detail"]


def test_a_cpu_fallback_or_an_inexact_value_fails_the_dry_run():
    step = gpu_check.STEPS["tree_invariance"]
    ran = dict.fromkeys(step.required, 1)
    c = Check("tree_invariance", "w", "t", "x", kernels={**ran, "host:tree_attention_ref": 2})
    gpu_check.judge_dry(c, step, True)
    assert c.status == "error" and "CPU fallback host:tree_attention_ref" in c.detail
    c = Check("tree_invariance", "w", "t", "x", kernels=ran)
    gpu_check.judge_dry(c, step, False)                     # 0 holds on the CPU too
    assert c.status == "error" and "not met on the CPU" in c.detail
    gpu_check.judge_dry(c, step, True)
    assert c.status == "exercised"


def test_a_step_that_raises_names_where_to_look_and_fails_the_run(tmp_path, monkeypatch):
    def broken(self, t):
        raise ValueError("bad shape")
    monkeypatch.setattr(gpu_run.Run, "fp8_hardware", broken)
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--steps", "env,fp8_hardware"]) == 1
    bad = json.loads((tmp_path / "gpu_summary.json").read_text())["checks"][1]
    assert bad["status"] == "error" and "ValueError: bad shape" in bad["detail"]
    md = (tmp_path / "gpu_summary.md").read_text()
    assert "To fix first" in md and "hardware_fp8" in md and "NOT OK" in md


def test_a_real_runs_targets_are_met_not_met_or_not_measured_and_the_verdict_comes_last():
    fp8 = {"by_format": {"bf16": {"b1": {"ms": 4.2, "of_bandwidth": 0.55, "floor_ms": 3.5}}, "w8a16": {"b1": {"ms": 3.1}}},
           "w8a8_width": {"w8a8_from": None, "reason": "never faster"}}
    s = Summary(dry_run=False, machine={"gpu": "NVIDIA H100"}, code={"commit": "abc123", "dirty_diff_sha256": None},
                checks=[Check("fp8_decode", "w", "t", "x.py f", status="pass", value=fp8),
                        Check("verify_cost", "w", "t", "y.py g", status="fail", value={"ratio_T16": 1.4}),
                        Check("spec_bench", "w", "t", "z.py h", status="skipped", value="no model")])
    rows = {r["target"]: r for r in s.targets()}
    assert [(r["measured"], r["met"]) for r in s.targets() if r["step"] == "fp8_decode"] == [
        (4.2, True), (0.55, False), (3.1, False), (fp8["w8a8_width"], True)]
    assert rows["verify of 16 nodes / one step, 8B shape, batch 1"]["met"] is False
    assert rows["speculative output identical to plain (spec bench)"]["met"] is None
    v = s.verdict()
    assert v.startswith("VERDICT: 2 of 9 targets met; NOT MET: ") and "1.4 (want <= 1.15)" in v
    assert "speculative output identical to plain (spec bench)" in v.split("not measured: ")[1]
    assert "NVIDIA H100" in v and "commit abc123" in v
    assert not s.ok and s.markdown().strip().splitlines()[-1] == v
    assert "| <= 4.6 | 4.2 (floor 3.5 ms at the measured bandwidth) | met |" in s.markdown()


def test_the_counter_counts_kernels_by_name_graphs_and_cpu_fallbacks():
    from backend.runtime import step_graph
    from plugins import kernels, reference

    launch = kernels.launch
    x = torch.randn(3, 32)
    with Count() as c:
        kernels.rmsnorm(x, torch.ones(32), 1e-6)
        with Count() as inner:
            g = step_graph.capture(lambda s: (s["a"] * 2,), {"a": x}, torch.device("cpu"))
            g.replay()
        q = np.zeros((1, 1, 1, 16), np.float32)
        kv = np.zeros((2, 1, 4, 16), np.float32)
        reference.tree_attention_ref(q, kv, kv, np.array([0]), np.array([2]), np.full((1, 1, 1), -1), 0.25)
    assert c.counts == {"rmsnorm_kernel": 1, "graph_capture": 1, "graph_replay": 1, "host:tree_attention_ref": 1}
    assert inner.counts == {"graph_capture": 1, "graph_replay": 1}
    assert kernels.launch is launch and not Count._active          # unpatched after
    assert _kernel_name(kernels.linear_split_kernel, {"W8": True}) == "linear_split_kernel[W8]"
    assert _kernel_name(kernels.split_reduce_kernel, {"SPLIT": 4}) == "split_reduce_kernel[split]"


def test_the_kernel_tests_run_evidence_first_in_two_parts():
    """tests/test_kernels.py: every test of the evidence part (gpu_run.EVIDENCE, pytest -k by name)
    comes before every other; each keyword names a test; the invariant runtime's test is first."""
    tree = ast.parse((ROOT / gpu_run.KERNEL_TESTS).read_text())
    names = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
             and "ptx" not in f.name]
    evidence = [any(k in n for k in gpu_run.EVIDENCE) for n in names]
    assert sum(evidence) >= 9 and evidence == sorted(evidence, reverse=True)
    assert all(any(k in n for n in names) for k in gpu_run.EVIDENCE)
    assert names[0] == "test_the_invariant_runtime_verifies_with_the_bits_of_single_steps"


def test_pytests_lines_give_each_tests_result_even_when_the_run_was_cut():
    log = ("===== tests_evidence / pytest: -m pytest ...\n"
           "tests/test_kernels.py::test_a[fp32] PASSED    [  5%]\n"
           "tests/test_kernels.py::test_a[bf16] FAILED    [ 10%]\n"
           "tests/test_kernels.py::test_b SKIPPED (interpreter only)   [ 15%]\n"
           "tests/test_kernels.py::test_c PASSED    [ 20%]\n")
    r = gpu_run.results_of_tests(log)
    assert r == {"passed": 2, "failed": ["test_a[bf16]"], "skipped": 1, "last": "tests/test_kernels.py::test_c"}


def test_the_codes_identity_from_git_or_from_the_carried_provenance(tmp_path):
    here = gpu_payload.code_identity(None)
    assert len(here["commit"]) == 40 and here["how"] == "git here"
    root, carry = tmp_path / "copy", tmp_path / "carry"         # a device machine: files, no .git
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.py").write_text("x = 1\n")
    carry.mkdir()
    prov = {"commit": "f" * 40, "dirty_diff_sha256": None, "files": ["a/x.py"],
            "files_sha256": gpu_payload.files_sha256(root, ["a/x.py"])}
    (carry / "provenance.json").write_text(json.dumps(prov))
    got = gpu_payload.code_identity(carry, root)
    assert got["commit"] == "f" * 40 and got["files_match"] is True and got["how"] == "provenance.json carried"
    (root / "a" / "x.py").write_text("x = 2\n")
    assert gpu_payload.code_identity(carry, root)["files_match"] is False


def test_the_spec_benchs_random_checkpoint_has_the_models_tokenizer_and_loads(tmp_path):
    from conftest import make_tiny_checkpoint

    from backend.buildlib.checkpoint import load_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model")
    ck = load_checkpoint(gpu_payload.random_checkpoint(model, tmp_path / "random", {"num_hidden_layers": 1}))
    want = load_checkpoint(model)
    assert ck.config.num_layers == 1 and ck.config.vocab_size == want.config.vocab_size
    assert ck.tokenizer.tokenizer_json == want.tokenizer.tokenizer_json
    assert ck.tokenizer.chat_template == want.tokenizer.chat_template
    assert ck.tensor("layers.0.down").shape == want.tensor("layers.0.down").shape


def test_slots_prefilled_with_one_prompt_hold_the_same_kv_bits():
    import gpu_steps

    cfg = gpu_steps.TINY["smollm2-135m"]
    rt = gpu_steps.runtime(cfg, gpu_steps.random_tensors(cfg, "bf16", "cpu"), "cpu", slots=3, graphs=False,
                           kernels=False, invariant=False)
    gpu_steps.prefill(rt, [0, 1], gpu_steps.prompt_ids(cfg, 7, 1))
    gpu_steps.prefill(rt, [2], gpu_steps.prompt_ids(cfg, 7, 2))
    kv = rt.cache[:, :, :, :, :7]
    assert torch.equal(kv[:, :, 0], kv[:, :, 1]) and not torch.equal(kv[:, :, 0], kv[:, :, 2])


def test_bytes_per_step_speed_and_the_roofline_line():
    import gpu_steps
    import gpu_timing

    cfg = gpu_steps.TINY["llama3-8b"]
    rt = gpu_steps.runtime(cfg, gpu_steps.random_tensors(cfg, "bf16", "cpu"), "cpu", slots=2, graphs=False)
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    assert rt.model.dtype.itemsize == 2               # the GPU's compute dtype: bf16
    assert gpu_timing.weight_bytes(rt) == 2 * (layers * (per_layer + 2 * h) + cfg.vocab_size * h + h)
    kv = gpu_timing.kv_bytes(rt, 2, 3, 10)
    assert kv == layers * 2 * cfg.num_kv_heads * d * 2 * 2 * 13
    row = gpu_timing.speed(0.002, 4_000_000_000, {"GB_per_s": 4000.0})
    assert row == {"ms": 2.0, "bytes": 4_000_000_000, "GB_per_s": 2000.0, "of_bandwidth": 0.5, "floor_ms": 1.0}
    line = gpu_timing.roofline("8B decode bf16 B=1", {**row, "launches": {"kernels": 290}})
    s = Summary(dry_run=False, checks=[Check("bandwidth", "w", "t", "x", status="pass", value={"GB_per_s": 4000.0}),
                                       Check("fp8_decode", "w", "t", "x", status="pass", value={"roofline": [line]})])
    md = s.markdown()
    assert "(4000.0 GB/s)" in md and "| 8B decode bf16 B=1 | 2 | 1 | 0.5 | 2000 | 4000.0 | 290 |" in md


def test_launches_on_a_cpu_are_null_with_the_reason_and_by_name_and_bandwidth_is_measured():
    import gpu_steps
    import gpu_timing
    from plugins import kernels

    x = torch.ones(8, 8)
    got = gpu_timing.launches(lambda: kernels.rmsnorm((x @ x), torch.ones(8), 1e-6), "cpu")
    assert got["kernels"] is None and "no device kernels" in got["why"] and got["by_name"] == {"rmsnorm_kernel": 1}
    bw = gpu_timing.bandwidth(gpu_steps.Plan.dry())
    assert bw["GB_per_s"] > 0 and bw["copy_MiB"] == 64


def test_the_spec_bench_value_gives_the_ratio_per_token_beside_tokens_per_s():
    r = {"speedup": 2.031, "acceptance_rate": 0.59, "mean_accepted_tokens": 1.72, "all_identical_to_plain": True,
         "plain": {"tokens_per_s": 168.65, "tpot_ms": 5.7, "ttft_ms": 214.0},
         "spec": {"tokens_per_s": 342.5, "tpot_ms": 3.75, "ttft_ms": 37.0},
         "warmup_pass": {"plain": {"ttft_ms": 900.0}}}
    v = gpu_run.spec_value(r)
    assert v["speedup"] == 2.031 and v["speedup_per_token"] == 1.52
    assert v["plain_ttft_ms"] == 214.0 and v["warmup_plain_ttft_ms"] == 900.0
