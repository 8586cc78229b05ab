"""What the step benchmarks read from a ``torch.profiler`` trace: collectives, per-op times, overlap.

Collectives are counted at the ``c10d::`` operator layer, which every caller goes through (distwgrad's
``_comm``, FSDP2's all-gather and reduce-scatter, DDP's bucket all-reduce), whatever the backend does
underneath (gloo implements a reduce-scatter as an all-reduce; its backend events would mislead).
Bytes per collective are the all-gather's output, the reduce-scatter's input and the all-reduce's tensor,
as ``launch/train.py``'s ``_comm_bytes`` counts them. A list-of-tensors all-reduce (DDP) records no shape
at the ``c10d::`` layer, so its size is read from the backend event it launches.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["COLLECTIVES", "comm_from_events", "op_table", "overlap_fraction", "idle_gaps", "idle_table",
           "KERNEL_KINDS", "kernel_kind", "kernel_kinds", "kinds_of_trace", "kinds_table"]

# c10d operator -> (kind, index of the input whose shape is the bytes moved)
COLLECTIVES = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::alltoall_base_": ("all_to_all", 0),
}
_BACKEND_PREFIXES = ("gloo:", "nccl:")
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
                "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "unsigned char": 1, "signed char": 1}


def _numel(shape: Any) -> int:
    if not isinstance(shape, (list, tuple)) or not shape or not all(isinstance(d, int) for d in shape):
        return 0
    n = 1
    for d in shape:
        n *= d
    return n


def _event_bytes(event: Any, index: int) -> int | None:
    shapes = getattr(event, "input_shapes", None) or []
    dtypes = getattr(event, "input_dtypes", None) or []
    if index >= len(shapes) or not _numel(shapes[index]):
        return None
    size = _DTYPE_BYTES.get(dtypes[index]) if index < len(dtypes) else None
    return None if size is None else _numel(shapes[index]) * size


def comm_from_events(events: Iterable[Any]) -> dict[str, Any]:
    """``{"collectives": n, "bytes": b, "by_kind": {kind: [n, b]}, "unsized": m}`` of one rank's events
    (``prof.events()``); ``unsized`` counts collectives whose size the trace did not record."""
    events = sorted(events, key=lambda e: e.time_range.start)
    ops = [e for e in events if e.name in COLLECTIVES]
    # Each c10d collective launches one backend event, in order; gloo records it on its worker thread
    # (not as a child), NCCL on the caller's: paired by position where the counts agree.
    backend = [e for e in events if e.name.startswith(_BACKEND_PREFIXES)]
    paired = backend if len(backend) == len(ops) else [None] * len(ops)
    by_kind: dict[str, list[int]] = {}
    unsized = 0
    for e, under in zip(ops, paired):
        kind, index = COLLECTIVES[e.name]
        nbytes = _event_bytes(e, index)
        if nbytes is None and under is not None:  # a list-of-tensors collective (DDP's bucket all-reduce)
            nbytes = _event_bytes(under, 0)
        if nbytes is None:
            unsized += 1
        entry = by_kind.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += nbytes or 0
    return {"collectives": sum(v[0] for v in by_kind.values()), "bytes": sum(v[1] for v in by_kind.values()),
            "by_kind": by_kind, "unsized": unsized}


def op_table(prof: Any, rows: int = 25) -> str:
    """The top operators by device time (CUDA) or host time (CPU), with both columns."""
    import torch

    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _hidden(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float | None:
    busy = _union(compute)
    total = hidden = 0.0
    for s, e in _union(comm):
        total += e - s
        hidden += sum(max(0.0, min(e, b1) - max(s, b0)) for b0, b1 in busy)
    return hidden / total if total else None


def overlap_fraction(events: Iterable[Any]) -> float | None:
    """Fraction of communication time that compute runs under, None without communication.

    CUDA: NCCL kernels on the device timeline against every other kernel. CPU (gloo): gloo's backend
    events, which gloo records on its worker threads, against the ``aten::`` operators of the threads
    that run no gloo event (the training thread). Time the training thread spends waiting, or in
    Python between operators, counts as exposed, so the CPU figure is a lower bound.
    """
    events = list(events)
    cuda = [e for e in events if str(getattr(e, "device_type", None)) == "DeviceType.CUDA"]
    if cuda:
        comm = [(e.time_range.start, e.time_range.end) for e in cuda if "nccl" in e.name.lower()]
        compute = [(e.time_range.start, e.time_range.end) for e in cuda if "nccl" not in e.name.lower()]
        return _hidden(comm, compute) if comm else None
    gloo = [e for e in events if e.name.startswith("gloo:")]
    workers = {e.thread for e in gloo}
    compute = [(e.time_range.start, e.time_range.end) for e in events
               if e.name.startswith("aten::") and e.thread not in workers]
    return _hidden([(e.time_range.start, e.time_range.end) for e in gloo], compute) if gloo else None


# [Note: idle device time]
# A step is device-bound where the device is always busy; it loses time wherever the device waits for the
# host. ``idle_gaps`` reads a chrome trace (``prof.export_chrome_trace``): the device's busy time is the
# union of its kernels, copies and memsets on every stream; a gap is the time between two busy intervals
# inside the window from the first to the last of them. Each gap is charged to what the host thread that
# launched the next kernel was doing meanwhile: the outermost operator (``cpu_op``, ``user_annotation``) of
# that thread overlapping the gap (time in none: "(python between ops)"), and to the innermost operator
# enclosing the launch itself (the op whose kernel the device waited for).

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATS = ("cpu_op", "user_annotation")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel; Triton launches with cuLaunchKernelEx


def _outermost(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The intervals that no other one contains (one host thread's top-level operators), by start."""
    out: list[tuple[float, float, str]] = []
    for s, e, name in sorted(intervals, key=lambda t: (t[0], -t[1])):
        if out and e <= out[-1][1]:
            continue
        out.append((s, e, name))
    return out


