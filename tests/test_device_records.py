"""Each device's recorded choices are its own typed record (issue 51, point 4): the manifest keeps
them as plain JSON under `record` (EngineFile, DraftEntry) and each backend reads them with its
own DeviceRecord class. Engines built before (manifest version 3, the choices as flat fields of the
shared types) still load: each flat field lands in the record under its old name, and a save
writes the new form."""
from __future__ import annotations

import json

import pytest

from backend.devices import BACKENDS, DeviceRecord
from backend.devices.cuda import Fp8Record
from backend.devices.native import NativeRecord
from backend.devices.onnx import OrtRecord
from backend.errors import ManifestMismatch
from backend.manifest import MANIFEST_VERSION, EngineManifest, ModelConfig

MODEL = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position_embeddings=256, tie_word_embeddings=True)
WIDE_REPORT = {"wide": ["qkv", "lm_head"], "chosen_by": "measured", "meets_bar": True}
FP8_REPORT = {"recipe": {"name": "block128", "gptq": True}, "chosen_by": "measured", "measured": [{"kl": 0.01}],
              "w8a8": {"w8a8_from": None, "reason": "built without a GPU"}}


def v3_engine(path: str, weights: str, **flat) -> dict:
    """An engine as a version-3 manifest wrote it (main's model_repository: every device's field on
    every engine, empty where it chose nothing)."""
    return {"path": path, "weights": weights, "num_layers": 2, "size_bytes": 1000, "batch_invariant": True,
            "pad_single_token": False, "weight_bytes_per_token": 900, "feature_layers": [0, 1], "fp8": None,
            "wide_activations": [], "activations": None, **flat}


def v3_manifest(device: str, engines: dict, drafts: dict | None = None) -> dict:
    return {"version": 3, "model": MODEL.to_json(), "engines": engines, "default_format": next(iter(engines)),
            "device": device, "max_seq_len": 128, "tokenizer_path": "tokenizer.json", "chat_template": None,
            "source": "m.gguf", "tool_versions": {}, "drafts": drafts or {}, "cost_model": None, "gpu": None,
            "source_bytes_per_token": 800}


def test_a_version_3_manifest_reads_into_each_devices_record_and_saves_the_new_form(tmp_path):
    engines = {"gguf": v3_engine("target_gguf.bin", "gguf", wide_activations=["qkv", "lm_head"],
                                 activations=WIDE_REPORT),
               "fp32": v3_engine("target_fp32.onnx", "fp32"),
               "q4": v3_engine("target_q4.onnx", "q4", pad_single_token=True)}
    drafts = {"self4": {"kind": "self", "path": "target_gguf.bin", "num_layers": 1, "source": "m.gguf",
                        "weights": "gguf", "pad_single_token": False},
              "self1": {"kind": "self", "path": "draft_self1_q4.onnx", "num_layers": 1, "source": "m.gguf",
                        "weights": "q4", "pad_single_token": True}}
    (tmp_path / "manifest.json").write_text(json.dumps(v3_manifest("cpu", engines, drafts)))
    m = EngineManifest.load(tmp_path)
    assert NativeRecord.of(m.engine("gguf")) == NativeRecord(("qkv", "lm_head"), WIDE_REPORT)
    assert m.engine("fp32").record is None and OrtRecord.of(m.engine("fp32")) == OrtRecord(False)
    assert OrtRecord.of(m.engine("q4")) == OrtRecord(True) and OrtRecord.of(m.drafts["self1"]) == OrtRecord(True)
    assert m.drafts["self4"].record is None and NativeRecord.of(m.drafts["self4"]) == NativeRecord()
    assert m.engine("gguf").feature_layers == (0, 1) and m.engine("gguf").weight_bytes_per_token == 900

    (tmp_path / "new").mkdir()
    saved = m.save(tmp_path / "new")
    d = json.loads(saved.read_text())
    assert d["version"] == MANIFEST_VERSION == 4
    assert d["engines"]["gguf"]["record"] == {"wide_activations": ["qkv", "lm_head"], "activations": WIDE_REPORT}
    assert not {"fp8", "wide_activations", "activations", "pad_single_token"} & set(d["engines"]["q4"])
    again = EngineManifest.load(saved.parent)
    assert again.engines == m.engines and again.drafts == m.drafts


