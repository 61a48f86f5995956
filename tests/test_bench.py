"""`specdec bench --concurrency ... --paired`: the modes time-sliced in one process."""
import json
from argparse import Namespace

from conftest import PROMPTS, load_prompts


def test_paired_bench_runs_every_mode_on_the_same_requests(built_repo, tmp_path):
    """At temperature 0.7 every mode samples each request with the same seed and --ignore-eos
    reaches it: all modes decode exactly plain's tokens, request for request (issue 43: unseeded,
    the modes of one run produced 641/704/577/669 tokens)."""
    from backend.bench import paired_bench

    cfg = paired_bench._serve_config(built_repo)           # as the Triton model reads config.pbtxt
    assert cfg.max_batch == 32 and (cfg.engine_dir.endswith("engine"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in load_prompts(PROMPTS)[:2]) + "\n")
    args = Namespace(concurrency="1,2", rounds=1, prompts=str(prompts), drafter="prompt-lookup",
                     model_repository=str(built_repo), temperature=0.7, max_new_tokens=12, ignore_eos=True,
                     seed=3, sweep_k="2", json=str(tmp_path / "r.json"), plot=str(tmp_path / "r.png"))
    result = paired_bench.main(args)
    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert result["provenance"]["machine"]["threads"] >= 1 and (result["seed"], result["ignore_eos"]) == (3, True)
    assert (tmp_path / "r.png").stat().st_size > 0
    rows = result["concurrency"]
    assert [r["n"] for r in rows] == [1, 2]
    for r in rows:
        # seeded and lossless: every mode emits exactly plain's tokens for the same requests
        assert r["identical_outputs"] is True
        assert r["plain_output_tokens"] == 12 * r["requests_per_mode"]
        for m in ("fixed", "auto", "control"):
            assert r[f"{m}_output_tokens"] == r["plain_output_tokens"], m
            assert r[f"{m}_tokens_per_s"] > 0 and r[f"{m}_speedup"] > 0
        assert r["plain_draft_tokens_per_output_token"] == 0 == r["control_draft_tokens_per_output_token"]
        assert r["fixed_draft_tokens_per_output_token"] > 0
    assert set(rows[0]["fixed_k_speedup"]) == {"2", "5"}
    assert "auto_vs_best_fixed" in rows[0] and "fixed_k_speedup" not in rows[1]


def test_paired_bench_seeds_each_request_alike_in_every_mode_and_passes_ignore_eos():
    from backend.bench import paired_bench

    args = Namespace(temperature=0.7, max_new_tokens=9, ignore_eos=True)
    params = paired_bench.sampling_params(args)
    cache = {json.dumps(p["messages"]): (1, 2, 3) for p in load_prompts(PROMPTS)[:2]}   # no tokenizer needed
    prompts = load_prompts(PROMPTS)[:2]
    plain = paired_bench.request_maker(None, params, "none", None, cache, seed=0)
    fixed = paired_bench.request_maker(None, params, "prompt-lookup", 5, cache, seed=0)
    other = paired_bench.request_maker(None, params, "none", None, cache, seed=1)
    reqs = [plain(i, prompts[i % 2]) for i in range(4)]
    assert all(r.params.ignore_eos and r.params.temperature == 0.7 and r.params.max_tokens == 9 for r in reqs)
    assert [r.params.seed for r in reqs] == [fixed(i, prompts[i % 2]).params.seed for i in range(4)]
    assert len({r.params.seed for r in reqs}) == 4                     # a repeated prompt samples anew
    assert not {r.params.seed for r in reqs} & {other(i, prompts[i % 2]).params.seed for i in range(4)}
    assert paired_bench.sampling_params(Namespace(temperature=0.0, max_new_tokens=9, ignore_eos=False)).ignore_eos is False


def test_paired_bench_row_reads_differing_outputs():
    """identical_outputs compares each request's tokens, not their counts."""
    from backend.bench import paired_bench

    class Mode:
        errors = []

        def __init__(self, name, outputs):
            self.name, self._outputs = name, outputs

        def outputs(self):
            return self._outputs

        def row(self):
            return {"tokens": sum(map(len, self._outputs)), "busy_s": 1.0, "tokens_per_s": 10.0, "step_ms": 1.0,
                    "mean_accepted_tokens": 1.0, "draft_tokens_per_output_token": 0.0}

    names = ["plain", "fixed", "auto", "control"]
    same = paired_bench.level_row(1, [Mode(m, [(1, 2), (3,)]) for m in names], names, [], 1.0)
    assert same["identical_outputs"] is True and same["requests_per_mode"] == 2
    swapped = [Mode(m, [(1, 2), (3,)]) for m in names[:3]] + [Mode("control", [(2, 1), (3,)])]
    assert paired_bench.level_row(1, swapped, names, [], 1.0)["identical_outputs"] is False


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