def idle_gaps(trace: dict[str, Any], min_us: float = 5.0) -> dict[str, Any]:
    """Where the device idled in a chrome trace (a dict, as ``json.load`` gives it): ``{"window_us",
    "busy_us", "idle_us", "gaps", "by_host_op": {name: us}, "by_launch_op": {name: us}}``, counting gaps of
    at least ``min_us``. See [Note: idle device time]."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in events
                    if e.get("cat") in _DEVICE_CATS)
    if not device:
        return {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": 0, "by_host_op": {}, "by_launch_op": {}}
    launches = {e.get("args", {}).get("correlation"): e for e in events if e.get("cat") in _LAUNCH_CATS}
    host: dict[Any, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("cat") in _HOST_CATS:
            host.setdefault(e.get("tid"), []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))
    top = {tid: _outermost(v) for tid, v in host.items()}
    by_host: dict[str, float] = {}
    by_launch: dict[str, float] = {}
    busy_us = idle_us = 0.0
    gaps = 0
    start0 = end = device[0][0]
    for s, e, ev in device:
        gap = s - end
        if gap >= min_us:
            gaps += 1
            idle_us += gap
            launch = launches.get(ev.get("args", {}).get("correlation"))
            tid = None if launch is None else launch.get("tid")
            covered = 0.0
            for hs, he, name in top.get(tid, []):
                part = min(he, s) - max(hs, end)
                if part > 0:
                    by_host[name] = by_host.get(name, 0.0) + part
                    covered += part
            if gap - covered > 0:
                by_host["(python between ops)"] = by_host.get("(python between ops)", 0.0) + gap - covered
            inner = "(no launch found)"
            if launch is not None:
                t = float(launch["ts"])
                enclosing = [(he - hs, name) for hs, he, name in host.get(tid, []) if hs <= t <= he]
                inner = min(enclosing)[1] if enclosing else "(python between ops)"
            by_launch[inner] = by_launch.get(inner, 0.0) + gap
        if e > end:
            busy_us += e - max(s, end)
            end = e
    return {"window_us": end - start0, "busy_us": busy_us, "idle_us": idle_us, "gaps": gaps,
            "by_host_op": by_host, "by_launch_op": by_launch}


def idle_table(gaps: dict[str, Any], rows: int = 12) -> str:
    """``idle_gaps``'s result as text: totals, then the largest shares by host op and by launching op."""
    lines = [f"device window {gaps['window_us'] / 1e3:.2f} ms: busy {gaps['busy_us'] / 1e3:.2f} ms, idle "
             f"{gaps['idle_us'] / 1e3:.2f} ms in {gaps['gaps']} gaps"]
    for title, key in (("host thread was in (outermost op)", "by_host_op"),
                       ("the kernel after the gap was launched by", "by_launch_op")):
        lines.append(f"  idle ms, {title}:")
        for name, us in sorted(gaps[key].items(), key=lambda kv: -kv[1])[:rows]:
            lines.append(f"    {us / 1e3:8.3f}  {name[:90]}")
    return "\n".join(lines)



