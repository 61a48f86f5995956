"""The timing steps of the GPU check (benchmarks/gpu_check.py runs them; the correctness steps
are benchmarks/gpu_steps.py), on random weights of real shapes. Every timed step reports, beside
its milliseconds: the bytes it must read (every weight it streams, in the format the runtime
holds it, plus the KV cache read: each row's committed context and its tree), the GB/s that
makes, and the fraction of this device's copy bandwidth (`bandwidth`: a device-to-device copy
measured in the same run, read + write bytes); the launches of one step (torch profiler:
device kernels and host launch calls; on a CPU there are none to count: null and why); and
`floor_ms`, the step's time at the measured bandwidth (the roofline line of the summary); and
`by_name`, the launches of one step by kernel name (benchmarks/gpu_count.py: the Python-side
launches, a captured graph's replay counted as one `graph_replay`).
The runtime is the GPU's (gpu_steps.runtime): the dry run times the same code on the CPU with
small shapes, the kernels in Triton's interpreter (values not judged).
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from gpu_steps import Plan, chain, prefill, prompt_ids, random_tensors, runtime
from backend.runtime import fp8

HOST_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bandwidth(plan: Plan) -> dict:
    """This device's copy bandwidth: a `plan.copy_mib` MiB tensor copied to another on the same
    device, the median of 5 after a warm-up; GB/s counts the bytes read and written."""
    n = plan.copy_mib << 20
    src = torch.ones(n, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    times = []
    for i in range(6):
        sync(plan.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(plan.device)
        if i:
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    del src, dst
    return {"GB_per_s": round(2 * n / s / 1e9, 1), "copy_MiB": plan.copy_mib, "ms": round(1000 * s, 3),
            "how": "device-to-device copy, read + write bytes"}


def weight_bytes(rt) -> int:
    """The bytes a forward streams for weights: each linear as the runtime holds it (the
    hardware FP8 GEMM's codes and scales; W8A16's codes and scales where the kernel reads them;
    else the compute-dtype weights), the LM head and the norms; the embedding's gathered rows
    are left out (a few rows)."""
    m = rt.model
    total = m.lm_head.nbytes + (m.norm.nbytes if m.norm is not None else 0)
    for lin in m.linears().values():
        if lin.wq is not None and lin.kernel:     # W8A16 (decode and verify widths, hardware recipes too)
            total += lin.wq[0].nbytes + lin.wq[1].nbytes
        elif lin.hw:
            total += lin.w8.nbytes + lin.w_scale.nbytes
        elif lin._w is not None:
            total += lin._w.nbytes
        else:                                # weight-only FP8 not yet dequantized: its bf16 size
            total += lin.wq[0].numel() * torch.finfo(m.dtype).bits // 8
    for layer in m.layers:
        total += sum(n.nbytes for n in (layer.attn_norm, layer.mlp_norm) if n is not None)
    return int(total)


def kv_bytes(rt, b: int, t: int, context: int) -> int:
    """The KV cache a forward reads at least: every layer's keys and values of each row's
    committed context and its t tree nodes."""
    cfg = rt.config
    per_column = rt.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * rt.cache.element_size()
    return int(per_column * b * (context + t))


def speed(seconds: float, nbytes: int, bw: dict | None) -> dict:
    """ms, bytes, GB/s, the fraction of the copy bandwidth and the roofline floor of one step."""
    row = {"ms": round(1000 * seconds, 4), "bytes": nbytes, "GB_per_s": round(nbytes / seconds / 1e9, 2)}
    if bw:
        row.update(of_bandwidth=round(row["GB_per_s"] / bw["GB_per_s"], 4),
                   floor_ms=round(1000 * nbytes / (bw["GB_per_s"] * 1e9), 4))
    return row


def launches(step, device: str) -> dict:
    """Run `step` once under the torch profiler and gpu_count.Count: its device kernels (copies
    apart), the host's launch calls, and the launches by name; on a CPU the device counts are
    null with the reason (the torch ops the profiler saw, for the record)."""
    from torch.profiler import ProfilerActivity, profile

    from gpu_count import Count

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof, Count() as count:
        step()
        sync(device)
    ev = prof.events()
    by_name = dict(sorted(count.counts.items()))
    if device != "cuda":
        ops = sum(1 for e in ev if e.cpu_parent is None and e.name.startswith("aten::"))
        return {"kernels": None, "by_name": by_name,
                "why": f"a CPU launches no device kernels (the profiler saw {ops} top-level torch ops)"}
    dev = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(1 for e in dev if e.name.startswith(("Memcpy", "Memset")))
    return {"kernels": len(dev) - copies, "copies": copies,
            "host_launch_calls": sum(1 for e in ev if e.name in HOST_LAUNCHES), "by_name": by_name}


def _step(rt, b: int, t: int, first_id: int, rng):
    sids = list(range(first_id, first_id + b))
    parents = np.broadcast_to(chain(t), (b, t)).copy()
    index = np.broadcast_to(np.arange(t), (b, t)).copy()

    def step():
        rt.forward(sids, rng.integers(3, rt.config.vocab_size, (b, t)), parents, index)
        rt.commit(sids, [np.zeros(0, np.int64)] * b)     # nothing kept: the context stays
    return step


def time_forward(rt, device: str, b: int, t: int, reps: int, first_id: int, warmup: int = 2) -> float:
    """The median seconds of a forward of b rows x t nodes (`warmup` untimed steps first)."""
    step = _step(rt, b, t, first_id, np.random.default_rng(t))
    times = []
    for i in range(reps + warmup):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rt, plan: Plan, b: int, t: int, reps: int, first_id: int, bw: dict | None, count: bool) -> dict:
    """One (b, t) point: time_forward's seconds as `speed`, and its launches where `count`."""
    s = time_forward(rt, plan.device, b, t, reps, first_id, plan.warmup)
    row = speed(s, weight_bytes(rt) + kv_bytes(rt, b, t, plan.context), bw)
    if count:
        row["launches"] = launches(_step(rt, b, t, first_id, np.random.default_rng(0)), plan.device)
    return row


