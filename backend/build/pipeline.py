"""The build: checkpoint -> ONNX engines + tokenizer + manifest -> filled model repository.

CLI -> BuildConfig -> build() -> EngineManifest (on disk) -> config.pbtxt files.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from backend.build import checkpoint as ckpt_mod
from backend.build import drafts as drafts_mod
from backend.build.graph import GraphSpec, build_decoder, save_model, weight_bytes_per_token
from backend.build.templates import fill_repository
from backend.errors import UserError
from backend.manifest import FORMATS, DraftEntry, Device, EngineFile, EngineManifest, WeightFormat
from backend.runtime import native

ENGINE_SUBDIR = "specdec/engine"     # inside the model repository, shared by all models


class BuildError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class BuildConfig:
    target: str | None                       # checkpoint path; None = embedded default
    output: Path                             # model repository to fill
    device: Device = Device.CPU
    weights: tuple[WeightFormat, ...] | None = None   # None: default_weights(device)
    default_format: WeightFormat | None = None   # serving format; None = first of `weights`
    drafts: tuple[str, ...] = ()             # "PATH" | "self:N" | "eagle:DIR"
    max_seq_len: int = 2048
    max_batch_size: int = 64
    check_invariance: bool = True
    measure_costs: bool = True
    quiet: bool = False
    extra: dict = field(default_factory=dict)


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="layer", disable=quiet, file=sys.stderr, leave=False)


def _tool_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("specdec", "onnx", "onnxruntime", "gguf", "tokenizers", "numpy", "torch", "triton"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    if native.compiled():
        out["native_kernel"] = native.isa()          # the instruction set decode.c was compiled for
    return out


def default_weights(device: Device) -> tuple[WeightFormat, ...]:
    """The formats a build makes when --weights is not given; the first one serves. On a CPU the
    GGUF blocks on our own kernel (fastest, batch invariant by construction: perf-notes §12),
    where the install compiled it, then fp32 and q4 on ONNX Runtime."""
    if device is Device.CUDA:
        return (WeightFormat.BF16, WeightFormat.FP8)
    if device is Device.TENSORRT:
        return (WeightFormat.FP8,)
    lead = (WeightFormat.GGUF,) if native.compiled() else ()
    return (*lead, WeightFormat.FP32, WeightFormat.Q4)


def build(cfg: BuildConfig) -> EngineManifest:
    if cfg.weights is None:
        cfg = replace(cfg, weights=default_weights(cfg.device))
    wrong = [w.value for w in cfg.weights if w not in FORMATS[cfg.device]]
    if WeightFormat.GGUF in cfg.weights and not native.compiled():
        raise BuildError("--weights gguf needs the native CPU kernel, which the install did not compile "
                         "(no C compiler with OpenMP?): install gcc and rerun `.venv/bin/pip install -e '.[all]'`, "
                         "or build --weights fp32,q4")
    if wrong:
        raise BuildError(f"--weights {','.join(wrong)}: not a format of --device {cfg.device.value} "
                         f"(formats: {', '.join(w.value for w in FORMATS[cfg.device])})")
    t_start = time.time()
    log = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, file=sys.stderr))
    source = cfg.target
    if source is None:
        from backend.build.embedded import default_gguf

        source = str(default_gguf())
        log(f"target: embedded default {source}")
    t0 = time.time()
    ck = ckpt_mod.load_checkpoint(source)            # a wrong target fails before anything is written
    engine_dir = Path(cfg.output) / ENGINE_SUBDIR
    engine_dir.mkdir(parents=True, exist_ok=True)
    log(f"loaded {ck.config.architecture} ({ck.config.num_layers} layers, vocab "
        f"{ck.config.vocab_size}, {ck.file_type}) in {time.time() - t0:.1f}s")
    max_seq = min(cfg.max_seq_len, ck.config.max_position_embeddings)

    tok_path = engine_dir / "tokenizer.json"
    from backend.tokenizer import tokenizer_json_from_gguf

    tok_json = ck.tokenizer.tokenizer_json or tokenizer_json_from_gguf(ck.tokenizer.gguf_vocab)
    tok_path.write_text(tok_json)
    (engine_dir / "tokenizer_meta.json").write_text(json.dumps(
        {"add_bos_token": ck.tokenizer.add_bos_token}) + "\n")

    engines: dict[str, EngineFile] = {}
    timings: dict[str, float] = {}
    drafts: dict[str, DraftEntry] = dict(drafts_mod.medusa_entry(s, engine_dir, ck.config, log)
                                         for s in cfg.drafts if s.startswith("medusa:"))
    device_drafts = [s for s in cfg.drafts if not s.startswith("medusa:")]    # the rest: per device
    features = drafts_mod.feature_layers(cfg.drafts, ck.config)    # an EAGLE-3 head's target layers
    if features:
        log(f"EAGLE-3 head: the target engines output the inputs of layers {list(features)} as features")
    gpu = None
    default_format = cfg.default_format or cfg.weights[0]
    if cfg.device is Device.CUDA:
        from backend.build import torch_engine

        gpu = torch_engine.gpu_info()
        log(f"GPU: {gpu['name']} (sm {gpu['compute_capability']})" if gpu else
            "no CUDA device: the torch engines are built for this CPU (tests, FP8 quality); "
            "a GPU server needs the build run on its GPU")
        engines, timings = torch_engine.export_all(ck, cfg.weights, max_seq, engine_dir, tok_path, log, features)
        for spec in device_drafts:
            name, entry = torch_engine.build_draft(spec, ck, engines[default_format.value], max_seq, engine_dir, log)
            drafts[name] = entry
    elif cfg.device is Device.TENSORRT:
        from backend.build import trt_engine

        gpu, missing = trt_engine.environment()
        engines, timings, act = trt_engine.export_all(ck, cfg.weights, max_seq, engine_dir, tok_path, log, features)
        for spec in device_drafts:
            name, entry = trt_engine.build_draft(spec, ck, engines[default_format.value], act, max_seq,
                                                 engine_dir, tok_path, log)
            drafts[name] = entry
        onnx_files = [engine_dir / x.path for x in [*engines.values(), *drafts.values()] if x.path.endswith(".onnx")]
        if missing:
            log(f"engine-ready ONNX written, no TensorRT engine built: {missing}")
        else:
            from backend.kv_slots import SCRATCH_COLUMNS

            log(f"GPU: {gpu['name']} (sm {gpu['compute_capability']}), TensorRT {gpu['tensorrt']}")
            for f in onnx_files:
                trt_engine.build_plan(f, max_seq, cfg.max_batch_size, cfg.max_batch_size + 1,
                                      max_seq + SCRATCH_COLUMNS, log)
    else:
        for fmt in cfg.weights:
            t0 = time.time()
            engines[fmt.value] = _export(ck, fmt, ck.config.num_layers, max_seq, engine_dir,
                                         f"target_{fmt.value}", cfg.quiet, features)
            timings[fmt.value] = time.time() - t0
        for spec in device_drafts:
            name, entry = _build_draft(spec, ck, max_seq, engine_dir, cfg.quiet, log, engines[default_format.value])
            drafts[name] = entry

    manifest = EngineManifest(
        model=ck.config, engines=engines, default_format=default_format,
        device=cfg.device, max_seq_len=max_seq, tokenizer_path="tokenizer.json",
        chat_template=ck.tokenizer.chat_template, source=str(source),
        tool_versions=_tool_versions(), drafts=drafts, gpu=gpu, root=engine_dir.resolve(),
        source_bytes_per_token=ck.bytes_per_token())
    manifest.save(engine_dir)
    from backend.runtime import reference_executor

    runnable = cfg.device is not Device.TENSORRT or gpu is not None or reference_executor()
    if not runnable:
        log("batch invariance and the cost model are measured where the TensorRT engines are built")
    if cfg.check_invariance and runnable:
        from backend.build.check import measure_invariance

        checked = {}
        for key, ef in engines.items():
            diff = measure_invariance(manifest, ef)
            checked[key] = EngineFile(**{**ef.__dict__, "batch_invariant": diff == 0.0})
            log(f"batch invariance {key}: max |logit diff| verify vs single steps = {diff:.3g}")
        manifest = manifest.with_updates(engines=checked)
        manifest.save(engine_dir)
    if cfg.measure_costs and runnable:
        from backend.build.costs import measure_cost_model

        t0 = time.time()
        manifest = manifest.with_updates(cost_model=measure_cost_model(manifest))
        check_priced(manifest)
        manifest.save(engine_dir)
        log(f"cost model measured in {time.time() - t0:.1f}s: forward ms at M=1..64: "
            f"{[round(1000 * s, 1) for s in manifest.cost_model['seconds']]}; draft ms per step "
            f"{ {k: round(1000 * v, 2) for k, v in manifest.cost_model['draft_step_s'].items()} }; "
            f"catch-up ms per token { {k: round(1000 * v, 3) for k, v in manifest.cost_model['catch_up_s'].items()} }")
    written = fill_repository(Path(cfg.output), template_values(manifest, cfg))
    _summary(manifest, engine_dir, written, timings, time.time() - t_start, log)
    return EngineManifest.load(engine_dir)


def check_priced(manifest: EngineManifest) -> None:
    """Every drafter the built repository serves has its cost entry (the controller would price
    an unpriced one at nothing): BuildError naming it otherwise."""
    from backend.config import SpecConfig
    from backend.controller import CostModel, UnpricedDrafter
    from backend.engine import make_drafters

    drafters = make_drafters(manifest, SpecConfig())
    try:
        CostModel.from_json(manifest.cost_model).check_priced({k.value: d.traits for k, d in drafters.items()})
    except UnpricedDrafter as exc:
        raise BuildError(str(exc)) from None


def template_values(m: EngineManifest, cfg: BuildConfig) -> dict[str, object]:
    return {
        "engine_dir": ENGINE_SUBDIR,
        "max_batch_size": cfg.max_batch_size,
        "default_format": m.default_format.value,
        "max_seq_len": m.max_seq_len,
        "drafts": ",".join(sorted(m.drafts)) or "none",
        "default_drafter": cfg.extra.get("default_drafter", "auto"),
        "instance_kind": "KIND_GPU" if m.gpu else "KIND_CPU",
        "remote_draft": cfg.extra.get("remote_draft", ""),
        "remote_draft_kind": cfg.extra.get("remote_draft_kind", "draft-model"),
    }


def write_draft_node(repository: Path, kind: str, output: Path) -> Path:
    """A model repository with only the `draft` model: a draft node serving `kind` (draft-model
    or eagle) from the engines built in `repository`."""
    from backend.build.templates import fill

    engine_dir = (Path(repository) / ENGINE_SUBDIR).resolve()
    m = EngineManifest.load(engine_dir)
    src = Path(__file__).resolve().parents[1] / "serve" / "draft_node"
    dst = Path(output) / "draft"
    (dst / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "1" / "model.py", dst / "1" / "model.py")
    text = fill((src / "config.pbtxt.template").read_text(),
                {"engine_dir": str(engine_dir), "draft_kind": kind,
                 "instance_kind": "KIND_GPU" if m.gpu else "KIND_CPU"}, str(src))
    (dst / "config.pbtxt").write_text(text)
    return dst


def _export(ck, fmt: WeightFormat, num_layers: int, max_seq: int, engine_dir: Path, stem: str,
            quiet: bool, features: tuple[int, ...] = ()) -> EngineFile:
    if fmt is WeightFormat.GGUF:          # the kernel outputs the feature layers the runtime names
        from backend.build.native_engine import export_native

        return replace(export_native(ck, num_layers, max_seq, engine_dir / f"{stem}.bin"), feature_layers=features)
    bar = _progress(num_layers, f"export {stem}", quiet)
    model = build_decoder(ck, GraphSpec(fmt, num_layers, max_seq, feature_layers=features), progress=bar.update)
    bar.close()
    path = engine_dir / f"{stem}.onnx"
    per_token = weight_bytes_per_token(model)
    size = save_model(model, path)
    return EngineFile(path=path.name, weights=fmt, num_layers=num_layers, size_bytes=size,
                      pad_single_token=fmt is WeightFormat.Q4, weight_bytes_per_token=per_token,
                      feature_layers=features)


def _build_draft(spec: str, target, max_seq: int, engine_dir: Path, quiet: bool, log, serving: EngineFile):
    if spec.startswith("self:"):
        n = drafts_mod.self_layers(spec, target.config)
        if serving.weights is WeightFormat.GGUF:      # the serving engine's first n layers, no new file
            log(f"self-draft: first {n} layers + head of {serving.path}")
            return f"self{n}", DraftEntry("self", serving.path, n, target.source, {"weights": serving.weights.value})
        ef = _export(target, WeightFormat.Q4, n, max_seq, engine_dir, f"draft_self{n}_q4", quiet)
        log(f"self-draft: first {n} layers + head, q4")
        return f"self{n}", DraftEntry("self", ef.path, n, target.source,
                                     {"weights": "q4", "pad_single_token": ef.pad_single_token})
    if spec.startswith("eagle:"):
        from backend.drafters.eagle_export import export_eagle_head

        head = drafts_mod.head_dir(spec)
        native_head = serving.weights is WeightFormat.GGUF     # the head on the serving kernel too
        path, vocab = export_eagle_head(head, target, engine_dir, max_seq, native=native_head)
        entry = drafts_mod.eagle_entry(head, engine_dir, path.name, vocab,
                                       **({"weights": WeightFormat.GGUF.value} if native_head else {}))
        log(f"EAGLE head from {head} -> {path.name} (draft vocabulary {entry.extra['draft_vocab_size']})")
        return "eagle", entry
    dck = drafts_mod.draft_checkpoint(spec, target.config)
    fmt = WeightFormat.Q4 if dck.config.hidden_size % 32 == 0 else WeightFormat.FP32
    stem = f"draft_{Path(spec).stem.replace('.', '_')}_{fmt.value}"
    ef = _export(dck, fmt, dck.config.num_layers, max_seq, engine_dir, stem, quiet)
    entry = DraftEntry("model", ef.path, dck.config.num_layers, str(spec),
                       {"weights": fmt.value, "pad_single_token": ef.pad_single_token,
                        "model": dck.config.to_json()})
    log(f"draft model {spec}: {dck.config.num_layers} layers, {fmt.value}")
    return "model", entry


def _summary(m: EngineManifest, engine_dir: Path, written, timings, total, log) -> None:
    log("")
    log("build summary")
    log(f"  model      {m.model.architecture}, {m.model.num_layers} layers, hidden "
        f"{m.model.hidden_size}, vocab {m.model.vocab_size}, max_seq_len {m.max_seq_len}")
    for key, ef in m.engines.items():
        inv = {True: "yes", False: "no", None: "not checked"}[ef.batch_invariant]
        per_token = f"  reads {ef.weight_bytes_per_token / 1e6:.1f} MB/token" if ef.weight_bytes_per_token else ""
        log(f"  engine     {key:5s} {ef.size_bytes / 1e6:8.1f} MB  {timings.get(key, 0):5.1f}s  "
            f"batch-invariant: {inv}{per_token}  {engine_dir / ef.path}")
    if m.source_bytes_per_token:
        log(f"  source     reads {m.source_bytes_per_token / 1e6:.1f} MB/token straight from the checkpoint "
            f"(llama.cpp on a GGUF)")
    for name, d in m.drafts.items():
        log(f"  draft      {name}: {d.kind} {engine_dir / d.path}")
    log(f"  default    {m.default_format.value}")
    log(f"  manifest   {engine_dir / 'manifest.json'}")
    for w in written:
        log(f"  config     {w}")
    log(f"  total      {total:.1f}s")


def clean(output: Path) -> None:
    shutil.rmtree(Path(output) / ENGINE_SUBDIR, ignore_errors=True)
