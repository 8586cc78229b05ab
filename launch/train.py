"""Train an MoE GPT whose every weight is a ShardedWeight: tied embedding, deferred expert wgrads.

Commands::

    # CPU, 2 ranks over gloo, all defaults (a synthetic corpus generated in-process; no downloads)
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train
    # one process, no torchrun
    python -m distwgrad.launch.train --steps 50
    # on a folder prepare_data wrote from text (python -m distwgrad.launch.prepare_data corpus.txt --out
    # data/corpus), the validation loss every 10 steps, TensorBoard scalars (pip install 'distwgrad[tensorboard]')
    torchrun --nproc-per-node 2 -m distwgrad.launch.train --data data/corpus --eval-every 10 --tensorboard tb
    # bf16 compute on fp32 masters (the default on CUDA), a bigger preset (--model small; large on GPUs)
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --precision bf16 --model small
    # also train an unsharded single-process copy and compare (exit code 1 if they disagree)
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --check-parity
    # checkpoint every 50 of 100 steps, then resume the newest on 4 ranks (resharded) to step 200, into
    # the same folder: report.json and loss.png then cover all 200 steps
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --steps 100 --save-every 50 --out runs/a
    torchrun --standalone --nproc-per-node 4 -m distwgrad.launch.train --steps 200 \
        --resume runs/a/checkpoints --out runs/a
    # give up on a rank that hangs after 60 s (exit code 3), keeping only the 2 newest checkpoints
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --timeout 60 --save-every 50 --keep-last 2
    # every option
    python -m distwgrad.launch.train --help

The trained weights leave through ``launch.export`` and generate text through ``launch.sample``. A step runs
``--microbatches`` passes, draining the experts' deferred wgrads after each, then ``finalize_model_grads`` and
AdamW; ``--cuda-graph`` replays the blocks ([Note: the graphed step]). Rank 0 alone logs and writes
``OUT/report.json`` and ``loss.png``. Exit codes: 0 done; 1 parity failed; 2 bad options, data, resume, out
or memory; 3 a rank died or hung, or SIGTERM ([Note: lost rank]). docs/training.md has the details.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import distwgrad
from distwgrad.checkpoint import CheckpointError, interrupted_saves, load_checkpoint, save_checkpoint
from distwgrad.data import DataError, MarkovCorpus, TokenFile
from distwgrad.models import MoEGPT

from . import cuda_graph as _graph
from . import faults as _faults
from . import metrics as _metrics
from . import report as _out
from .config import TrainConfig, parse_args
from .parity import PARITY_BF16, PARITY_LOSS_ATOL, Lockstep, parity_result  # noqa: F401  (tests read them here)
from .step import (
    RECIPE_CONTEXTS,
    comm_bytes,
    compile_blocks,
    forward_backward,
    keeps_fp8_weights,
    optimizer_for,
    optimizer_step,
)
from .step import RECIPE_CONTEXTS as _RECIPES  # noqa: F401  (tests read it here)

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = ["main", "forward_backward", "compile_blocks"]

log = logging.getLogger("distwgrad.train")

@dataclass
class _Runtime:
    rank: int
    world_size: int
    device: torch.device
    backend: str
    group: Any
    param_dtype: torch.dtype | None  # None: fp32
    monitor: Any = None  # a gloo group of all ranks for the fault probes only ([Note: lost rank])
    rank0_wait: Any = None  # --check-parity: the others' gloo group while rank 0 runs its reference step
    started: float = field(default_factory=time.perf_counter)

    @property
    def precision(self) -> str:
        return "fp32" if self.param_dtype is None else "bf16"


_HIST = ("steps", "loss", "step_time_s", "tokens_per_s", "bytes_all_gathered", "bytes_reduce_scattered",
         "checkpoints", "val_steps", "val_loss", "logged")


@dataclass
class _Progress:
    """How far the run got, kept outside the loop so an interrupted run can report it ([Note: lost rank])."""
    start: int = 0
    step: int = 0  # the step being trained or saved
    hist: dict[str, list] = field(default_factory=lambda: {k: [] for k in _HIST})
    corpus: Any = None
    peak: list = field(default_factory=list)
    graphed: dict | None = None  # what --cuda-graph captured (report.json's cuda_graph)
    val: Any = None  # the validation data (--eval-every)
    board: Any = None  # TensorBoard's writer on rank 0 (--tensorboard)
    pipeline: Any = None  # --pp: this rank's stage modules
    parallelism: dict | None = None  # report.json's parallelism


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


# --- set-up ----------------------------------------------------------------------------------------------

def _pick_device(config: TrainConfig) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _init(config: TrainConfig) -> _Runtime:
    device = _pick_device(config)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if config.cuda_graph:
        _graph.check_device(device, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=config.timeout)  # every collective ([Note: lost rank])
    if backend == "nccl":
        _faults.nccl_env(config.timeout)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python -m ...`: a group of one, so every code path is the same
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, handlers=[_TqdmHandler()],
                        format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S", force=True)
    torch.manual_seed(config.seed)
    bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
    monitor, rank0_wait = _faults.monitor_groups(config.timeout, rank0_works=config.check_parity)
    _faults.publish_pid()
    return _Runtime(rank, world_size, device, backend, dist.group.WORLD, torch.bfloat16 if bf16 else None,
                    monitor, rank0_wait)


# --- the loop --------------------------------------------------------------------------------------------

# [Note: garbage collection in training]
# The automatic collector runs wherever in a step allocations cross its threshold, and its full collections
# walk every object of the process. So, as torchtitan does (``gc_freq``), training switches it off and runs a
# generation-1 collection every ``--gc-every`` steps after the optimizer; ``--gc-every 0`` leaves it on.

@contextlib.contextmanager
def _collector(every: int):
    """Automatic garbage collection off while training if ``every`` ([Note: garbage collection in training])."""
    was = gc.isenabled()
    if every:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _train(config: TrainConfig, rt: _Runtime, model, optimizer, corpus: MarkovCorpus | TokenFile, start: int,
           lockstep: Lockstep | None, progress: _Progress, pipe: Pipeline | None = None) -> dict[str, list]:
    hist = progress.hist
    tokens_per_step = config.global_batch * config.seq_len
    bar = tqdm(total=config.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr,
               disable=rt.rank != 0 or not config.progress or not sys.stderr.isatty())  # a log file: lines only
    amax_modules = _graph.eager_modules(model) if config.cuda_graph else None
    for step in range(start + 1, config.steps + 1):
        progress.step = step
        dp_rank, dp_size = (pipe.dp_rank, pipe.dp_size) if pipe else (rt.rank, rt.world_size)
        local_BS = corpus.local_batch(step, config.global_batch, dp_rank, dp_size)
        if lockstep:
            lockstep.sync(model)
        gathered0, reduced0 = comm_bytes(model)
        t0 = time.perf_counter()
        if pipe:  # the last stage holds the loss, the other stages add zeros below
            loss = pipe.forward_backward(local_BS.to(rt.device))
            pipe.finalize()
        else:
            loss = forward_backward(model, local_BS.to(rt.device), config.microbatches, config.recipe, amax_modules,
                                    keep_fp8_weights=config.fp8_weight_cache)
            distwgrad.finalize_model_grads([model])
        dist.all_reduce(loss, group=rt.group)
        loss = loss.item() / dp_size  # .item() synchronises, so the step time is real
        dt = time.perf_counter() - t0
        logged = bool(config.log_every) and (step % config.log_every == 0 or step == config.steps)
        norm = (_metrics.grad_norm(model, rt.group, skip=[pipe.tied_copy] if pipe else (), copies=dp_size)
                if logged else None)  # before the optimizer frees .grad
        if lockstep:
            lockstep.check(model, corpus.global_batch(step, config.global_batch), loss, step)
            _faults.wait_for_rank0(rt.rank0_wait, config.timeout)  # rank 0 alone ran the reference step
        t0 = time.perf_counter()
        optimizer_step(optimizer, config.lr_at(step))
        if config.gc_every and step % config.gc_every == 0:
            gc.collect(1)  # [Note: garbage collection in training]
        dt += time.perf_counter() - t0
        gathered, reduced = comm_bytes(model)
        for key, value in (("steps", step), ("loss", loss), ("step_time_s", dt),
                           ("tokens_per_s", tokens_per_step / dt), ("bytes_all_gathered", gathered - gathered0),
                           ("bytes_reduce_scattered", reduced - reduced0)):
            hist[key].append(value)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        val = _evaluate(config, rt, model, progress, step)
        if logged:
            _log_step(config, rt, progress, step, loss, val, norm, tokens_per_step / dt)
        if config.save_every and (step % config.save_every == 0 or step == config.steps):
            hist["checkpoints"].append(_save(config, rt, step, model, optimizer, corpus))
    bar.close()
    return hist


def _parallelism(config: TrainConfig, rt: _Runtime, pipe: Pipeline | None, model, steps: int) -> dict[str, Any]:
    """report.json's parallelism: the mesh, --pp's stage times, --ep's all-to-all bytes and waits. A collective."""
    out: dict[str, Any] = {"pp": config.pp, "dp": rt.world_size // config.pp}
    if config.ep > 1:
        ep = model.blocks[0].moe.ep
        mine = (ep.bytes_sent / max(steps, 1), ep.exposed_s / max(steps, 1))
        ranks: list[Any] = [None] * rt.world_size
        dist.all_gather_object(ranks, mine, group=rt.group)
        out.update(ep=config.ep, dp=rt.world_size // config.ep, all_to_all={
            "bytes_per_step": [b for b, _ in ranks], "exposed_s_per_step": [t for _, t in ranks],
            "note": "per rank, every step of this run (the first pays warm-up): payload and counts sent, forward "
                    "and backward; seconds waited on the exchanges after the overlapped expert wgrads"})
    if pipe is None:
        return out
    times: list[Any] = [None] * rt.world_size
    dist.all_gather_object(times, pipe.stage_times(), group=rt.group)
    stages = {str(k): v for per_rank in times for k, v in sorted(per_rank.items())}
    return {**out, "schedule": config.pp_schedule, "microbatches": config.step_microbatches,
            "stage_times_ms": dict(sorted(stages.items(), key=lambda kv: int(kv[0])))}


