"""The generator's memory under the fault suite's soak mix, round by round (perf-notes §14, §25).

    SPECDEC_ISA=amx|avx512 .venv/bin/python benchmarks/soak_rss.py [--repo R] [--rounds 5]

Starts Triton on a built model repository (the embedded default, built into --repo when absent),
runs a warm-up of 120 soak requests and then --rounds of 240 (12 at a time, every third client
gone after three events, `specdec` and `ensemble` in turn), and prints one JSON line per snapshot:
the generator's RSS, its thread count and highest thread id (new threads would show as churn), and
its resident memory by mapping kind from /proc/PID/smaps. A leak grows every round; a high-water
mark stops growing."""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench import soak  # noqa: E402
from backend.serve.launcher import TritonServer  # noqa: E402


def by_mapping(pid: int) -> dict[str, float]:
    """Resident MiB by mapping kind: [heap], [stack], file-backed, anonymous by size."""
    kinds, cur = collections.Counter(), None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            name = parts[5] if len(parts) > 5 else ""
            if not name:
                size = hi - lo
                name = "[anon >=8M]" if size >= 8 << 20 else "[anon 1-8M]" if size >= 1 << 20 else "[anon <1M]"
            elif "/" in name:
                name = "file"
            cur = name
        elif parts[0] == "Rss:":
            kinds[cur] += int(parts[1])
    return {k: round(v / 1024, 1) for k, v in kinds.most_common(8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default="/tmp/specdec-soak-rss/repo", help="a built model repository")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    repo = Path(args.repo)
    if not (repo / "generator").exists():
        from backend.builder.embedded import default_drafts, default_gguf
        from backend.builder.pipeline import BuildConfig, build
        build(BuildConfig(target=str(default_gguf()), output=repo, drafts=default_drafts(), quiet=True))
    srv = TritonServer(repo, log_file=repo.parent / "server.log")
    srv.start()
    try:
        pid = srv.stubs()["generator_0_0"][0]

        def snap(label: str) -> None:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
            print(json.dumps({"label": label, "isa": os.environ.get("SPECDEC_ISA", "auto"),
                              "rss": round(srv.rss_bytes()["generator_0_0"] / 2 ** 20), "threads": len(tids),
                              "maxtid": tids[-1], "smaps_mib": by_mapping(pid)}), flush=True)
        snap("start")
        soak.run(srv.http_url, "specdec", requests=120, concurrency=12, max_tokens=args.max_tokens)
        snap("warm")
        for i in range(args.rounds):
            soak.run(srv.http_url, ("specdec", "ensemble")[i % 2], requests=240, concurrency=12,
                     max_tokens=args.max_tokens)
            time.sleep(2)
            snap(f"round{i}")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
