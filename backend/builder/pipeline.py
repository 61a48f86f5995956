"""The build: checkpoint -> engines + tokenizer + manifest -> filled model repository.

CLI -> BuildConfig -> build() -> EngineManifest (on disk) -> config.pbtxt files. Every device-
specific step (target and draft export, the GPU recorded, plan compilation, whether this machine
runs what it built) is its backend's (backend/devices); this module only orders them.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from backend.buildlib import checkpoint as ckpt_mod
from backend.builder.templates import fill_repository
from backend.errors import UserError
from backend import devices, draft_kinds
from backend.manifest import DraftEntry, Device, EngineFile, EngineManifest, WeightFormat

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
    options: tuple[devices.BuildOptions, ...] = ()   # the backends' own (devices.OPTIONS); defaults otherwise
    default_drafter: str = "auto"            # the served repository's config.pbtxt
    remote_draft: str = ""
    remote_draft_kind: str = "draft-model"


def _tool_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("specdec", "onnx", "onnxruntime", "gguf", "tokenizers", "numpy", "torch", "triton"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    for b in devices.BACKENDS:
        out.update(b.versions())
    return out


def machine_bytes() -> int:
    """The memory this machine (or this process's cgroup, where it is limited) holds."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        return total


def fitting(weights: tuple[WeightFormat, ...], owners, ck, log, serving: WeightFormat | None = None
            ) -> tuple[WeightFormat, ...]:
    """The default formats whose build fits in half this machine's memory (the rest for the file
    being read, the system and its other work): a default that does not fit the machine is not
    the default (issue 53). The serving format (--default-format, else the first) always stays."""
    budget = machine_bytes() // 2
    serving = serving or weights[0]
    kept = []
    for w, b in zip(weights, owners):
        need = b.build_bytes(ck, w)
        if w is not serving and need is not None and need > budget:
            log(f"--weights: {w.value} left out of the default build: it needs ~{need / 1e9:.1f} GB to build, more "
                f"than half of this machine's {machine_bytes() / 1e9:.1f} GB (name it in --weights to build it anyway)")
        else:
            kept.append(w)
    return tuple(kept)


def build(cfg: BuildConfig) -> EngineManifest:
    by_default = cfg.weights is None
    if by_default:
        cfg = replace(cfg, weights=devices.default_weights(cfg.device))
    try:
        owners = [devices.backend_for(cfg.device, w) for w in cfg.weights]
    except ValueError as exc:
        raise BuildError(f"--weights: {exc}") from None
    for w, b in zip(cfg.weights, owners):
        if b.missing():
            raise BuildError(f"--weights {w.value} {b.missing()}")
    t_start = time.time()
    log = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, file=sys.stderr))
    from backend.builder.embedded import resolve_target

    source = resolve_target(cfg.target)     # a path, a model package's name, or the default
    if source != cfg.target:
        log(f"target: {cfg.target or 'embedded default'} -> {source}")
    t0 = time.time()
    ck = ckpt_mod.load_checkpoint(source)            # a wrong target fails before anything is written
    for w, b in zip(cfg.weights, owners):
        if b.unsupported(ck.config):
            raise BuildError(f"{ck.config.architecture} on --device {cfg.device.value} --weights {w.value}: "
                             f"its engines do not implement {', '.join(b.unsupported(ck.config))} yet; "
                             f"build it with --device cpu")
    if by_default:
        cfg = replace(cfg, weights=fitting(cfg.weights, owners, ck, log, cfg.default_format))
        owners = [devices.backend_for(cfg.device, w) for w in cfg.weights]
    engine_dir = Path(cfg.output) / ENGINE_SUBDIR
    engine_dir.mkdir(parents=True, exist_ok=True)
    log(f"loaded {ck.config.architecture} ({ck.config.num_layers} layers, vocab "
        f"{ck.config.vocab_size}, {ck.file_type}) in {time.time() - t0:.1f}s")

    tok_path = engine_dir / "tokenizer.json"
    from backend.tokenizer import tokenizer_json_from_gguf

    tok_json = ck.tokenizer.tokenizer_json or tokenizer_json_from_gguf(ck.tokenizer.gguf_vocab)
    tok_path.write_text(tok_json)
    (engine_dir / "tokenizer_meta.json").write_text(json.dumps(
        {"add_bos_token": ck.tokenizer.add_bos_token}) + "\n")

    ctx = devices.BuildContext(ck, engine_dir, tok_path, min(cfg.max_seq_len, ck.config.max_position_embeddings),
                               cfg.max_batch_size, log, cfg.quiet,
                               target_features(cfg.drafts, ck.config),   # an EAGLE-3 head's layers
                               options=cfg.options)
    if ctx.features:
        log(f"EAGLE-3 head: the target engines output the inputs of layers {list(ctx.features)} as features")
    default_format = cfg.default_format or cfg.weights[0]
    serving = devices.backend_for(cfg.device, default_format)     # its backend builds the drafts
    gpu = serving.environment(ctx)
    engines: dict[str, EngineFile] = {}
    timings: dict[str, float] = {}
    for backend in dict.fromkeys(owners):                          # each backend its formats, in order
        e, t = backend.export_targets(ctx, tuple(w for w, b in zip(cfg.weights, owners) if b is backend))
        engines.update(e)
        timings.update(t)
    drafts: dict[str, DraftEntry] = {}
    for spec in cfg.drafts:                                        # each by its kind, through the backend
        name, entry = draft_kinds.kind_for(spec).export(ctx, spec, serving, engines[default_format.value])
        drafts[name] = entry
    serving.finish(ctx, engines, drafts)
    max_seq = ctx.max_seq_len

    manifest = EngineManifest(
        model=ck.config, engines=engines, default_format=default_format,
        device=cfg.device, max_seq_len=max_seq, tokenizer_path="tokenizer.json",
        chat_template=ck.tokenizer.chat_template, source=str(source),
        tool_versions=_tool_versions(), drafts=drafts, gpu=gpu, root=engine_dir.resolve(),
        source_bytes_per_token=ck.bytes_per_token())
    manifest.save(engine_dir)
    runnable = serving.measurable(gpu)
    if not runnable:
        log("batch invariance and the cost model are measured where the TensorRT engines are built")
    if cfg.check_invariance and runnable:
        from backend.builder.check import measure_invariance

        checked = {}
        for key, ef in engines.items():
            diff = measure_invariance(manifest, ef)
            checked[key] = EngineFile(**{**ef.__dict__, "batch_invariant": diff == 0.0})
            log(f"batch invariance {key}: max |logit diff| verify vs single steps = {diff:.3g}")
        manifest = manifest.with_updates(engines=checked)
        manifest.save(engine_dir)
    if cfg.measure_costs and runnable:
        from backend.builder.costs import measure_cost_model

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


