"""`specdec` command line: build, serve, health, generate, bench, bench-prefix, bench-engine, train-draft,
check-kernels, quality."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from backend.bench.prompt_sets import default_prompts, load_prompts
from backend.config import DrafterKind
from backend.devices import DEVICES, FORMATS
from backend.manifest import Device, WeightFormat
from backend.runtime.fp8 import RECIPES as FP8_RECIPES

DEFAULT_REPO = "model_repository"


def add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="HF checkpoint directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", choices=[d.value for d in DEVICES],
                   help="cpu: our C kernel over GGUF blocks and ONNX Runtime graphs; cuda: torch + Triton kernels (built on the GPU "
                        "that serves; without a GPU, for this CPU); tensorrt: TensorRT engines with "
                        "our plugins (built on the GPU that serves; without TensorRT and a GPU, the "
                        "engine-ready ONNX only)")
    p.add_argument("--weights", default=None,
                   help="weight formats to build, comma separated (first = serving default): "
                        "gguf, fp32, q4 for cpu (default gguf,fp32,q4; gguf: the GGUF's own blocks on our C "
                        "kernel, left out where the install could not compile it); fp32, bf16, fp8 for cuda (default bf16,fp8); "
                        "fp32, fp8 for tensorrt (default fp8)")
    p.add_argument("--default-format", default=None, choices=[f.value for f in FORMATS],
                   help="format serving uses (default: the first of --weights)")
    p.add_argument("--draft", action="append", default=[],
                   help="draft to build: a checkpoint PATH (any vocabulary: another tokenizer is mapped "
                        "by bytes, docs/hetero-vocab.md), self:N (first N target layers + head), eagle:DIR "
                        "(trained head: ours, or EAGLE-1/2/3's published layout) or medusa:DIR (Medusa-1 "
                        "heads); repeatable (default for the embedded target: self:4 and the committed EAGLE head)")
    p.add_argument("--output", default=DEFAULT_REPO, help="model repository to fill")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--no-invariance-check", action="store_true")
    p.add_argument("--no-cost-model", action="store_true",
                   help="skip measuring forward costs (the adaptive speculation controller needs them)")
    p.add_argument("--remote-draft", default="",
                   help="draft on a draft node: its tritonserver's gRPC host:port, or `local` for "
                        "this server's own (serve a node with `specdec build-draft-node`)")
    p.add_argument("--remote-draft-kind", default="draft-model", choices=["draft-model", "eagle"])
    p.add_argument("--fp8-recipe", default="auto",
                   choices=["auto"] + [n for r in FP8_RECIPES for n in (r.name, r.name + "+gptq")],
                   help="FP8 engines: how weights and inputs are scaled (+gptq: weights rounded by GPTQ on "
                        "the calibration prompts); auto: the fastest recipe that meets the quality bar on "
                        "held-out calibration prompts, weights rounded by GPTQ (docs/building.md)")
    p.add_argument("--wide-activations", default="auto",
                   help="gguf engines: the matrices whose inputs the native kernel takes as wide activations "
                        "(two int8 rows, ~14 bits) instead of int8: fidelity (the fewest that keep top-1 "
                        "agreement >= 0.995 with all wide on the calibration prompts), auto (those, where they "
                        "cost a plain decode step <= 3%% on this machine; else int8), none, all, or families by "
                        "comma: qkv, o, gate_up, down, lm_head (docs/building.md)")
    p.add_argument("--quiet", action="store_true")


def cmd_build(args) -> int:
    from backend.build.pipeline import BuildConfig, build

    weights = tuple(WeightFormat(w.strip()) for w in args.weights.split(",") if w.strip()) if args.weights else None
    cfg = BuildConfig(
        target=args.target, output=Path(args.output), device=Device(args.device), weights=weights,
        default_format=WeightFormat(args.default_format) if args.default_format else None,
        drafts=_drafts(args), max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size,
        check_invariance=not args.no_invariance_check, measure_costs=not args.no_cost_model,
        quiet=args.quiet, extra={"remote_draft": args.remote_draft, "remote_draft_kind": args.remote_draft_kind,
                                 "fp8_recipe": args.fp8_recipe, "wide_activations": args.wide_activations})
    build(cfg)
    return 0


def _drafts(args) -> tuple[str, ...]:
    """--draft as given; without any, the embedded target comes with its default drafts."""
    from backend.build.embedded import default_drafts

    if args.draft or getattr(args, "target", None) is not None:
        return tuple(args.draft)
    return default_drafts()


def _engine_dir(args) -> Path:
    from backend.build.pipeline import ENGINE_SUBDIR

    return Path(args.model_repository) / ENGINE_SUBDIR


def cmd_bench(args) -> int:
    if args.concurrency:
        from backend.bench import concurrency_bench, paired_bench

        (paired_bench if args.paired else concurrency_bench).main(args)
        return 0
    from backend.bench import spec_bench
    from backend.config import ServeConfig, SpecConfig
    from backend.engine import make_decoder

    drafters = [d.strip().partition(":") for d in args.drafter.split(",") if d.strip()]
    draft_name = next((name for _, _, name in drafters if name), None)
    spec = SpecConfig(num_draft_tokens=args.num_draft_tokens, draft_model=draft_name,
                      draft_width=args.draft_width, prompt_lookup_width=args.lookup_width,
                      eagle_gate=not args.no_eagle_gate)
    # no prefix cache by default: the plain run of a prompt would fill it for the speculative run
    # after it, flattering the ratio (the cache's own bench: specdec bench-prefix); with
    # --prefix-cache every mode gets a decoder and a cache of its own, and all warm up alike
    cache_mb = args.prefix_cache
    if cache_mb < 0:
        from backend.errors import UserError

        raise UserError(f"--prefix-cache must be >= 0 (MiB), got {cache_mb:g}")
    cfg = ServeConfig(engine_dir=str(_engine_dir(args)), weight_format=args.format, spec=spec, prefix_cache_mb=cache_mb)
    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = prompts[: args.limit]
    kinds = [DrafterKind(kind) for kind, _, _ in drafters]
    out = Path(args.json) if args.json else None
    if len(kinds) == 1 and not cache_mb:
        dec = make_decoder(cfg)
        spec_bench.run(dec, prompts, DrafterKind(kinds[0]), args.max_new_tokens, args.temperature,
                       args.num_draft_tokens, args.ignore_eos, out, warmup_passes=args.warmup_passes)
    else:
        plain, decoders = spec_bench.decoders_for(cfg, kinds)
        spec_bench.compare(plain, decoders, prompts, args.max_new_tokens, args.temperature, args.num_draft_tokens,
                           args.ignore_eos, out, warmup_passes=args.warmup_passes, prefix_cache_mb=cache_mb)
    return 0


def cmd_bench_prefix(args) -> int:
    from backend.bench import prefix_bench

    prefix_bench.main(args)
    return 0


def _kernel_line() -> str:
    """The native kernel's matmul path on this machine (SPECDEC_ISA as the server sees it), or nothing."""
    from backend.runtime import native

    if not native.compiled():
        return ""
    try:
        return f"  kernel   {native.isa()} (native CPU engine; SPECDEC_ISA=auto|amx|avx512|avx2)\n"
    except Exception as exc:                     # noqa: BLE001 - the server's own load reports it too
        return f"  kernel   not loadable here: {exc}\n"


