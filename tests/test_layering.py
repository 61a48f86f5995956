"""The import layering (issue 25, point 1; issue 43, point 1; issue 51, point 4): the runtimes never
reach the build wing (engine-file formats both use live in backend/engine_format.py), nothing
imports the CLI, only the tools (cli, bench) and serve itself import serve/, the build's
orchestration (backend/builder) reaches a device only through the registry and what devices share
(backend/buildlib) never climbs above them, no serving file imports a device's runtime (the
Runtime protocol answers), the kernels (plugins/) import only the core below them, and no
file-level import circle exists anywhere in backend/ or plugins/. Every import counts, module
level or inside a function, followed transitively where the rule says so; a module importing its
own package is not an edge (the package's __init__ is already running)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for d in ("backend", "plugins") for p in (ROOT / d).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                for i in range(2, len(parts) + 1):            # a package's __init__ runs too
                    name = ".".join(parts[:i])
                    if name in files and not (mod + ".").startswith(name + "."):   # not its own package
                        targets.add(name)
        graph[mod] = targets - {mod}
    return graph


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for t in graph.get(stack.pop(), ()):
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return seen


def within(mod: str, *packages: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


BUILD = ("backend.builder", "backend.buildlib")     # the build's two floors, above and below the devices


def test_the_graph_is_read():
    g = import_graph()
    assert "backend.runtime.native" in g and "backend.engine_format" in g["backend.runtime.native"]
    assert "backend.builder.pipeline" in g and "backend.devices" in g["backend.builder.pipeline"]   # allowed: the registry


def test_no_runtime_reaches_the_build_wing():
    g = import_graph()
    bad = {m: sorted(t for t in reach(g, m) if within(t, *BUILD))
           for m in g if within(m, "backend.runtime")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_nothing_imports_upward_into_cli_or_serve():
    g = import_graph()
    into_cli = {m: sorted(t for t in ts if within(t, "backend.cli")) for m, ts in g.items() if m != "backend.cli"}
    assert {m: t for m, t in into_cli.items() if t} == {}
    into_serve = {m: sorted(t for t in ts if within(t, "backend.serve"))
                  for m, ts in g.items() if not within(m, "backend.cli", "backend.bench", "backend.serve")}
    assert {m: t for m, t in into_serve.items() if t} == {}


def test_the_serving_wings_never_reach_the_build_or_the_device_seam():
    """Runtimes and drafters are loaded by the device seam (backend/devices), the drafter kinds
    (backend/draft_kinds) and the assembly (engine.py); they never reach the exporters, the head
    readers, the kinds or the seam itself."""
    g = import_graph()
    bad = {m: sorted(t for t in reach(g, m) if within(t, *BUILD, "backend.devices", "backend.draft_kinds"))
           for m in g if within(m, "backend.runtime", "backend.drafters", "backend.controller", "backend.decoder",
                                "backend.engine_format")}
    assert {m: t for m, t in bad.items() if t} == {}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def test_no_file_level_import_circle_anywhere():
    g = import_graph()
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]    # the finder finds one
    assert circles(g) == []


def test_the_build_reaches_a_device_only_through_the_registry():
    """The build is two floors: its orchestration (backend/builder: pipeline, and its measurements
    of the built engines, check and costs, through load_runtime) names the registries, never a
    device's folder or a drafter kind's module; what devices share (backend/buildlib) never
    reaches a device, a drafter kind, the orchestration or the tools above them (no arrow back
    up), and nothing below the orchestration imports it. Neither folder is named build/: tools
    and the common Python .gitignore templates read that name as build output."""
    g = import_graph()
    into = {m: sorted(t for t in ts if within(t, "backend.devices", "backend.draft_kinds"))
            for m, ts in g.items() if within(m, "backend.builder")}
    into = {m: t for m, t in into.items() if t}
    assert all(set(t) <= {"backend.devices", "backend.draft_kinds"} for t in into.values()), into
    assert set(into) == {"backend.builder.pipeline", "backend.builder.check", "backend.builder.costs"}
    above = ("backend.builder", "backend.devices", "backend.draft_kinds", "backend.engine", "backend.train",
             "backend.cli", "backend.serve", "backend.bench", "backend.triton_glue")
    up = {m: sorted(t for t in reach(g, m) if within(t, *above)) for m in g if within(m, "backend.buildlib")}
    assert {m: t for m, t in up.items() if t} == {}
    below = {m: sorted(t for t in ts if within(t, "backend.builder")) for m, ts in g.items()
             if not within(m, "backend.builder", "backend.cli", "backend.serve", "backend.bench")}
    assert {m: t for m, t in below.items() if t} == {}
    assert not (ROOT / "backend" / "build").exists()


def test_no_serving_file_imports_a_device_runtime():
    """What serving asks of an engine (its host matmul, its kernel path, ...) is the Runtime
    protocol's (runtime/base.py); so only the device seam, the build, the runtimes themselves and
    the tools (cli, bench, train) import a runtime module other than the protocol: the decoder,
    drafters, controller, scheduler, Triton glue, serve/ and the assembly never name one."""
    g = import_graph()
    runtimes = {m for m in g if within(m, "backend.runtime")} - {"backend.runtime", "backend.runtime.base"}
    allowed = ("backend.runtime", "backend.devices", *BUILD, "backend.cli", "backend.bench", "backend.train")
    bad = {m: sorted(ts & runtimes) for m, ts in g.items() if within(m, "backend") and not within(m, *allowed)}
    assert "backend.drafters.eagle" in g and "backend.triton_glue" in g
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_kernels_import_only_the_core_below_them():
    """plugins/ (kernels, their references, the ONNX Runtime stand-ins) may use the core types
    (config, tree, verify, sampling, kv_cache, manifest, engine_format) but no wing above them."""
    g = import_graph()
    upper = ("backend.runtime", *BUILD, "backend.devices", "backend.draft_kinds", "backend.drafters",
             "backend.controller", "backend.serve", "backend.bench", "backend.train", "backend.engine",
             "backend.decoder", "backend.cli", "backend.triton_glue")
    bad = {m: sorted(t for t in ts if within(t, *upper)) for m, ts in g.items() if within(m, "plugins")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_every_device_is_one_backend_in_the_registry():
    from backend.devices import BACKENDS, DEVICES, FORMATS, backend_for, formats
    from backend.manifest import Device

    assert set(DEVICES) == {b.device for b in BACKENDS} == {Device.CPU, Device.CUDA, Device.TENSORRT}
    assert set(FORMATS) == {f for b in BACKENDS for f in b.formats}
    for b in BACKENDS:
        assert all(backend_for(b.device, f) is b for f in b.formats) and set(b.defaults) <= set(b.formats)
    assert set(formats(Device.CPU)) == {"gguf", "fp32", "q4"}


def test_a_backend_missing_part_of_the_contract_cannot_be_made():
    import pytest

    from backend.devices import EngineBackend

    class Half(EngineBackend):                 # exports and loads nothing
        pass
    with pytest.raises(TypeError, match="export_targets.*load|load.*export_targets"):
        Half()


def test_a_new_device_is_its_backend_and_a_registry_line(tmp_path, monkeypatch):
    """Adding a device needs no edit to the manifest, the build, the CLI or the loader: a toy
    backend (device "toy", format "toy32": ONNX fp32 graphs under new names) with a build option and
    a recorded choice of its own, registered in BACKENDS, builds a target and a self-draft, writes
    and re-reads its manifest, loads through load_runtime and decodes greedily like the fp32 engine
    it wraps; its option reaches its exporter typed and is a `specdec build` flag; its choice is
    written into the manifest as its own record and handed back typed to its load; an unknown
    device is refused naming the known."""
    import argparse
    from dataclasses import dataclass, field, replace

    import pytest

    from backend import devices
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices import BuildOptions, DeviceRecord
    from backend.devices.onnx import OrtBackend, OrtRecord, export_graph
    from backend.manifest import Device, DraftEntry, EngineManifest, WeightFormat
    from conftest import assert_greedy_identity, make_tiny_checkpoint, spec_decoder

    toy32 = WeightFormat("toy32")

    @dataclass(frozen=True)
    class ToyOptions(BuildOptions):
        toy_stem: str = field(default="target", metadata={"help": "the toy target file's stem"})

    @dataclass(frozen=True)
    class ToyRecord(DeviceRecord):
        stem: str = ""                          # the toy's choice, which its load reads back
        layers: tuple[int, ...] = ()

    loaded = []

    class ToyBackend(OrtBackend):
        name, device, formats, defaults, options, record = "toy", Device("toy"), (toy32,), (toy32,), ToyOptions, ToyRecord

        def export_targets(self, ctx, formats):
            stem = ctx.option(ToyOptions).toy_stem
            ef = export_graph(ctx.ck, WeightFormat.FP32, ctx.ck.config.num_layers, ctx, f"{stem}_toy32", ctx.features)
            return ({toy32.value: replace(ef, weights=toy32, record=ToyRecord(stem, (ef.num_layers,)).to_json())},
                    {toy32.value: 0.0})

        def export_layers(self, ctx, n, serving):
            ef = export_graph(ctx.ck, WeightFormat.FP32, n, ctx, f"draft_self{n}_toy32")
            return f"self{n}", DraftEntry("self", ef.path, n, ctx.ck.source, weights=toy32.value,
                                         record=ToyRecord("draft", (n,)).to_json())

        def load(self, manifest, ref, options):
            loaded.append(ref.record)
            return super().load(manifest, replace(ref, record=OrtRecord()), options)

    monkeypatch.setattr(devices, "BACKENDS", devices.BACKENDS + (ToyBackend(),))
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    ToyOptions.add_args(parser)
    given = ToyOptions.from_args(parser.parse_args(["--toy-stem", "mine"]))
    built = build(BuildConfig(target=str(ckpt), output=tmp_path / "toy", device=Device("toy"), quiet=True,
                              measure_costs=False, drafts=("self:1",), options=(given,)))
    m = EngineManifest.load(built.root)
    assert m.device is Device("toy") and m.default_format is toy32 and set(m.drafts) == {"self1"}
    assert m.engines["toy32"].path == "mine_toy32.onnx"
    assert ToyRecord.of(m.engines["toy32"]) == ToyRecord("mine", (2,)) and m.engines["toy32"].record["stem"] == "mine"
    assert_greedy_identity(spec_decoder(m, "toy32", num_draft_tokens=3), "draft-model")   # self:1
    assert ToyRecord("mine", (2,)) in loaded and ToyRecord("draft", (1,)) in loaded       # typed, at its load
    with pytest.raises(ValueError, match=r"device 'npu' has no backend in this install \(devices: cpu, cuda, tensorrt, toy\)"):
        devices.backend_for(Device("npu"), "fp32")


def test_the_engines_read_a_layer_through_its_program():
    """One reading of the model description per layer (manifest.ModelConfig.program, the ops of
    backend/program.py in order): the ONNX graph, the torch model, the native kernel's layer records
    and the runtimes that size attention read a layer's activation, bias, q/k norms, post norms,
    window, rope table, q scale and score soft-cap from its program's ops, never from the
    description's fields; the feature list is declared once (manifest.FEATURES) and every backend
    implements it."""
    import re

    from backend.devices import BACKENDS
    from backend.manifest import FEATURES, ModelConfig
    from backend.program import Attention, Features, Gate, HeadNorm, Linear, Norm, Residual, Rope

    raw = re.compile(r"\b(cfg|config|c)\.(qk_norm|post_norms|window\(|local_rope\(|attn_logit_softcap|activation|"
                     r"attention_bias|scale)\b")
    readers = ["backend/buildlib/graph.py", "backend/buildlib/engine_graph.py", "backend/runtime/torch_model.py",
               "backend/runtime/torch_rt.py", "backend/runtime/native.py", "backend/runtime/ort.py",
               "backend/train/eagle_model.py"]
    hits = {f: [ln for ln in (ROOT / f).read_text().splitlines() if raw.search(ln) and "def " not in ln]
            for f in readers}
    assert {f: h for f, h in hits.items() if h} == {}
    cfg = ModelConfig(architecture="gemma3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=256, tie_word_embeddings=True, activation="gelu_tanh", qk_norm=True,
                      post_norms=True, sliding_window=8, layer_types=("sliding", "full", "sliding"),
                      rope_local_theta=1e4, attn_scale=0.5, attn_logit_softcap=30.0)
    gemma = lambda window, rope: (Norm("attn_norm"), Linear("qkv", ("q", "k", "v"), 64), HeadNorm(), Rope(rope),
                                  Attention(window, 30.0, 0.5), Linear("o", ("o",), 32), Residual("post_attn_norm"),
                                  Norm("mlp_norm"), Linear("gate_up", ("gate", "up"), 128), Gate("gelu_tanh"),
                                  Linear("down", ("down",), 32), Residual("post_mlp_norm"))
    assert cfg.program(0) == gemma(8, "local") and cfg.program(1) == gemma(0, "global")
    assert cfg.program(2, tap=True) == (Features(),) + gemma(8, "local")
    head = cfg.llama_layer().program(0, eagle3=True)
    assert head[0] == Norm("attn_norm", "hidden_norm") and Attention(0, 0.0, 0.25) in head and Gate("silu") in head
    assert len(cfg.programs()) == 3 and all(op.norm is None for op in head if isinstance(op, Residual))
    assert set(cfg.features()) <= set(FEATURES) and all(b.model_features == frozenset(FEATURES) for b in BACKENDS)