def target_features(specs, cfg) -> tuple[int, ...]:
    """The target layers whose features the drafts among `specs` read (the target engines output
    them: EngineFile.feature_layers); () without any. Two drafts must agree."""
    wanted = {draft_kinds.kind_for(s).target_features(s, cfg) for s in specs} - {()}
    if len(wanted) > 1:
        raise BuildError(f"drafts reading different target layers {sorted(wanted)}: build one of them")
    return wanted.pop() if wanted else ()


def check_priced(manifest: EngineManifest) -> None:
    """Every drafter the built repository serves has its cost entry (the controller would price
    an unpriced one at nothing): BuildError naming it otherwise."""
    from backend.config import SpecConfig
    from backend.controller import CostModel, UnpricedDrafter

    drafters: dict = {}
    for kind in draft_kinds.KINDS:                       # what the assembly makes (engine.make_drafters)
        drafters.update(kind.make(manifest, SpecConfig(), None, drafters, lambda k: True))
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
        "default_drafter": cfg.default_drafter,
        "instance_kind": "KIND_GPU" if m.gpu else "KIND_CPU",
        "remote_draft": cfg.remote_draft,
        "remote_draft_kind": cfg.remote_draft_kind,
    }


def write_draft_node(repository: Path, kind: str, output: Path) -> Path:
    """A model repository with only the `draft` model: a draft node serving `kind` (draft-model
    or eagle) from the engines built in `repository`."""
    from backend.builder.templates import fill

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