def cmd_bench_engine(args) -> int:
    from backend.bench import engine_bench
    from backend.errors import UserError
    from backend.manifest import EngineManifest

    isas = (args.isa or "default").split(";")
    bad = next((i for i in isas if i not in engine_bench.ISAS), None)
    if bad is not None:
        raise UserError(f"--isa: {bad!r} is not one of {', '.join(engine_bench.ISAS)} "
                        f"(SPECDEC_ISA=avx2 loads another library: set it for the whole run instead)")
    m = EngineManifest.load(_engine_dir(args))
    if args.wide or args.isa:
        engine_bench.ab(m, load_prompts(args.prompts), (args.wide or "built").split(";"), isas, args.reps,
                        args.max_new_tokens, Path(args.json) if args.json else None)
        return 0
    engine_bench.run(m, load_prompts(args.prompts), Path(args.json) if args.json else None,
                     Path(args.plot) if args.plot else None,
                     formats=args.formats.split(",") if args.formats else None, reps=args.reps,
                     max_new=args.max_new_tokens, quick=args.quick)
    return 0


def cmd_check_kernels(args) -> int:
    from backend.bench import kernel_check

    result = kernel_check.run(args.json, args.quick)
    return 0 if all(k["ok"] or "skipped" in k for k in result["kernels"]) else 1


