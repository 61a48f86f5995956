"""`specdec` command line: build, serve, health, generate, bench, bench-prefix, bench-engine, train-draft,
check-kernels, quality."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from backend import cli_args
from backend.bench.prompt_sets import load_prompts
from backend.cli_args import add_build_args  # noqa: F401 (build_engines.py's parser)
from backend.config import DrafterKind
from backend.manifest import Device, WeightFormat


def cmd_build(args) -> int:
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices import OPTIONS

    weights = tuple(WeightFormat(w.strip()) for w in args.weights.split(",") if w.strip()) if args.weights else None
    cfg = BuildConfig(
        target=args.target, output=Path(args.output), device=Device(args.device), weights=weights,
        default_format=WeightFormat(args.default_format) if args.default_format else None,
        drafts=_drafts(args), max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size,
        check_invariance=not args.no_invariance_check, measure_costs=not args.no_cost_model,
        quiet=args.quiet, remote_draft=args.remote_draft, remote_draft_kind=args.remote_draft_kind,
        options=tuple(options.from_args(args) for options in OPTIONS))
    build(cfg)
    return 0


def _drafts(args) -> tuple[str, ...]:
    """--draft as given; without any, the embedded target comes with its default drafts."""
    from backend.builder.embedded import default_drafts

    if args.draft or getattr(args, "target", None) is not None:
        return tuple(args.draft)
    return default_drafts()


def _engine_dir(args) -> Path:
    from backend.builder.pipeline import ENGINE_SUBDIR

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
        return f"  kernel   {native.isa()} (native CPU engine; SPECDEC_ISA={'|'.join(native.ISAS)})\n"
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
                        f"(SPECDEC_ISA=avx2 or avx-vnni loads another library: set it for the whole run instead)")
    m = EngineManifest.load(_engine_dir(args))
    if args.builds:
        pairs = [b.partition("=") for b in args.builds.split(";")]
        if any(not name or not path for name, _, path in pairs):
            raise UserError(f"--builds: expected name=library.so by ';', got {args.builds!r}")
        engine_bench.ab_builds(m, {name: path for name, _, path in pairs}, isas, args.reps,
                               Path(args.json) if args.json else None)
        return 0
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

    from backend.builder.embedded import GGUF_NAME
    from backend.builder.pipeline import ENGINE_SUBDIR, BuildConfig, build
    from backend.manifest import READS
    from backend.serve.launcher import TritonServer
    from backend.serve.supervisor import Supervisor

    dynamo = _check_dynamo_args(args)
    repo = Path(args.model_repository)
    manifest = repo / ENGINE_SUBDIR / "manifest.json"
    if not manifest.exists() and not (repo / "draft" / "config.pbtxt").exists():
        print(f"no engines in {repo}: building the embedded default (first run) ...", flush=True)
        build(BuildConfig(target=None, output=repo, drafts=_drafts(args)))
    elif manifest.exists() and json.loads(manifest.read_text()).get("version") not in READS:
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
    if dynamo:
        from backend.serve.dynamo.launch import serve

        return serve(args, repo)
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port,
                          log_verbose=args.log_verbose, log_file=args.log_file)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    print("starting tritonserver ...", flush=True)
    supervisor = Supervisor(server, on_event=lambda msg: print(msg, flush=True)).start()
    front = _start_openai(args, repo / ENGINE_SUBDIR, server.http_url, supervisor)
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


def _check_dynamo_args(args) -> bool:
    """Whether `specdec serve` puts nodes behind NVIDIA Dynamo (docs/scale-out.md); its flags checked."""
    from backend.errors import UserError

    if args.nodes < 0:
        raise UserError(f"--nodes must be >= 0, got {args.nodes}")
    if sum(map(bool, (args.nodes, args.dynamo_node, args.dynamo_frontend))) > 1:
        raise UserError("--nodes, --dynamo-node and --dynamo-frontend are three ways to serve: choose one")
    if args.migration_limit < 0:
        raise UserError(f"--migration-limit must be >= 0, got {args.migration_limit}")
    return bool(args.nodes or args.dynamo_node or args.dynamo_frontend)


def _start_openai(args, engine_dir: Path, triton_http_url: str, supervisor):
    """The OpenAI-compatible front door on --openai-port (None with --no-openai, or for a draft
    node's repository, which has no `specdec` model)."""
    from backend.serve.openai_api import Front, OpenAIServer

    if args.no_openai or not (engine_dir / "manifest.json").exists():
        return None
    try:
        return OpenAIServer(Front(triton_http_url), args.openai_port).start()
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
    from backend.builder.pipeline import write_draft_node

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
    from backend.builder.embedded import cache_dir
    from backend.builder.pipeline import ENGINE_SUBDIR, BuildConfig, build
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


# The subcommands in `specdec --help`'s order: name, help line, its flags (cli_args.py), its command.
SUBCOMMANDS = (
    ("build", "build engines + manifest and fill the model repository", cli_args.add_build_args, cmd_build),
    ("serve", "start tritonserver on 127.0.0.1 (builds engines on first run)", cli_args.add_serve_args, cmd_serve),
    ("generate", "stream a completion from a running server", cli_args.add_generate_args, cmd_generate),
    ("bench", "plain vs speculative decoding on the same prompts", cli_args.add_bench_args, cmd_bench),
    ("train-draft", "train the EAGLE-style draft head (torch, CPU)", cli_args.add_train_draft_args, cmd_train_draft),
    ("bench-prefix", "the prefix cache: TTFT of a shared prefix hit vs a miss, the drafters' catch-up, a "
                     "shared-system-prompt workload on and off", cli_args.add_bench_prefix_args, cmd_bench_prefix),
    ("bench-engine", "cost of one target forward; plain greedy tokens/s", cli_args.add_bench_engine_args,
     cmd_bench_engine),
    ("build-draft-node", "a model repository serving a built draft to remote targets",
     cli_args.add_build_draft_node_args, cmd_build_draft_node),
    ("health", "a short canary generation with a deadline (exit 1 if it fails)", cli_args.add_health_args,
     cmd_health),
    ("check-kernels", "every GPU kernel against its reference on this machine", cli_args.add_check_kernels_args,
     cmd_check_kernels),
    ("quality", "teacher-forced top-1 agreement and KL of a weight format", cli_args.add_quality_args, cmd_quality),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_line, add_args, command in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_line)
        add_args(p)
        p.set_defaults(func=command)
    args = ap.parse_args(argv)
    from backend.errors import UserError

    try:
        return args.func(args)
    except UserError as exc:            # the user's to fix: one line, exit 2 (argparse's code)
        print(f"specdec {args.cmd}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
