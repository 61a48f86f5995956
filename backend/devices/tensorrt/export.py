"""The build for `--device tensorrt`: the engine graph (graph.py with GraphSpec.plugins: attention
and verification as specdec:: plugin nodes, FP8 as explicit float8 Q/DQ) written as ONNX for
the target and every draft, and where TensorRT and a GPU are present, the strongly typed
TensorRT engines (`<stem>.plan` beside each `.onnx`) built from it through the ONNX parser with
the plugins of plugins/trt_plugins.py. Where they are absent it writes the engine-ready ONNX and
the manifest, builds nothing, and says in one line what is missing.

FP8 is the GPU runtime's recipe (runtime/fp8.py), chosen the same way (devices/cuda/export.fp8_plan:
measured quality, or `--fp8-recipe`) and written by buildlib/fp8_graph.py; the static recipe's
input scales are calibrated on the stdlib-docstring prompts; a draft model gets its own
calibration, a self-draft reads the target's scales, an EAGLE head is calibrated on the target's
features of the same prompts (buildlib/calibration.calibrate with `head`); drafts use the target's
recipe; an EAGLE head's fc stays float32.
Knows: which files to write, TensorRT's builder and optimization profiles. Does not know:
graph wiring (graph.py, engine_graph.py), serving.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from backend.buildlib.checkpoint import Checkpoint
from backend.buildlib.graph import GraphSpec, build_decoder, save_model, weight_bytes_per_token
from backend.engine_format import plan_path  # noqa: F401 (re-exported: the TensorRT runtime and tests name it here)
from backend.devices.cuda.record import Fp8Record
from backend.manifest import DraftEntry, EngineFile, WeightFormat

OPT_BATCH, OPT_NODES = 8, 4          # the profile's optimum: a decode step of a small batch


def environment() -> tuple[dict | None, str | None]:
    """(the GPU and TensorRT this build runs on, None), or (None, what is missing in one line)."""
    try:
        import tensorrt as trt
    except ImportError:
        return None, "TensorRT is not installed (pip install -e '.[tensorrt]' on the GPU machine)"
    if not hasattr(trt, "Builder"):
        return None, f"TensorRT {trt.__version__} here is a runtime without the builder (tensorrt-lean)"
    try:
        import torch
    except ImportError:
        return None, "torch is not installed (pip install -e '.[tensorrt]')"
    if not torch.cuda.is_available():
        return None, f"no CUDA GPU on this machine (TensorRT {trt.__version__} is installed)"
    from backend.devices.cuda.export import gpu_info

    return {**gpu_info(), "tensorrt": trt.__version__}, None


def _write(ck: Checkpoint, spec: GraphSpec, engine_dir: Path, stem: str, act: dict | None, recipe=None) -> EngineFile:
    path = Path(engine_dir) / f"{stem}.onnx"
    model = build_decoder(ck, spec, act_scales=act, fp8_recipe=recipe)
    per_token = weight_bytes_per_token(model)
    size = save_model(model, path)
    return EngineFile(path=path.name, weights=spec.weights, num_layers=spec.num_layers, size_bytes=size,
                      weight_bytes_per_token=per_token, feature_layers=spec.feature_layers)


def _calibrate(ck: Checkpoint, max_seq_len: int, tokenizer_json: Path, log, head: Checkpoint | None = None,
               head_fc=None, features: tuple[int, ...] = ()) -> dict:
    from backend.buildlib.calibration import calibrate, checkpoint_prompts

    t0 = time.time()
    prompts = checkpoint_prompts(ck, tokenizer_json)
    act = calibrate(ck, prompts, max_seq_len, head=head, head_fc=head_fc, features=features)
    log(f"FP8 activation scales of {(head or ck).source} calibrated on {len(prompts)} prompts in "
        f"{time.time() - t0:.1f}s")
    return act


def export_all(ck: Checkpoint, formats, max_seq_len: int, engine_dir: Path, tokenizer_json: Path, log,
               features: tuple[int, ...] = (), fp8_choice: str = "auto"):
    """The target's engine graph in every format -> ({format: EngineFile}, {format: s}, FP8 input
    scales, FP8 recipe); `features`: EAGLE-3's layers (GraphSpec.feature_layers)."""
    from backend.devices.cuda.export import fp8_plan

    act, recipe, report = fp8_plan(ck, max_seq_len, tokenizer_json, log, fp8_choice) \
        if WeightFormat.FP8 in formats else (None, None, None)
    engines, timings = {}, {}
    for fmt in formats:
        t0 = time.time()
        spec = GraphSpec(fmt, ck.config.num_layers, max_seq_len, plugins=True, feature_layers=features)
        ef = _write(ck, spec, engine_dir, f"target_{fmt.value}", act, recipe)
        engines[fmt.value] = replace(ef, record=Fp8Record.made(report)) if fmt is WeightFormat.FP8 else ef
        timings[fmt.value] = time.time() - t0
    return engines, timings, act, recipe