def cmd_quality(args) -> int:
    from backend.bench import quality

    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = prompts[: args.limit]
    quality.run(str(_engine_dir(args)), args.format, args.reference, prompts, args.max_new_tokens, args.json)
    return 0


def cmd_serve(args) -> int:
    import signal
    import threading

    from backend.build.embedded import GGUF_NAME
    from backend.build.pipeline import ENGINE_SUBDIR, BuildConfig, build
    from backend.manifest import MANIFEST_VERSION
    from backend.serve.launcher import TritonServer
    from backend.serve.supervisor import Supervisor

    repo = Path(args.model_repository)
    manifest = repo / ENGINE_SUBDIR / "manifest.json"
    if not manifest.exists() and not (repo / "draft" / "config.pbtxt").exists():
        print(f"no engines in {repo}: building the embedded default (first run) ...", flush=True)
        build(BuildConfig(target=None, output=repo, drafts=_drafts(args)))
    elif manifest.exists() and json.loads(manifest.read_text()).get("version") != MANIFEST_VERSION:
        source = json.loads(manifest.read_text()).get("source", "")
        if Path(source).name != GGUF_NAME:
            print(f"the engines in {repo} were built by an older specdec; rebuild them with "
                  f"`specdec build --target {source} --output {repo}` (and your --draft options)", flush=True)
            return 2
        print(f"the embedded default in {repo} was built by an older specdec: rebuilding ...", flush=True)
        build(BuildConfig(target=None, output=repo, drafts=_drafts(args)))
    problem = _cannot_run_here(repo / ENGINE_SUBDIR)
    if problem:
        print(problem, flush=True)
        return 2
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port,
                          log_verbose=args.log_verbose, log_file=args.log_file)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    print("starting tritonserver ...", flush=True)
    supervisor = Supervisor(server, on_event=lambda msg: print(msg, flush=True)).start()
    front = _start_openai(args, repo / ENGINE_SUBDIR, server.grpc_url, supervisor)
    print(f"specdec is serving {repo}\n"
          f"  HTTP     http://{server.http_url}  (POST /v2/models/specdec/generate_stream)\n"
          f"  gRPC     {server.grpc_url}\n"
          f"  metrics  {server.metrics_url}\n"
          f"{_openai_line(front)}"
          f"{_kernel_line()}"
          f"Try: .venv/bin/specdec generate \"Write a haiku about the sea\" --stream --url {server.grpc_url}\n"
          f"Ctrl-C stops the server.", flush=True)
    while not stop.wait(0.5):
        pass
    print("stopping tritonserver ...", flush=True)
    if front:
        front.stop()
    rc = supervisor.stop()
    print(f"stopped (exit code {rc})", flush=True)
    return 0 if rc in (0, None) else 1


