"""Which kernels a step of the GPU check ran, counted by name (issue 49, point 1): the same count on
the GPU and on the dry run's CPU, so the dry run can prove that it ran the GPU's code.

Counted while a `Count` is active (a context manager; counts add up over nested ones), each call
once it returned (one that raised ran nothing):
    <kernel name>         a Triton launch through plugins.kernels.launch (the one launch point of
                          plugins/kernels.py and plugins/fused.py); `[W8]` appended where the launch
                          reads FP8 codes (the W8A16 linear's split and fused gate_up programs),
                          `[split]` where it reduces a split-K linear's partials (SPLIT > 1)
    torch._scaled_mm      the hardware FP8 GEMM (runtime/torch_model.Linear._scaled_mm)
    graph_capture         a step captured (runtime/step_graph.capture: a CUDA graph, or the CPU's
                          stand-in EagerGraph); the kernels of the capture are counted once
    graph_replay          a captured step replayed (its kernels are not counted again: on a GPU
                          they never pass through Python)
    host:tree_attention_ref, host:verify_on_host
                          the CPU fallbacks of attention and verification (where the GPU path
                          did not run)
A subprocess is counted by running it under this file:
    python benchmarks/gpu_count.py COUNTS.json -m module [args]     # or: script.py [args]
which writes its counts to COUNTS.json when it exits (normally, by SystemExit or an exception).
"""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Count:
    """Counts launches by name while active (`counts`: a Counter; `one()` a fresh one for a
    part of the step, e.g. the launches of one timed forward)."""

    _active: list["Count"] = []
    _saved: dict | None = None

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()

    def __enter__(self) -> "Count":
        if not Count._active:
            _patch()
        Count._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        Count._active.remove(self)
        if not Count._active:
            _unpatch()

    @staticmethod
    def add(name: str) -> None:
        for c in Count._active:
            c.counts[name] += 1


def _kernel_name(kernel, kwargs: dict) -> str:
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))
    return name + ("[W8]" if kwargs.get("W8") else "") + ("[split]" if kwargs.get("SPLIT", 1) > 1 else "")


def _patch() -> None:
    import torch

    from backend.runtime import base, step_graph
    from plugins import kernels, reference

    saved = {(kernels, "launch"): kernels.launch, (torch, "_scaled_mm"): torch._scaled_mm,
             (step_graph, "capture"): step_graph.capture,
             (step_graph.CudaGraph, "replay"): step_graph.CudaGraph.replay,
             (step_graph.EagerGraph, "replay"): step_graph.EagerGraph.replay,
             (reference, "tree_attention_ref"): reference.tree_attention_ref,
             (base, "verify_on_host"): base.verify_on_host}
    Count._saved = saved

    def counted(name, fn):              # counted once it returned: a call that raised ran nothing
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            Count.add(name)
            return out
        return run

    def launch(kernel, grid, *args, **kwargs):
        saved[(kernels, "launch")](kernel, grid, *args, **kwargs)
        Count.add(_kernel_name(kernel, kwargs))

    kernels.launch = launch
    torch._scaled_mm = counted("torch._scaled_mm", saved[(torch, "_scaled_mm")])
    step_graph.capture = counted("graph_capture", saved[(step_graph, "capture")])
    step_graph.CudaGraph.replay = counted("graph_replay", saved[(step_graph.CudaGraph, "replay")])
    step_graph.EagerGraph.replay = counted("graph_replay", saved[(step_graph.EagerGraph, "replay")])
    reference.tree_attention_ref = counted("host:tree_attention_ref", saved[(reference, "tree_attention_ref")])
    base.verify_on_host = counted("host:verify_on_host", saved[(base, "verify_on_host")])
    _rebind_importers()


def _rebind_importers() -> None:
    """Modules that imported a counted function by name (`from backend.runtime.base import
    verify_on_host`) get the current one (counted, or the original back)."""
    import backend.runtime.torch_rt as torch_rt

    from backend.runtime import base

    torch_rt.verify_on_host = base.verify_on_host


def _unpatch() -> None:
    for (owner, attr), fn in (Count._saved or {}).items():
        setattr(owner, attr, fn)
    _rebind_importers()
    Count._saved = None


def run_counted(out: str, argv: list[str]) -> None:
    """Run `-m module args` or `script.py args` as __main__ under a Count; its counts to `out`."""
    import runpy

    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    count = Count()
    try:
        with count:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
    finally:
        Path(out).write_text(json.dumps(dict(count.counts), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    run_counted(sys.argv[1], sys.argv[2:])