def _evaluate(config: TrainConfig, rt: _Runtime, model, progress: _Progress, step: int) -> float | None:
    """The validation loss after ``step``'s update when ``--eval-every`` says so (launch/metrics.py)."""
    if not config.eval_every or (step % config.eval_every and step != config.steps):
        return None
    val = _metrics.evaluate(model, progress.val, config.eval_batches, config.global_batch, rt.rank, rt.world_size,
                            rt.group, rt.device, RECIPE_CONTEXTS[config.recipe])
    progress.hist["val_steps"].append(step)
    progress.hist["val_loss"].append(val)
    if not config.log_every or (step % config.log_every and step != config.steps):
        log.info("step %d/%d  val loss %.4f", step, config.steps, val)
    return val


def _log_step(config: TrainConfig, rt: _Runtime, progress: _Progress, step: int, loss: float, val: float | None,
              norm: float | None, tokens_per_s: float) -> None:
    """A logged step: one line, the report's ``logged`` entry, TensorBoard's scalars."""
    peak = progress.peak
    flops = config.model_config().flops_per_token() * tokens_per_s
    mfu = flops / (sum(peak) / len(peak) * len(peak)) if peak and None not in peak else None
    entry = {"step": step, "loss": loss, "val_loss": val, "lr": config.lr_at(step), "grad_norm": norm,
             "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_memory_gib": _metrics.peak_memory_gib(rt.device)}
    progress.hist["logged"].append(entry)
    log.info("step %d/%d  loss %.4f%s  grad norm %.3g  lr %.3g  %.0f tokens/s", step, config.steps, loss,
             "" if val is None else f"  val loss {val:.4f}", norm, entry["lr"], tokens_per_s)
    progress.board.scalars(step, {"train/loss": loss, "val/loss": val, "train/lr": entry["lr"],
                                  "train/grad_norm": norm, "perf/tokens_per_s": tokens_per_s, "perf/mfu": mfu,
                                  "perf/peak_memory_gib": entry["peak_memory_gib"]})


