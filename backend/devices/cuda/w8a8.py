"""From which forward width an FP8 engine's input-quantizing linears run the recipe's W8A8 GEMM
(torch._scaled_mm) instead of W8A16 (plugins/kernels.linear_w8): measured by the build on the GPU
it builds for (issue 41, point 5), written into the engine file (metadata "w8a8_from", which
runtime/torch_model.load_w8a8_from reads) and the manifest (record.py: Fp8Record.w8a8).

A width is a forward's nodes per row. The widths a decode or verify step can have (up to the
largest CUDA-graph bucket, runtime/step_graph.WIDTH_BUCKETS) always run W8A16, so a verify sees
the linears of the single steps it stands for and speculative output stays plain output bit for
bit; the choice depends on the width alone, never on the batch. From FLOOR up the build times
every layer linear that this GPU's scaled GEMM runs, both ways, at each of WIDTHS (random bf16
inputs [width, K], the median of `reps` after a warm-up call), and W8A8 runs from the smallest
width at which it is faster by MARGIN there and at every larger width measured. None (W8A16 at
every width) where it never is, where no linear of the recipe runs in hardware here, and where no
GPU measured it (a build without one: its engines serve that CPU, which runs no W8A8 GEMM).
Knows: the torch model's linears, timing. Does not know: files, manifests.
"""
from __future__ import annotations

import statistics
import time

from backend.runtime import step_graph

FLOOR = step_graph.WIDTH_BUCKETS[-1] + 1          # the narrowest width W8A8 may run at
WIDTHS = (FLOOR, 64, 128, 256, 512, 1024, 2048)
MARGIN = 0.03                                      # W8A8 must be this much faster to be chosen
REPS = 5


def unmeasured(reason: str) -> dict:
    return {"w8a8_from": None, "reason": reason}


def threshold(rows: list[dict], margin: float = MARGIN) -> int | None:
    """The smallest measured width from which W8A8 is faster by `margin` at every larger width."""
    found = None
    for r in sorted(rows, key=lambda r: -r["width"]):
        if r["w8a8_ms"] >= (1 - margin) * r["w8a16_ms"]:
            break
        found = r["width"]
    return found


def milliseconds(fn, reps: int, device) -> float:
    """The median of `reps` timed calls of `fn` after one untimed (compiles, allocates): CUDA
    events on a GPU, the host clock elsewhere."""
    import torch

    cuda = getattr(device, "type", device) == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(model, max_width: int, reps: int = REPS, timer=milliseconds, widths=WIDTHS) -> dict:
    """{"w8a8_from": width or None, "measured": [{width, w8a8_ms, w8a16_ms}], ...} for `model`
    (runtime/torch_model.TorchModel) on its device; `timer(fn, reps, device)` -> ms."""
    import torch

    lins = [lin for lin in model.linears().values() if lin.hw]
    if not lins:
        return unmeasured("no linear of this engine runs the hardware W8A8 GEMM here (a weight-only "
                          "recipe, or this GPU's torch._scaled_mm does not run the recipe): W8A16 at every width")
    widths = [w for w in widths if FLOOR <= w <= max_width]
    if not widths:
        return unmeasured(f"max_seq_len {max_width} < {FLOOR}: every forward is decode-sized")
    device = lins[0].wq[0].device
    was = model.invariant
    model.invariant = True                       # W8A16 is the invariant mode's kernel
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    try:
        with torch.no_grad():
            for w in widths:
                xs = [torch.randn(w, lin.wq[0].shape[1], generator=g, device=device).to(model.dtype) for lin in lins]

                def run(wide: bool, xs=xs):
                    for lin, x in zip(lins, xs):
                        lin(x, wide=wide)
                rows.append({"width": w, "w8a8_ms": round(timer(lambda: run(True), reps, device), 4),
                             "w8a16_ms": round(timer(lambda: run(False), reps, device), 4)})
                del xs
    finally:
        model.invariant = was
    return {"w8a8_from": threshold(rows), "linears": len(lins), "margin": MARGIN, "reps": reps,
            "measured": rows}


def for_build(ck, tensors: dict, recipe, num_layers: int, max_seq_len: int, log, device=None) -> dict:
    """The build's measurement of its FP8 engine `tensors` on this machine's GPU (`device`: where
    to measure, default the GPU; None without one: not measured)."""
    import torch

    from backend.runtime.torch_model import TorchModel

    if device is None:
        if not torch.cuda.is_available():
            return unmeasured("built without a GPU: these engines serve this CPU, where no W8A8 GEMM runs")
        device = "cuda"
    t0 = time.time()
    model = TorchModel(ck.config, tensors, num_layers, torch.device(device), 8, fp8_recipe=recipe)
    r = measure(model, max_seq_len)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    r["seconds"] = round(time.time() - t0, 1)
    if "measured" in r:
        log(f"FP8 W8A8 vs W8A16 by width ({r['linears']} linears, {r['seconds']} s): " + ", ".join(
            f"{m['width']}: {m['w8a8_ms']:.3g} / {m['w8a16_ms']:.3g} ms" for m in r["measured"])
            + (f"; W8A8 from width {r['w8a8_from']}" if r["w8a8_from"] else "; W8A16 at every width"))
    else:
        log(f"FP8 W8A8 width: {r['reason']}")
    return r
