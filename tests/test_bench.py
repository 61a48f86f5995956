"""`specdec bench --concurrency ... --paired`: the modes time-sliced in one process."""
import json
from argparse import Namespace

from conftest import PROMPTS, load_prompts


def test_paired_bench_runs_every_mode_on_the_same_requests(built_repo, tmp_path):
    from backend.bench import paired_bench

    cfg = paired_bench._serve_config(built_repo)           # as the Triton model reads config.pbtxt
    assert cfg.max_batch == 32 and (cfg.engine_dir.endswith("engine"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in load_prompts(PROMPTS)[:2]) + "\n")
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


def test_spec_bench_records_outputs_and_seeded_sampling_identity(manifest, tmp_path):
    """`specdec bench --json` keeps each prompt's generated ids and text; at temperature > 0 the
    plain and speculative runs take the prompt's seed, so they are compared token for token too."""
    from backend.bench import spec_bench
    from backend.config import DrafterKind
    from conftest import spec_decoder

    dec = spec_decoder(manifest, manifest.default_format.value)
    out = tmp_path / "bench.json"
    result = spec_bench.run(dec, load_prompts(PROMPTS)[:3], DrafterKind.PROMPT_LOOKUP, 16, temperature=0.7,
                            ignore_eos=True, out_json=out, log=lambda *a: None)
    assert json.loads(out.read_text())["prompts"] == result["prompts"]
    assert result["all_identical_to_plain"] is True
    for row in result["prompts"]:
        assert row["identical_to_plain"] is True and "plain_output_ids" not in row
        assert len(row["output_ids"]) == row["tokens"] == 16
        assert row["output_text"] == dec.tok.decode(row["output_ids"])
    assert len({tuple(r["output_ids"]) for r in result["prompts"]}) == 3


def test_prefix_cache_budget_from_parameter_environment_and_default(monkeypatch):
    """The decoding benchmarks turn the prefix cache off (every mode sends the same prompts: a mode
    run after another would skip their prefill): `SPECDEC_PREFIX_CACHE_MB` over the model
    parameter over the default; a bad value is refused naming the parameter."""
    import pytest

    from backend.config import PREFIX_CACHE_MB
    from backend.triton_glue import prefix_cache_mb

    monkeypatch.delenv("SPECDEC_PREFIX_CACHE_MB", raising=False)
    assert prefix_cache_mb({}) == PREFIX_CACHE_MB and prefix_cache_mb({"prefix_cache_mb": ""}) == PREFIX_CACHE_MB
    assert prefix_cache_mb({"prefix_cache_mb": "64"}) == 64 and prefix_cache_mb({"prefix_cache_mb": "0"}) == 0
    monkeypatch.setenv("SPECDEC_PREFIX_CACHE_MB", "0")
    assert prefix_cache_mb({"prefix_cache_mb": "64"}) == 0
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("SPECDEC_PREFIX_CACHE_MB", bad)
        with pytest.raises(ValueError, match="prefix_cache_mb"):
            prefix_cache_mb({})


def test_compare_with_prefix_caches_warms_every_mode_alike(manifest):
    """`specdec bench --prefix-cache`: each mode its own decoder and cache; the warm-up pass runs
    plain decoding too, so every mode's measured requests take the same cached prompt tokens, and
    the outputs stay plain decoding's."""
    from dataclasses import replace

    from backend.bench import spec_bench
    from backend.config import DrafterKind, ServeConfig
    from backend.engine import make_decoder

    cfg = ServeConfig(engine_dir=str(manifest.root), prefix_cache_mb=64)
    plain, decs = spec_bench.decoders_for(cfg, [DrafterKind.SUFFIX, DrafterKind.PROMPT_LOOKUP])
    prompts = load_prompts(PROMPTS)[:2]
    result = spec_bench.compare(plain, decs, prompts, 12, ignore_eos=True, log=lambda *a: None,
                                warmup_passes=1, prefix_cache_mb=64)
    assert result["prefix_cache_mb"] == 64
    cached = {k: (r["plain"]["cached_prompt_tokens"], r["spec"]["cached_prompt_tokens"])
              for k, r in result["results"].items()}
    first = cached["suffix"][0]
    assert first > 0 and all(c == (first, first) for c in cached.values()), cached
    assert all(r["all_identical_to_plain"] for r in result["results"].values())
    cold = spec_bench.compare(make_decoder(replace(cfg, prefix_cache_mb=0)), {DrafterKind.SUFFIX: make_decoder(
        replace(cfg, prefix_cache_mb=0))}, prompts, 12, ignore_eos=True, log=lambda *a: None, warmup_passes=1)
    assert cold["plain"]["cached_prompt_tokens"] == cold["spec"]["cached_prompt_tokens"] == 0
    assert [p["output_ids"] for p in cold["prompts"]] == [p["output_ids"] for p in result["results"]["suffix"]["prompts"]]
