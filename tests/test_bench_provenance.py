"""Every bench JSON says where it came from (issue 43, point 4): date, machine, commit and the
exact command, written by the bench itself (backend/bench/provenance.py)."""
import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def _commit() -> dict:
    out = {"hash": _git("rev-parse", "--short", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}
    if out["dirty"]:
        diff = subprocess.run(["git", "-C", str(ROOT), "diff", "--binary", "HEAD"], capture_output=True, check=True).stdout
        out["diff_sha256"] = hashlib.sha256(diff).hexdigest()
    return out


def test_provenance_records_date_machine_commit_and_command(monkeypatch):
    from backend.bench import provenance as prov
    from backend.runtime import native

    monkeypatch.setattr(sys, "argv", ["/opt/bin/specdec", "bench", "--prompts", "my prompts.jsonl"])
    before = _commit()                  # others may commit meanwhile: the state before or after
    p = prov.provenance(3)
    assert p["commit"] in (before, _commit())
    assert set(p) == {"date", "machine", "commit", "command"}
    date = datetime.datetime.fromisoformat(p["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - date).total_seconds()) < 60
    m = p["machine"]
    assert set(m) == {"cpu", "logical_cpus", "native_isa", "threads", "gpu"}
    assert isinstance(m["cpu"], str) and m["cpu"] and m["logical_cpus"] == os.cpu_count() and m["threads"] == 3
    assert m["native_isa"] == (native.isa() if native.compiled() else None)
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        gpu = None
    assert m["gpu"] == gpu
    assert p["command"] == "/opt/bin/specdec bench --prompts 'my prompts.jsonl'"   # quoted as a shell reads it


def test_provenance_records_null_where_a_fact_is_not_there(monkeypatch, tmp_path):
    """Outside a git checkout (an installed copy) the commit is null, and a native kernel that
    does not load is a null ISA, not a failed bench."""
    from backend.bench import provenance as prov
    from backend.runtime import native

    def broken():
        raise RuntimeError("the native CPU engine is not compiled")

    monkeypatch.setattr(native, "isa", broken)
    monkeypatch.setattr(prov, "REPO", tmp_path)
    p = prov.provenance(None)
    assert p["commit"] is None and p["machine"]["native_isa"] is None and p["machine"]["threads"] is None


def test_write_result_puts_the_provenance_first(tmp_path):
    from backend.bench.provenance import write_result

    out = write_result(tmp_path / "r.json", {"speedup": 1.5, "rows": [1, 2]}, threads=2)
    text = (tmp_path / "r.json").read_text()
    assert text.endswith("}\n") and text.startswith('{\n  "provenance": {')      # indent 2, trailing newline
    assert json.loads(text) == out and list(out) == ["provenance", "speedup", "rows"]
    assert out["speedup"] == 1.5 and out["provenance"]["machine"]["threads"] == 2


def test_engine_threads_follows_the_runtimes_rule(monkeypatch):
    from backend.bench.provenance import engine_threads
    from backend.config import RuntimeOptions

    monkeypatch.setenv("SPECDEC_THREADS", "3")
    assert engine_threads() == 3 == engine_threads(RuntimeOptions())
    assert engine_threads(RuntimeOptions(threads=5)) == 5
    monkeypatch.delenv("SPECDEC_THREADS")
    assert engine_threads() == min(2, os.cpu_count())


def test_a_bench_run_from_its_command_line_writes_its_provenance(tmp_path):
    """`specdec check-kernels --quick --json PATH` (the cheapest bench): its JSON holds the
    provenance with the command exactly as run, program name included."""
    pytest.importorskip("torch")
    specdec = Path(sys.executable).with_name("specdec")
    out = tmp_path / "kernel check.json"
    argv = [str(specdec), "check-kernels", "--quick", "--json", str(out)]
    before = _git("rev-parse", "--short", "HEAD")
    subprocess.run(argv, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    saved = json.loads(out.read_text())
    assert [k["name"] for k in saved["kernels"]] == ["tree_attention", "verify", "engine_graph"]
    p = saved["provenance"]
    assert p["command"] == shlex.join(argv) and "'" in p["command"]
    assert p["machine"]["threads"] is None                  # a correctness check runs on no engine threads
    assert p["commit"]["hash"] in (before, _git("rev-parse", "--short", "HEAD"))


def test_a_dirty_tree_records_the_diffs_hash(tmp_path, monkeypatch):
    """Issue 50: a result measured on uncommitted changes names them by the hash of `git diff
    HEAD`; another change gives another hash, a clean tree none."""
    from backend.bench import provenance as prov

    repo = tmp_path / "repo"
    repo.mkdir()
    def git(*a):
        subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)
    git("init", "-q")
    (repo / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(prov, "REPO", repo.resolve())
    clean = prov._commit()
    assert clean["dirty"] is False and "diff_sha256" not in clean
    (repo / "f.py").write_text("a = 2\n")
    one = prov._commit()
    diff = subprocess.run(["git", "-C", str(repo), "diff", "--binary", "HEAD"], capture_output=True).stdout
    assert one["dirty"] is True and one["diff_sha256"] == hashlib.sha256(diff).hexdigest()
    (repo / "f.py").write_text("a = 3\n")
    assert prov._commit()["diff_sha256"] != one["diff_sha256"]