def _start_openai(args, engine_dir: Path, grpc_url: str, supervisor):
    """The OpenAI-compatible front door on --openai-port (None with --no-openai, or for a draft
    node's repository, which has no `specdec` model)."""
    from backend.serve.openai_api import OpenAIServer, front_for

    if args.no_openai or not (engine_dir / "manifest.json").exists():
        return None
    try:
        return OpenAIServer(front_for(engine_dir, grpc_url), args.openai_port).start()
    except Exception:
        supervisor.stop()
        raise


def _openai_line(front) -> str:
    if front is None:
        return ""
    return (f"  OpenAI   {front.url}  (/chat/completions, /completions, /models; model \"specdec\")\n"
            f"           e.g. openai.OpenAI(base_url=\"{front.url}\", api_key=\"none\")\n")


def _cannot_run_here(engine_dir: Path) -> str | None:
    """Why this machine cannot run the repository's engines (the message load_runtime would
    raise inside the model, with the rebuild command), before tritonserver starts; None if it can."""
    from backend.devices import check_here
    from backend.manifest import EngineManifest

    if not (engine_dir / "manifest.json").exists():
        return None
    m = EngineManifest.load(engine_dir)
    try:
        check_here(m)
    except (RuntimeError, ImportError) as exc:
        return str(exc)
    return None


def cmd_build_draft_node(args) -> int:
    from backend.build.pipeline import write_draft_node

    out = write_draft_node(Path(args.model_repository), args.kind, Path(args.output))
    print(f"draft node ({args.kind}) written to {out}; serve it with "
          f"`specdec serve --model-repository {Path(args.output)}` (or tritonserver)")
    return 0


def cmd_health(args) -> int:
    from backend.serve.supervisor import canary

    ok, what = canary(args.url, args.model, args.timeout)
    print(f"{'healthy' if ok else 'UNHEALTHY'}: {args.model} at {args.url}: {what}", flush=True)
    return 0 if ok else 1


def cmd_generate(args) -> int:
    from backend.serve import client

    return client.main(args)