def test_a_version_3_fp8_report_reads_into_the_fp8_record(tmp_path):
    engines = {"fp8": v3_engine("target_fp8.safetensors", "fp8", fp8=FP8_REPORT),
               "bf16": v3_engine("target_bf16.safetensors", "bf16")}
    (tmp_path / "manifest.json").write_text(json.dumps(v3_manifest("cuda", engines)))
    m = EngineManifest.load(tmp_path)
    record = Fp8Record.of(m.engine("fp8"))
    assert record.recipe == FP8_REPORT["recipe"] and record.w8a8 == FP8_REPORT["w8a8"]
    assert record.choice == {"chosen_by": "measured", "measured": [{"kl": 0.01}]}
    assert Fp8Record.of(m.engine("bf16")) == Fp8Record()
    made = Fp8Record.made({k: v for k, v in FP8_REPORT.items() if k != "w8a8"}, FP8_REPORT["w8a8"])
    assert Fp8Record.from_json(made) == record                     # the new form holds the same


def test_a_manifest_of_a_version_not_read_is_refused_naming_the_versions(tmp_path):
    d = v3_manifest("cpu", {"fp32": v3_engine("target_fp32.onnx", "fp32")})
    d["version"] = 2
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ManifestMismatch, match=r"manifest version 2 is not one this specdec reads \(3, 4\); "
                                                r"rebuild the engines with `specdec build`"):
        EngineManifest.load(tmp_path)


def test_every_backend_types_its_own_record():
    """Each backend declares its record class; its JSON round-trips (tuples back as tuples), and an
    engine with nothing recorded reads as the defaults."""
    assert {b.name: b.record for b in BACKENDS} == {"native": NativeRecord, "onnxruntime": OrtRecord,
                                                    "torch": Fp8Record, "tensorrt": Fp8Record}
    for rec in (NativeRecord(("qkv",), {"wide": ["qkv"]}), OrtRecord(True), Fp8Record({"name": "x"}, {}, None)):
        assert isinstance(rec, DeviceRecord) and type(rec).from_json(json.loads(json.dumps(rec.to_json()))) == rec
        assert type(rec).from_json(None) == type(rec)()


def test_a_recorded_choice_is_named_in_no_shared_file_as_architecture_md_counts():
    """architecture.md, "where a change goes": a device's recorded choice costs 0 shared files (3
    before the records: manifest.py, devices/base.py, devices/__init__.py). Each record class is
    named only in the folders of the devices that write it (cuda's FP8 record in tensorrt's too: one
    recipe for both) and by the tools that print it (bench/); the shared types carry the record
    opaquely and name no device's choice."""
    import dataclasses
    import re
    from pathlib import Path

    from backend.devices import EngineRef
    from backend.manifest import DraftEntry, EngineFile

    root = Path(__file__).resolve().parents[1]
    owners = {"NativeRecord": ("native",), "OrtRecord": ("onnx",), "Fp8Record": ("cuda", "tensorrt")}
    shared = set()
    for name, folders in owners.items():
        mine = tuple(f"devices/{f}/" for f in folders) + ("bench/",)
        shared |= {p.relative_to(root / "backend").as_posix() for p in (root / "backend").rglob("*.py")
                   if re.search(rf"\b{name}\b", p.read_text()) and not
                   p.relative_to(root / "backend").as_posix().startswith(mine)}
    doc = " ".join((root / "docs" / "architecture.md").read_text().split())
    said = int(re.search(r"\*\*(\d+) shared files\*\*", doc).group(1))
    assert len(shared) == said == 0, shared
    choices = {"fp8", "wide_activations", "activations", "pad_single_token", "recipe", "w8a8"}
    for cls in (EngineFile, DraftEntry, EngineRef):
        assert "record" in {f.name for f in dataclasses.fields(cls)}
        assert not choices & {f.name for f in dataclasses.fields(cls)}, cls