# [Note: kernel time by kind]
# What an FP8 step adds, and what bounds it, is read from its kernel time by kind: the GEMMs (cuBLAS's, the
# grouped and FP8 kernels, torch's grouped_mm and inductor's templates), the FP8 quantization passes (amax,
# casts, transposes, block scales), the optimizer (torch's multi-tensor kernels: fused or foreach AdamW),
# attention (cuDNN and flash kernels) and the rest. A kernel's kind is the first whose name patterns its name
# contains (lowercased); a kernel of another library is "other", and so is a torch kernel that a quantization
# calls (a weight's amax taken by a torch reduction: its name is generic). The sums count each kernel's whole
# duration (kernels on two streams overlap: the sum can exceed the busy time ``idle_gaps`` gives). A step whose
# device never idles takes its kernel time, so its time with a kind gone is bounded below by the sum less
# that kind.
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "ragged", "wgrad_kernel", "triton_tem_")),
    ("quantize", ("amax", "_cast_", "quantize", "rowcol", "transpose_aligned", "cast_transpose")),
    ("optimizer", ("multi_tensor_apply",)),
    ("attention", ("sdpa", "flash", "fmha", "cudnn")),
)


def kernel_kind(name: str) -> str:
    """The kind of a kernel by its name ([Note: kernel time by kind]): gemm, quantize, optimizer, attention or
    other."""
    low = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def kernel_kinds(kernels: Iterable[tuple[str, float]], steps: int = 1) -> dict[str, float]:
    """Milliseconds a step by kind from ``(name, duration in us)`` pairs over ``steps`` steps, and ``total``."""
    if steps < 1:
        raise ValueError(f"kernel_kinds: steps must be positive, got {steps!r}")
    ms = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, us in kernels:
        ms[kernel_kind(name)] += us / 1e3 / steps
    ms["total"] = sum(ms.values())
    return ms


def kinds_of_trace(trace: dict[str, Any], steps: int = 1) -> dict[str, float]:
    """``kernel_kinds`` of a chrome trace's device events (kernels, copies and memsets)."""
    return kernel_kinds(((e.get("name", ""), float(e["dur"])) for e in trace.get("traceEvents", [])
                         if e.get("ph") == "X" and "dur" in e and e.get("cat") in _DEVICE_CATS), steps)


def kinds_table(ms: dict[str, float]) -> str:
    """``kernel_kinds``' result as one line: each kind's ms a step and share, and the kernel time without the
    quantization passes."""
    total = ms["total"] or 1.0
    parts = [f"{k} {ms[k]:.2f} ({ms[k] / total:.0%})" for k in ms if k != "total"]
    return (f"kernel time a step {ms['total']:.2f} ms: " + ", ".join(parts)
            + f"; without the quantization passes {ms['total'] - ms['quantize']:.2f} ms")
