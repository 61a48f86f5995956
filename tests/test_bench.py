"""`specdec bench --concurrency ... --paired`: the modes time-sliced in one process."""
import json
from argparse import Namespace

from conftest import PROMPTS, load_prompts


def test_paired_bench_runs_every_mode_on_the_same_requests(built_repo, tmp_path):
    from backend.bench import paired_bench

    cfg = paired_bench._serve_config(built_repo)           # as the Triton model reads config.pbtxt
    assert cfg.max_batch == 32 and (cfg.engine_dir.endswith("engine"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in load_prompts(PROMPTS)[:3]) + "\n")
    args = Namespace(concurrency="1,2", rounds=1, prompts=str(prompts), drafter="prompt-lookup",
                     model_repository=str(built_repo), temperature=0.0, max_new_tokens=12,
                     sweep_k="2", json=str(tmp_path / "r.json"), plot=str(tmp_path / "r.png"))
    result = paired_bench.main(args)
    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert (tmp_path / "r.png").stat().st_size > 0
    rows = result["concurrency"]
    assert [r["n"] for r in rows] == [1, 2]
    for r in rows:
        # greedy and lossless: every mode emits exactly plain's tokens for the same requests
        assert r["plain_output_tokens"] > 0
        for m in ("fixed", "auto", "control"):
            assert r[f"{m}_output_tokens"] == r["plain_output_tokens"], m
            assert r[f"{m}_tokens_per_s"] > 0 and r[f"{m}_speedup"] > 0
        assert r["plain_draft_tokens_per_output_token"] == 0 == r["control_draft_tokens_per_output_token"]
        assert r["fixed_draft_tokens_per_output_token"] > 0
    assert set(rows[0]["fixed_k_speedup"]) == {"2", "5"}
    assert "auto_vs_best_fixed" in rows[0] and "fixed_k_speedup" not in rows[1]