def _model_meta(config: TrainConfig) -> dict[str, Any]:
    return {"model_config": config.model_config().architecture()}


def _save(config: TrainConfig, rt: _Runtime, step: int, model, optimizer, corpus) -> str:
    """A checkpoint; its meta.json also names the data (``export`` carries the tokenizer out with the weights)."""
    path = save_checkpoint(os.path.join(config.out, "checkpoints"), step, model, optimizer, group=rt.group,
                           meta={**_model_meta(config), "data": corpus.describe()}, keep_last=config.keep_last)
    log.info("saved %s", path)
    return path


# --- report ----------------------------------------------------------------------------------------------

def _report(config: TrainConfig, rt: _Runtime, progress: _Progress, parity: dict | None, memory: dict[str, Any],
            interrupted: dict[str, Any] | None = None) -> dict[str, Any]:
    """report.json: this run's steps after the earlier ones kept from ``--out`` ([Note: resumed history]);
    ``interrupted`` says where a run that lost a rank stopped ([Note: lost rank] in launch/faults.py)."""
    hist, start, corpus = progress.hist, progress.start, progress.corpus
    last = config.steps if interrupted is None else interrupted["last_step_done"]
    rates = hist["tokens_per_s"][1:] or hist["tokens_per_s"]  # the first step pays warm-up
    wall = time.perf_counter() - rt.started
    mc = config.model_config()
    earlier = _out.earlier_history(config.out, start, mc.architecture()) if config.resume else {}
    ours = dict(zip(_out.PER_STEP, (hist[k] for k in ("steps", "loss", "step_time_s", "tokens_per_s",
                                                       "bytes_all_gathered", "bytes_reduce_scattered"))))
    segment = {"first_step": start + 1, "last_step": last, "world_size": rt.world_size,
               "resumed_from": config.resume, "wall_time_s": wall}
    report = {
        "config": config.to_dict(), "world_size": rt.world_size, "device": str(rt.device),
        "device_name": _out.device_name(rt.device), "backend": rt.backend, "torch": torch.__version__,
        "triton": _out.triton_version(), "precision": rt.precision, "start_step": start,
        **{k: earlier.get(k, []) + ours[k] for k in _out.PER_STEP},
        "tokens_per_s_mean": sum(rates) / len(rates) if rates else None,
        "comm_bytes_note": "per rank, summed over distinct weights: all-gather output and reduce-scatter "
                           "input sizes (shards padded to equal size); the same on every rank",
        "peak_memory": memory,
        "wall_time_s": wall, "segments": earlier.get("segments", []) + [segment],
        "corpus": corpus.describe(), "checkpoints": hist["checkpoints"], "resumed_from": config.resume,
        "parity": parity, "interrupted": interrupted, "cuda_graph": progress.graphed,
        "parallelism": progress.parallelism,
        **{k: [v for s, v in zip(earlier.get("val_steps", []), earlier.get(k, [])) if s <= start] + hist[k]
           for k in ("val_steps", "val_loss")},
        "logged": [e for e in earlier.get("logged", []) if e["step"] <= start] + hist["logged"],
    }
    report["summary"] = _out.summary(report, params=mc.num_params(), flops_per_token=mc.flops_per_token(),
                                     peak_flops=progress.peak, wall_time_s=wall)
    report["summary"]["interrupted"] = interrupted
    return report


