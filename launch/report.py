"""The training job's outputs: ``report.json`` (per-step history, summary) and ``loss.png``.

[Note: resumed history]
A run resumed into the ``--out`` of the run it continues keeps that run's history: the earlier
``report.json`` is read, its steps up to the resume step are kept (later ones were trained by the run
being replaced and are dropped), and the new steps follow, so the report and the plot cover the whole
run. ``segments`` lists each process's part (steps, world size, where it resumed from, wall time). An
earlier report of another model is not merged (a warning says so). The summary's rates and memory are
this process's; its losses cover the whole history.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import resource
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PER_STEP", "device_name", "triton_version", "measure_peak_flops", "peak_memory", "earlier_history",
           "summary", "plot"]

log = logging.getLogger("distwgrad.train")

# Per-step lists of report.json, in the order of ``steps``.
PER_STEP = ("steps", "loss", "step_time_s", "tokens_per_s", "bytes_all_gathered_per_step",
            "bytes_reduce_scattered_per_step")
_PEAK_N, _PEAK_ITERS = 8192, 20  # one 8192^3 bf16 GEMM is 1.1 TFLOP: 20 take ~30 ms on an H200


def device_name(device: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or ``cpu``: what ran, readable where it did not."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def triton_version() -> str | None:
    """Triton's installed version, or None where it is not installed (read from its package metadata: the
    job does not import Triton, an optional dependency)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def measure_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 matmul FLOP/s measured on ``device`` (the best of three timed rounds of
    ``_PEAK_ITERS`` GEMMs of ``_PEAK_N``-square operands); None on CPU."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(_PEAK_N, _PEAK_N, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b  # warm-up: cuBLAS picks its kernel
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(_PEAK_ITERS):
            a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)  # the job's peak memory leaves this out
    return 2 * _PEAK_N**3 * _PEAK_ITERS / best


def peak_memory(device: torch.device, group: Any, world_size: int, *, rank: int | None = None) -> dict[str, Any]:
    """This process's peak memory, gathered over ``group``; with ``rank`` (an interrupted run, whose group
    is broken) no collective runs and the other ranks' entries are None."""
    if device.type == "cuda":
        mine, source = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:  # Linux reports ru_maxrss in KiB
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        source = "resource.getrusage(RUSAGE_SELF).ru_maxrss (process RSS high-water mark, whole process)"
    per_rank: list[Any] = [None] * world_size
    if rank is None:
        dist.all_gather_object(per_rank, mine, group=group)
    else:
        per_rank[rank] = mine
    return {"source": source, "bytes_per_rank": per_rank, "max_bytes": max(m for m in per_rank if m is not None)}


def earlier_history(out: str, start: int, model_config: dict[str, Any]) -> dict[str, Any]:
    """The per-step lists and segments of ``OUT/report.json`` up to step ``start`` ([Note: resumed
    history]); empty lists when there is none or it is another model's."""
    empty: dict[str, Any] = {k: [] for k in (*PER_STEP, "segments")}
    path = os.path.join(out, "report.json")
    if not os.path.isfile(path):
        return empty
    with open(path) as f:
        old = json.load(f)
    theirs = {k: old.get("config", {}).get(k) for k in model_config}
    if theirs != model_config:
        log.warning("%s is another model's report (%s); its history is not kept", path,
                    {k: (v, model_config[k]) for k, v in theirs.items() if v != model_config[k]})
        return empty
    keep = [i for i, s in enumerate(old.get("steps", [])) if s <= start]
    kept = {k: [old[k][i] for i in keep] if k in old else [None] * len(keep) for k in PER_STEP}
    for k in ("val_steps", "val_loss", "logged"):  # the caller keeps those of steps up to ``start``
        kept[k] = old.get(k, [])
    kept["segments"] = [s for s in old.get("segments", []) if s["first_step"] <= start]
    for seg in kept["segments"]:
        seg["last_step"] = min(seg["last_step"], start)
    return kept


def summary(report: dict[str, Any], *, params: int, flops_per_token: int, peak_flops: list[float | None],
            wall_time_s: float) -> dict[str, Any]:
    """Final and best loss over the whole history; tokens/s, MFU and memory of this process's steps."""
    losses, steps = report["loss"], report["steps"]
    best = min(range(len(losses)), key=losses.__getitem__) if losses else None
    rate = report["tokens_per_s_mean"]
    peak = None if None in peak_flops else sum(peak_flops) / len(peak_flops)  # per device, mean over ranks
    model_flops = flops_per_token * rate if rate else None
    mfu = model_flops / (peak * len(peak_flops)) if peak and model_flops else None
    return {
        "final_loss": losses[-1] if losses else None, "best_loss": losses[best] if losses else None,
        "best_step": steps[best] if losses else None, "tokens_per_s": rate,
        "params": params, "flops_per_token": flops_per_token,
        "flops_note": "6 * active parameters (attention, router, top_k experts, lm_head) + 6 * L * S * D "
                      "(causal attention scores and values), forward and backward",
        "model_flops_per_s": model_flops, "peak_flops_per_s_per_device": peak,
        "peak_flops_source": None if peak is None else
        f"measured at start: {_PEAK_ITERS} bf16 matmuls of {_PEAK_N}x{_PEAK_N}, best of 3, mean over ranks",
        "mfu": mfu, "mfu_note": "model FLOP/s over world size x the measured dense bf16 peak; null on CPU",
        "peak_memory_bytes_per_rank": report["peak_memory"]["bytes_per_rank"],
        "peak_memory_source": report["peak_memory"]["source"], "wall_time_s": wall_time_s,
    }


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    cfg = report["config"]
    ax.plot(report["steps"], report["loss"],
            label=f"sharded, {report['precision']}, recipe {cfg['recipe']}, {len(report['segments'])} segment(s)")
    for seg in report["segments"][1:]:
        ax.axvline(seg["first_step"] - 0.5, color="grey", lw=0.6, ls="--")
    if report.get("val_steps"):
        ax.plot(report["val_steps"], report["val_loss"], "o-", ms=3, lw=1, label="validation")
    if report["parity"]:
        ax.plot(report["parity"]["free_running_steps"], report["parity"]["free_running_loss"], "--", lw=1,
                label="unsharded plain-torch reference, free-running")
    if report["corpus"]["entropy_floor"] is not None:
        ax.axhline(report["corpus"]["entropy_floor"], color="grey", lw=0.8, ls=":", label="corpus entropy")
    data = "the Markov corpus" if report["corpus"]["kind"] == "markov" else os.path.basename(cfg["data"])
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"MoE GPT ({cfg['model']} sizes) on {data}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