# Drafts: engine graphs without the verification tail, in the target's format and FP8 recipe
# (a self-draft's layers are the target's, weight-only linears too; another model's are its own).
def _own(recipe):
    return recipe.with_weight_only(()) if recipe is not None else None


def export_layers(ck: Checkpoint, n: int, target: EngineFile, act: dict | None, max_seq_len: int, engine_dir: Path,
                  log, recipe=None) -> tuple[str, DraftEntry]:
    fmt = target.weights
    ef = _write(ck, GraphSpec(fmt, n, max_seq_len, plugins=True, verify=False), engine_dir,
                f"draft_self{n}_{fmt.value}", act, recipe)
    log(f"self-draft: first {n} layers + head, {fmt.value}")
    return f"self{n}", DraftEntry("self", ef.path, n, ck.source, weights=fmt.value)


def export_head(head: Path, ck: Checkpoint, target: EngineFile, max_seq_len: int, engine_dir: Path,
                tokenizer_json: Path, log, recipe=None) -> tuple[str, DraftEntry]:
    from backend.buildlib.drafts import eagle3_fc, eagle_entry
    from backend.buildlib.heads.eagle import head_checkpoint

    fmt = target.weights
    hck, vocab = head_checkpoint(head, ck)
    hact = (_calibrate(ck, max_seq_len, tokenizer_json, log, hck, *eagle3_fc(head, target))
            if fmt is WeightFormat.FP8 else None)
    ef = _write(hck, GraphSpec(fmt, 1, max_seq_len, eagle=True, plugins=True, verify=False), engine_dir,
                f"draft_eagle_{fmt.value}", hact, _own(recipe))
    log(f"EAGLE head from {head} -> {ef.path} ({fmt.value})")
    return "eagle", eagle_entry(head, engine_dir, ef.path, vocab, hck.config, weights=fmt.value)


def export_draft_model(spec: str, ck: Checkpoint, target: EngineFile, max_seq_len: int, engine_dir: Path,
                       tokenizer_json: Path, log, recipe=None) -> tuple[str, DraftEntry]:
    from backend.buildlib.drafts import draft_checkpoint

    fmt = target.weights
    dck = draft_checkpoint(spec, ck.config)
    dact = _calibrate(dck, max_seq_len, tokenizer_json, log) if fmt is WeightFormat.FP8 else None
    stem = f"draft_{Path(spec).stem.replace('.', '_')}_{fmt.value}"
    ef = _write(dck, GraphSpec(fmt, dck.config.num_layers, max_seq_len, plugins=True, verify=False), engine_dir,
                stem, dact, _own(recipe))
    log(f"draft model {spec}: {dck.config.num_layers} layers, {fmt.value}")
    return "model", DraftEntry("model", ef.path, dck.config.num_layers, str(spec), weights=fmt.value,
                               model=dck.config)


def profile_shapes(onnx_path: Path, max_seq_len: int, max_batch: int, slots: int, columns: int) -> dict:
    """Input name -> (min, opt, max) shapes of the optimization profile, from the graph's named
    dimensions: B rows, T nodes, R logits rows, P path depth (up to T), S KV slots (the
    runtime's sequences + 1 spare, at most `slots`), L columns (max_seq_len + scratch)."""
    import onnx

    dims = {"B": (1, OPT_BATCH, max_batch), "T": (1, OPT_NODES, max_seq_len),
            "R": (1, OPT_NODES, max_seq_len), "P": (1, OPT_NODES, max_seq_len),
            "S": (1, min(17, slots), slots), "L": (columns, columns, columns)}
    model = onnx.load(str(onnx_path), load_external_data=False)
    out = {}
    for i in model.graph.input:
        shape = [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        out[i.name] = tuple(tuple(dims[s][k] if isinstance(s, str) else s for s in shape) for k in range(3))
    return out


def build_plan(onnx_path: Path, max_seq_len: int, max_batch: int, slots: int, columns: int, log) -> Path:
    """A strongly typed TensorRT engine from the engine graph (ONNX parser, our plugins)."""
    import tensorrt as trt

    import plugins.trt_plugins  # noqa: F401  (registers the specdec:: plugins)

    t0 = time.time()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(onnx_path, max_seq_len, max_batch, slots, columns).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise RuntimeError(f"TensorRT could not build {onnx_path} (see its log above)")
    path = plan_path(onnx_path)
    path.write_bytes(bytes(blob))
    log(f"TensorRT engine {path.name}: {path.stat().st_size / 1e6:.1f} MB in {time.time() - t0:.1f}s")
    return path