def cmd_train_draft(args) -> int:
    from backend.build.embedded import cache_dir
    from backend.build.pipeline import ENGINE_SUBDIR, BuildConfig, build
    from backend.manifest import EngineManifest
    from backend.train.eagle_train import TrainConfig, train

    repo = Path(args.model_repository)
    engine_dir = repo / ENGINE_SUBDIR
    ok = (engine_dir / "manifest.json").exists()
    if ok and args.target:
        ok = Path(EngineManifest.load(engine_dir).source).resolve() == Path(args.target).resolve()
    if not ok:
        repo = Path(args.work or cache_dir() / "train") / "target_repository"
        engine_dir = repo / ENGINE_SUBDIR
        if not (engine_dir / "manifest.json").exists():
            build(BuildConfig(target=args.target, output=repo, measure_costs=False))
    work = Path(args.work) if args.work else cache_dir() / "train" / Path(args.out).name
    out = train(TrainConfig(out=Path(args.out), engine_dir=engine_dir, work=work,
                            corpus_tokens=args.corpus_tokens, num_prompts=args.prompts,
                            draft_vocab=args.vocab, epochs=args.epochs, minutes=args.minutes,
                            max_new_tokens=args.max_new_tokens, seed=args.seed,
                            val_prompts=args.val_prompts, val_every=args.val_every,
                            init=Path(args.init) if args.init else None,
                            vocab_from=Path(args.vocab_from) if args.vocab_from else None,
                            own_repeat=args.own_repeat, lr=args.lr, ttt_steps=args.ttt_steps,
                            eagle3=args.eagle3))
    print(f"draft head written to {out}; build it with: python build_engines.py --draft eagle:{out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("build", help="build engines + manifest and fill the model repository")
    add_build_args(p)
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("serve", help="start tritonserver on 127.0.0.1 (builds engines on first run)")
    p.add_argument("--model-repository", default=DEFAULT_REPO)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=8080,
                   help="port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models)")
    p.add_argument("--no-openai", action="store_true", help="do not serve the OpenAI-compatible API")
    p.add_argument("--draft", action="append", default=[],
                   help="drafts to build on first run (default: self:4 and the committed EAGLE head)")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--log-file", default=None)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="stream a completion from a running server")
    p.add_argument("prompt")
    p.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 gRPC / :8000 HTTP)")
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http"])
    p.add_argument("--model", default="specdec", help="specdec or ensemble")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--drafter", default=None, help="auto | none | prompt-lookup | suffix | draft-model | eagle")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is (no chat template): plain text to continue; needed for a base model, which has no chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="plain vs speculative decoding on the same prompts")
    p.add_argument("--model-repository", default=DEFAULT_REPO)
    p.add_argument("--prompts", default=default_prompts(),
                   help="JSON lines of chat messages, comma separated files (default: the public set; "
                        "benchmarks/prompts/agent.jsonl: repeated-structure agent traffic); a model without a "
                        "chat template (a base model) gets each prompt's text as a plain continuation")
    p.add_argument("--drafter", default="prompt-lookup",
                   help="none | prompt-lookup | suffix | draft-model[:NAME] | eagle | auto; a comma "
                        "list compares several in one run (each its own decoder, same prompts, turns "
                        "alternating per prompt) and reports their ratios per prompt kind")
    p.add_argument("--warmup-passes", type=int, default=0,
                   help="run the whole prompt set this many times through each drafter before "
                        "measuring (feeds drafters with history, suffix decoding; greedy or seeded, "
                        "the measured answers are then repeats of ones seen)")
    p.add_argument("--prefix-cache", type=float, default=0, metavar="MB",
                   help="give plain decoding and every drafter a decoder with its own prefix cache of "
                        "MB MiB (as separate servers with the default prefix_cache_mb would have; "
                        "default 0: none, every prompt prefilled in full); with --warmup-passes every "
                        "mode's cache then holds the same prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-draft-tokens", type=int, default=None, help="fixed K (default: adaptive)")
    p.add_argument("--draft-width", type=int, default=1)
    p.add_argument("--lookup-width", type=int, default=1)
    p.add_argument("--no-eagle-gate", action="store_true",
                   help="EAGLE-2's fixed tree depth and size (no confidence gating)")
    p.add_argument("--format", default=None, help="weight format (default: the manifest's)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--concurrency", default=None,
                   help="comma list of concurrent streams: benchmark against a real Triton server")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --concurrency: minimum rounds per level; modes alternate ABC CBA so drift cancels")
    p.add_argument("--control", action="store_true",
                   help="with --concurrency: also run plain decoding a second time in every round "
                        "(A/A control): its ratio to plain shows the noise of the run")
    p.add_argument("--paired", action="store_true",
                   help="with --concurrency: run the modes time-sliced in this process (one scheduler "
                        "iteration each in turn) instead of one after another on Triton, so the "
                        "machine's drift cancels out of their ratios; the control always runs")
    p.add_argument("--seed", type=int, default=0,
                   help="with --paired: request i of a level samples with seed (SEED << 32) | i in every "
                        "mode, so at a temperature > 0 the modes decode the same tokens (default 0)")
    p.add_argument("--sweep-k", default=None,
                   help="with --concurrency: other fixed K measured at n=1 (default 1,2,3,4,6,8; "
                        "tree sizes 2,4,8,12,16 for eagle)")
    p.add_argument("--plot", default=None)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("train-draft", help="train the EAGLE-style draft head (torch, CPU)")
    p.add_argument("--target", default=None, help="checkpoint (default: the embedded default)")
    p.add_argument("--model-repository", default=DEFAULT_REPO,
                   help="use the target already built here when it matches --target")
    p.add_argument("--out", required=True, help="head directory to write")
    p.add_argument("--work", default=None, help="data + checkpoints (default: ~/.cache/specdec/train/NAME)")
    p.add_argument("--corpus-tokens", type=int, default=3_000_000,
                   help="fixed text (docstrings of the stdlib and installed packages), labelled by the target")
    p.add_argument("--prompts", type=int, default=600,
                   help="also train on the target's own answers to N generated chat questions")
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary size (FR-Spec)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--minutes", type=float, default=45.0, help="training time budget")
    p.add_argument("--val-prompts", type=int, default=48, help="held-out chat questions for selection")
    p.add_argument("--val-every", type=int, default=100, help="steps between validations")
    p.add_argument("--init", default=None, help="start from this head directory's weights")
    p.add_argument("--own-repeat", type=int, default=1, help="times each own answer is seen per epoch")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--ttt-steps", type=int, default=2, help="training-time-test passes on own features")
    p.add_argument("--vocab-from", default=None,
                   help="keep this head directory's draft vocabulary instead of choosing one")
    p.add_argument("--eagle3", action="store_true",
                   help="an EAGLE-3 head on the target's low, middle and high layer features (needs the gguf or "
                        "torch engine), written in the EAGLE-3 reference's layout")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_train_draft)

    p = sub.add_parser("bench-prefix", help="the prefix cache: TTFT of a shared prefix hit vs a miss, the "
                                            "drafters' catch-up, a shared-system-prompt workload on and off")
    p.add_argument("--model-repository", default=DEFAULT_REPO)
    p.add_argument("--prompts", default=default_prompts())
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--question-tokens", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--concurrency", default="4", help="comma list of client streams for the mixed workload ('' = skip)")
    p.add_argument("--system-tokens", type=int, default=1000, help="the mixed workload's shared system prompt")
    p.add_argument("--requests", type=int, default=12, help="requests of the mixed workload, per mode")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--drafter", default="auto")
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_bench_prefix)

    p = sub.add_parser("bench-engine", help="cost of one target forward; plain greedy tokens/s")
    p.add_argument("--model-repository", default=DEFAULT_REPO)
    p.add_argument("--prompts", default=default_prompts())
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--formats", default=None)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    p.add_argument("--wide", default=None,
                   help="instead: the cost of wide activations on the gguf engine, settings by ';' (none, all, "
                        "built: the build's choice, or families by comma), alternated --reps times in one process")
    p.add_argument("--isa", default=None,
                   help="instead: the matmul paths to A/B, by ';' (amx: AMX tiles; avx512: the vector path), "
                        "crossed with --wide's settings (default built), alternated --reps times in one process")
    p.set_defaults(func=cmd_bench_engine)

    p = sub.add_parser("build-draft-node", help="a model repository serving a built draft to remote targets")
    p.add_argument("--model-repository", default=DEFAULT_REPO, help="where the draft was built")
    p.add_argument("--kind", default="draft-model", choices=["draft-model", "eagle"])
    p.add_argument("--output", required=True)
    p.set_defaults(func=cmd_build_draft_node)

    p = sub.add_parser("health", help="a short canary generation with a deadline (exit 1 if it fails)")
    p.add_argument("--url", default="127.0.0.1:8000", help="the server's HTTP host:port")
    p.add_argument("--model", default="specdec")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("check-kernels", help="every GPU kernel against its reference on this machine")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="the smallest cases only (a dry run)")
    p.set_defaults(func=cmd_check_kernels)

    p = sub.add_parser("quality", help="teacher-forced top-1 agreement and KL of a weight format")
    p.add_argument("--model-repository", default=DEFAULT_REPO,
                   help="a repository built with both formats (--device cuda; or tensorrt, run with "
                        "SPECDEC_EXECUTOR=onnxruntime where TensorRT is absent)")
    p.add_argument("--format", default="fp8")
    p.add_argument("--reference", default="fp32")
    p.add_argument("--prompts", default=default_prompts())
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_quality)

    args = ap.parse_args(argv)
    from backend.errors import UserError

    try:
        return args.func(args)
    except UserError as exc:            # the user's to fix: one line, exit 2 (argparse's code)
        print(f"specdec {args.cmd}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