# --- main ------------------------------------------------------------------------------------------------

def _data(config: TrainConfig) -> MarkovCorpus | TokenFile:
    if config.data:
        return TokenFile(config.data, config.vocab_size, config.seq_len, config.seed)
    return MarkovCorpus(config.vocab_size, config.seq_len, config.seed)


def _resume(config: TrainConfig, rt: _Runtime, model, optimizer) -> int:
    for skipped in interrupted_saves(config.resume):
        log.warning("skipping %s: an interrupted save (no completion marker), never resumed from", skipped)
    start = load_checkpoint(config.resume, model, optimizer, group=rt.group, expect=_model_meta(config))
    if start >= config.steps:
        raise CheckpointError(f"--resume {config.resume!r} is at step {start}, at or past --steps "
                              f"{config.steps}: nothing to train (pass --steps greater than {start})")
    log.info("resumed from %s at step %d", config.resume, start)
    return start


def _run(config: TrainConfig, rt: _Runtime, progress: _Progress) -> int:
    corpus = progress.corpus = _data(config)  # DataError on every rank alike, before any collective
    if config.eval_every:
        progress.val = corpus.validation()
        _metrics.eval_rows(progress.val, config.global_batch, rt.world_size)  # enough windows, or DataError now
    mc = config.model_config()
    log.info("MoEGPT %s: %s parameters (%s active per token), %d layers, d_model %d, %d experts top-%d; "
             "%d rank(s) on %s (%s), %s%s", config.model, f"{mc.num_params():,}",
             f"{(mc.flops_per_token() - 6 * mc.n_layers * mc.seq_len * mc.d_model) // 6:,}", mc.n_layers,
             mc.d_model, mc.n_experts, mc.top_k, rt.world_size, rt.device, rt.backend, rt.precision,
             "" if config.recipe == "none" else f", recipe {config.recipe}")
    estimate = _memory_need(config)
    if estimate is not None and estimate[2] is not None:
        log.info("memory: at least %.2f GiB for %d rank(s) on this machine, %.2f GiB available", estimate[0] / 2**30,
                 estimate[1], estimate[2] / 2**30)
    peak = progress.peak = [None] * rt.world_size
    dist.all_gather_object(peak, _out.measure_peak_flops(rt.device), group=rt.group)
    pipe = None
    if config.pp > 1:  # loads torch.distributed.pipelining (and DTensor) only for a pipeline
        from .pipeline import build_pipeline
        pipe = build_pipeline(config, rt.world_size, rt.device, rt.param_dtype)
    if pipe:
        model = progress.pipeline = pipe.model
        log.info("pipeline: pp %d x dp %d, %s, %d microbatches a step; this rank holds stage(s) %s (coalesced: %s)",
                 config.pp, pipe.dp_size, config.pp_schedule, config.step_microbatches,
                 ", ".join(str(s.stage_index) for s in pipe.stages), ", ".join(map(str, pipe.coalesced)) or "none")
    elif config.ep > 1:  # docs/experts.md: the experts over (ep, dp), the other weights over every rank
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(rt.device.type, (config.ep, rt.world_size // config.ep), mesh_dim_names=("ep", "dp"))
        model = MoEGPT(mc, device=rt.device, group=rt.group, param_dtype=rt.param_dtype, ep_mesh=mesh)
        log.info("experts: ep %d x dp %d, %d experts a rank (no coalescing with --ep)", config.ep,
                 rt.world_size // config.ep, mc.n_experts // config.ep)
    else:
        model = MoEGPT(mc, device=rt.device, group=rt.group, param_dtype=rt.param_dtype)
    if config.coalesce and rt.world_size > 1 and not pipe and config.ep == 1:  # one gather, one reduction a block
        distwgrad.coalesce(model)  # [Note: coalesced units]
    if config.compile:
        compile_blocks(model)
    optimizer = optimizer_for(model, config)
    start = progress.start = progress.step = _resume(config, rt, model, optimizer) if config.resume else 0
    log.info("%d weights; steps %d..%d; data: %s", len(distwgrad.wgrad.distributed_parameters(model)), start + 1,
             config.steps, config.data or "synthetic Markov corpus")
    lockstep = Lockstep(config, rt, start) if config.check_parity else None
    if config.cuda_graph:
        rows = config.global_batch // (rt.world_size * config.microbatches)
        progress.graphed = _graph.graph_blocks(
            model, rows, recipe=_graph.recipe_for_graphs(config.recipe),
            keep_fp8_weights=keeps_fp8_weights(config.fp8_weight_cache, config.microbatches, config.recipe))
        log.info("CUDA graphs: %d blocks captured for microbatches of %s in %.1f s (%.2f GiB); %s eager",
                 len(progress.graphed["graphed"]), "x".join(map(str, progress.graphed["sample_shape"])),
                 progress.graphed["capture_s"], progress.graphed["graph_bytes"] / 2**30,
                 ", ".join(progress.graphed["eager"]))
    progress.board = _metrics.Board(config.tensorboard, rt.rank)
    try:
        with _collector(config.gc_every):
            hist = _train(config, rt, model, optimizer, corpus, start, lockstep, progress, pipe)
    finally:
        progress.board.close()
    if config.cuda_graph:
        _graph.release(model)  # the free-running reference below may need the memory
    verdict = lockstep.verdict(model) if lockstep else None  # collective; the verdict on rank 0
    memory = _out.peak_memory(rt.device, rt.group, rt.world_size)
    progress.parallelism = _parallelism(config, rt, pipe, model, config.steps - start)  # collective
    passed = [verdict["passed"] if verdict else True]
    if lockstep:
        dist.broadcast_object_list(passed, src=0, group=rt.group)
    # The last collective: what follows is rank 0's alone, so no rank waits on its free-running
    # reference (which may take longer than --timeout: docs/training.md, Faults).
    if rt.rank == 0:
        parity = parity_result(config, rt, corpus, verdict, hist) if verdict else None
        _write_report(config, _report(config, rt, progress, parity, memory))
    return 0 if passed[0] else 1


def _write_report(config: TrainConfig, report: dict[str, Any]) -> None:
    """report.json, then loss.png and the closing log line unless interrupted (the resuming run plots)."""
    os.makedirs(config.out, exist_ok=True)
    with open(os.path.join(config.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    if report["interrupted"] is not None:
        return
    _out.plot(report, os.path.join(config.out, "loss.png"))
    s = report["summary"]
    log.info("wrote %s and loss.png; final loss %.4f (best %.4f at step %d); %.0f tokens/s; MFU %s; %.1f s",
             os.path.join(config.out, "report.json"), s["final_loss"], s["best_loss"], s["best_step"],
             s["tokens_per_s"] or 0.0, "n/a (CPU)" if s["mfu"] is None else f"{s['mfu']:.1%}", s["wall_time_s"])


def _interrupted(config: TrainConfig, rt: _Runtime, progress: _Progress, exc: BaseException) -> int:
    """After a failed collective or SIGTERM ([Note: lost rank] in launch/faults.py): the lowest survivor
    reports the lost ranks. Runs no collective of the job's (broken) group."""
    _faults.ignore_sigterm()
    lost = _faults.lost_ranks(rt.monitor, _faults.probe_seconds(config.timeout))
    _faults.end_siblings(lost)
    if rt.rank != min(r for r in range(rt.world_size) if r not in lost):
        return _faults.INTERRUPTED_EXIT
    done = progress.hist["steps"]
    info = {"step": progress.step, "last_step_done": done[-1] if done else progress.start,
            "lost_rank": lost[0] if lost else None, "lost_ranks": lost, "reason": _faults.reason(exc),
            "last_checkpoint": _faults.last_checkpoint(config.out, config.resume), "reported_by": rt.rank}
    note = ""
    try:
        memory = _out.peak_memory(rt.device, None, rt.world_size, rank=rt.rank)
        _write_report(config, _report(config, rt, progress, None, memory, interrupted=info))
    except Exception as report_exc:  # the line below is the one thing that must come out
        note = f"; report.json not written: {_faults.reason(report_exc)}"
    who = f"rank {', '.join(map(str, lost))} lost" if lost else "no rank lost"
    print(f"distwgrad.launch.train: interrupted at step {info['step']}: {who} ({info['reason']}); last complete "
          f"checkpoint: {info['last_checkpoint'] or 'none'}{note}", file=sys.stderr, flush=True)
    return _faults.INTERRUPTED_EXIT


def _check_out(config: TrainConfig) -> None:
    """Refuses a new run into an ``--out`` holding another run's report or checkpoints, unless ``--overwrite``."""
    if config.resume or config.overwrite:
        return
    report, ckpts = os.path.join(config.out, "report.json"), os.path.join(config.out, "checkpoints")
    held = []
    if os.path.isfile(report):
        try:
            with open(report) as f:
                old = json.load(f)
            stopped = old.get("interrupted")
            held.append(f"a run {'interrupted at' if stopped else 'finished at'} step "
                        f"{(stopped or {}).get('last_step_done', (old.get('steps') or ['?'])[-1])} (report.json)")
        except (OSError, ValueError):
            held.append("a report.json")
    if os.path.isdir(ckpts) and any(d.startswith("step_") for d in os.listdir(ckpts)):
        held.append(f"checkpoints ({ckpts})")
    if held:
        raise ValueError(f"--out {config.out!r} holds {' and '.join(held)}; pass --resume {ckpts} to continue it, "
                         f"--overwrite to replace it, or another --out")


def _memory_need(config: TrainConfig) -> tuple[float, int, float | None] | None:
    """On a CPU, ``(least bytes this machine's ranks need, ranks, bytes available)``: per rank, this process's
    resident memory, the full fp32 weights while building, 16 bytes a shard parameter; None on GPUs."""
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return None
    params = config.model_config().num_params()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return ranks * (_resident_bytes() + 4 * params + 16 * params / world), ranks, _available_bytes()


def _check_memory(config: TrainConfig) -> None:
    """Refuses, before anything is built, a model the CPU machine's memory cannot hold."""
    estimate = _memory_need(config)
    if estimate is None:
        return
    need, ranks, available = estimate
    params = config.model_config().num_params()
    if available is not None and need > available:
        raise ValueError(f"--model {config.model} ({params:,} parameters) needs at least {need / 2**30:.2f} GiB on "
                         f"this machine for {ranks} CPU rank(s) (each rank's interpreter and torch, the full fp32 "
                         f"weights while building, then masters, gradients and AdamW state of each shard); "
                         f"{available / 2**30:.2f} GiB are available. Use a smaller --model, fewer ranks here, or GPUs")


def _resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv, prog="distwgrad.launch.train", description=_help_text())
    try:
        _check_out(config)
        _check_memory(config)
        rt = _init(config)
    except ValueError as exc:  # before any process group: every rank knows, rank 0 says
        if os.environ.get("RANK", "0") == "0":
            print(f"distwgrad.launch.train: error: {exc}", file=sys.stderr)
        return 2
    _faults.catch_sigterm()
    progress = _Progress()
    try:
        return _run(config, rt, progress)
    except (CheckpointError, DataError) as exc:  # the same check fails on every rank, before any collective
        if rt.rank == 0:
            print(f"distwgrad.launch.train: error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        _faults.ignore_sigterm()  # torchrun's teardown follows a failure: the report must come out
        if not _faults.is_comm_failure(exc):
            raise  # this rank's own error: its traceback, and torchrun names the rank
        code = _interrupted(config, rt, progress, exc)
        logging.shutdown()
        # The group is broken (gloo may abort while destroying it): leave without destroying anything.
        os._exit(code)
    finally:
        dist.destroy_process_group()


def _help_text() -> str:
    """--help's text: the commands of the module's docstring."""
    return "Commands:" + __doc__.split("Commands::")[1].split("\n\n\n")[0].split("\n\nThe trained weights")[0]


if __name__ == "__main__":
    sys.exit(main())