def cost_curve(plan: Plan, name: str, fmt: str = "bf16", batches=None, recipe=None, bw=None, log=print) -> dict:
    """cost(T) / cost(1) at each batch, CUDA graphs on, context plan.context; each point's
    `speed`, the launches of T = 1 and T = 16."""
    cfg = plan.shapes[name]
    rt = runtime(cfg, random_tensors(cfg, fmt, plan.device, recipe), plan.device, recipe=recipe)
    out, first = {}, 0
    for b in batches or plan.batches:
        prefill(rt, list(range(first, first + b)), prompt_ids(cfg, plan.context, b))
        rows = {t: measure(rt, plan, b, t, plan.reps, first, bw, t in (1, 16)) for t in plan.widths}
        out[f"b{b}"] = {"ratio": {str(t): round(r["ms"] / rows[1]["ms"], 3) for t, r in rows.items()},
                        "by_width": {str(t): r for t, r in rows.items()}}
        log(f"{name} {fmt} B={b}: " + " ".join(f"T{t}={out[f'b{b}']['ratio'][str(t)]}" for t in plan.widths))
        for s in range(first, first + b):
            rt.free(s)
        first += b
    rt.close()
    return out


def decode_speed(plan: Plan, fmt: str, recipe: fp8.Recipe | None = None, invariant: bool = True,
                 bw=None, log=print, w8a8_max: int | None = None) -> dict:
    """Plain decode (batch 1 and 8; the dry run's 1 and 2) on the 8B shape: tokens/s and each batch's `speed`; FP8 by
    `recipe`, with whether torch._scaled_mm runs it here (else emulated). invariant False: the
    linears by torch (cuBLAS on a GPU), the row beside the Triton linear (the GPU's default).
    `w8a8_max`: also the build's W8A8-vs-W8A16 measurement by width up to it
    (devices/cuda/w8a8.py: what sets an FP8 engine's w8a8_from), where the recipe runs in hardware."""
    from backend.devices.cuda import w8a8

    cfg = plan.shapes["llama3-8b"]
    rt = runtime(cfg, random_tensors(cfg, fmt, plan.device, recipe), plan.device, slots=9, recipe=recipe,
                 invariant=invariant)
    out = {"hardware_fp8": rt.model.hw_fp8, "triton_linear": rt.model.invariant}
    if w8a8_max is not None and recipe is not None:
        out["w8a8_width"] = w8a8.measure(rt.model, w8a8_max, reps=max(1, plan.reps // 3))
        log(f"8B-shape W8A8 vs W8A16 by width ({recipe.label}): {out['w8a8_width']}")
    for b in plan.batches[:2]:
        prefill(rt, list(range(b)), prompt_ids(cfg, plan.context, b))
        row = measure(rt, plan, b, 1, plan.decode_reps, 0, bw, True)
        out[f"b{b}_tokens_per_s"] = round(1000 * b / row["ms"], 1)
        out[f"b{b}"] = row
        for i in range(b):
            rt.free(i)
    rt.close()
    del rt
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    log(f"8B-shape decode {recipe.label if recipe else fmt}{'' if out['triton_linear'] else ' (torch linears)'}: "
        f"b1 {out['b1_tokens_per_s']} tok/s ({out['b1'].get('of_bandwidth', '-')} of bandwidth), "
        f"b{plan.batches[1]} {out[f'b{plan.batches[1]}_tokens_per_s']} tok/s")
    return out


def roofline(label: str, row: dict) -> dict:
    """A roofline line: what the step took, what it would take at the measured bandwidth."""
    line = {"step": label, "ms": row["ms"], "floor_ms": row.get("floor_ms"), "of_bandwidth": row.get("of_bandwidth"),
            "GB_per_s": row["GB_per_s"], "bytes": row["bytes"]}
    k = (row.get("launches") or {}).get("kernels")
    if k is not None:
        line["kernels"] = k
    return line
