"""Train an MoE GPT whose every weight is a ShardedWeight: tied embedding, deferred expert wgrads.

Commands::

    # CPU, 2 ranks over gloo, all defaults (a synthetic corpus generated in-process; no downloads)
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train
    # GPUs over NCCL: the same command (--nproc-per-node 8 on 8 GPUs); each rank uses cuda:LOCAL_RANK, and
    # --precision auto is bf16 there; --model large is 1.3 B parameters (docs/training.md)
    # one process, no torchrun
    python -m distwgrad.launch.train --steps 50
    # bf16 mixed precision (fp32 masters; the default on CUDA), and a bigger preset (--model small/large)
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --precision bf16 --model small
    # on CUDA, --cuda-graph replays each transformer block from CUDA graphs (docs/cuda_graphs.md); with
    # --compile each block is compiled first (torch.compile): the fastest step, FP8 recipes most of all
    # also train an unsharded single-process copy and compare (exit code 1 if they disagree)
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --check-parity
    # train on a token file (nanoGPT's train.bin: flat uint16; --vocab-size must cover its tokens)
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --data train.bin --vocab-size 50304
    # checkpoint every 50 of 100 steps, then resume the latest on 4 ranks (resharded) to step 200, into
    # the same folder: report.json and loss.png then cover all 200 steps
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --steps 100 --save-every 50 --out runs/a
    torchrun --standalone --nproc-per-node 4 -m distwgrad.launch.train --steps 200 \
        --resume runs/a/checkpoints --out runs/a
    # give up on a rank that hangs after 60 s (exit code 3), keeping only the 2 newest checkpoints
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --timeout 60 --save-every 50 --keep-last 2
    # every option
    python -m distwgrad.launch.train --help

Each step runs ``--microbatches`` forward/backward passes on this rank's rows of the global batch, drains the
experts' deferred wgrads after each (``drain_deferred_wgrads``), ends with
``distwgrad.finalize_model_grads([model])`` (reduce-scatter of what is left, gradients onto ``.grad``), then
``AdamW.step()`` on the shards and ``zero_grad()``. With ``--cuda-graph`` each transformer block replays from
CUDA graphs captured before the first step, the rest of the step unchanged (launch/cuda_graph.py,
[Note: the graphed step]); ``--compile`` compiles each block's forward (:func:`compile_blocks`). Rank 0 shows a progress
bar and logs; the other ranks stay quiet. At the end rank 0 writes ``OUT/report.json`` (with a ``summary``:
final and best loss, tokens/s, MFU on GPU, peak memory, wall time) and ``OUT/loss.png`` (``docs/training.md``
says what they hold). Exit codes: 0 done, 1 parity check failed, 2 bad options, an unusable ``--data`` or an
unusable ``--resume`` (one at or past ``--steps`` included), 3 interrupted: a rank died or hung, or SIGTERM
(``launch/faults.py``, [Note: lost rank]; the lowest surviving rank prints which rank and the last complete
checkpoint, and ``report.json`` records it). Every collective waits at most ``--timeout`` seconds.

[Note: parity]
Top-k routing makes training chaotic: in one process, nudging one weight by 1e-7 moves the loss by 1e-2
within 20 steps at the default learning rate (docs/training.md). The sharded run and an unsharded one add
the same terms in different orders, so their free-running loss curves part the same way, and no tight
tolerance on them can hold. So ``--check-parity`` runs the oracle (``MoEGPT(sharded=False)``: the same
architecture from plain torch modules, same init) in lockstep on rank 0. Before every step it takes the
sharded model's gathered weights, then on the whole global batch three things are compared: the loss at
identical weights, every gradient (the gathered shards after ``finalize_model_grads`` against autograd's),
and, handing the oracle's AdamW the sharded gradient, the weights after the optimizer step. Those differ
by rounding only, so the tolerances below are tight. The free-running oracle (trained alone from the same
init on the same batches) is reported and plotted too, without a verdict.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import distwgrad
from distwgrad.checkpoint import CheckpointError, full_tensor, load_checkpoint, save_checkpoint
from distwgrad.data import DataError, MarkovCorpus, TokenFile
from distwgrad.fp8 import fp8_autocast
from distwgrad.fp8.weights import sync_weight_amax
from distwgrad.models import MoEGPT

from . import cuda_graph as _graph
from . import faults as _faults
from . import report as _out
from .config import RECIPES, TrainConfig, fp8_recipe, parse_args

__all__ = ["main", "forward_backward", "compile_blocks"]

log = logging.getLogger("distwgrad.train")

# [Note: parity] tolerances. Measured on CPU (2 and 3 ranks, 30 and 200 steps) and one H200 (60 steps):
# loss <= 7e-7, gradient <= 2.3e-6 (relative to the weight's largest gradient entry), weights after the
# update 0 on CPU and 1.2e-7 on the GPU (AdamW is elementwise: given the same gradient and state a shard
# updates as the full tensor does, up to the GPU kernels' vectorisation). A bug is O(1): summing instead
# of averaging over ranks gives a gradient error of 1.0, a lost tied-embedding contribution 1.1.
PARITY_LOSS_ATOL = 1e-5  # ~40 fp32 ulps at a loss of 4
PARITY_GRAD_RTOL = 1e-4  # max |g - g_ref| / max |g_ref|, per weight
PARITY_WEIGHT_RTOL = 1e-6  # max |w - w_ref| / max |w_ref| after the optimizer step, per weight
# bf16 (--precision bf16): both sides compute in bf16 on fp32 masters, the reference casting its fp32
# parameters at each use ([Note: mixed precision] in distwgrad/models/moe_gpt.py). Measured on CPU (30 steps;
# 2 ranks, default sizes / 3 ranks, the tests' sizes): loss 2.4e-7 / 4.8e-7 (the same bf16 GEMMs on the same
# chunks give the same logits); gradient 5.1e-3 / 4.2e-2: the reference rounds each chunk's wgrad to bf16
# (unit roundoff 2**-9 = 2e-3 of the chunk's gradient, which cancellation between chunks can make large
# against the summed one) before adding it to the fp32 .grad, where distwgrad accumulates in fp32; weights 0.
PARITY_BF16 = {
    "loss_abs": 1e-3,  # room for GPU GEMMs whose bf16 logits differ by an ulp; a bug moves the loss by 1e-2+
    "grad_rel": 1e-1,  # 2.4x the worst measured; the bugs above give 1.0 and 1.1
    "weight_rel": PARITY_WEIGHT_RTOL,  # AdamW on fp32 masters: as in fp32
}


def _autocast(recipe: str) -> contextlib.AbstractContextManager:
    """The context each forward/backward runs in: ``fp8_autocast`` of the recipe (distwgrad.fp8; emulated on
    CPU), or none."""
    fp8 = fp8_recipe(recipe)
    return contextlib.nullcontext() if fp8 is None else fp8_autocast(fp8)


_RECIPES = {name: functools.partial(_autocast, name) for name in RECIPES}


@dataclass
class _Runtime:
    rank: int
    world_size: int
    device: torch.device
    backend: str
    group: Any
    param_dtype: torch.dtype | None  # None: fp32
    monitor: Any = None  # a gloo group of all ranks for the fault probes only ([Note: lost rank])
    started: float = field(default_factory=time.perf_counter)

    @property
    def precision(self) -> str:
        return "fp32" if self.param_dtype is None else "bf16"


_HIST = ("steps", "loss", "step_time_s", "tokens_per_s", "bytes_all_gathered", "bytes_reduce_scattered",
         "checkpoints")


@dataclass
class _Progress:
    """How far the run got, kept outside the loop so an interrupted run can report it ([Note: lost rank])."""
    start: int = 0
    step: int = 0  # the step being trained or saved
    hist: dict[str, list] = field(default_factory=lambda: {k: [] for k in _HIST})
    corpus: Any = None
    peak: list = field(default_factory=list)
    graphed: dict | None = None  # what --cuda-graph captured (report.json's cuda_graph)


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
    monitor = dist.new_group(backend="gloo", timeout=timeout)  # monitored_barrier is gloo's
    _faults.publish_pid()
    return _Runtime(rank, world_size, device, backend, dist.group.WORLD, torch.bfloat16 if bf16 else None,
                    monitor)


def compile_blocks(model: MoEGPT, **compile_kwargs: Any) -> None:
    """``--compile``: each block's ``forward`` replaced by its ``torch.compile`` (the module's state, hooks and
    checkpoint keys unchanged). Compiled as a ``forward``, not as a module (``block.compile()``), so that
    ``--cuda-graph`` can graph it: a compiled module sends every call through dynamo, which would then trace
    the replay that graphing installs as the module's ``forward`` ([Note: compiled blocks under CUDA graphs]
    in ``launch/cuda_graph.py``)."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward, **compile_kwargs)


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel over every parameter, distwgrad's shards included)."""
    params = list(model.parameters())
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=fused or None)


# --- one step --------------------------------------------------------------------------------------------

def forward_backward(model: torch.nn.Module, tokens_BS: torch.Tensor, microbatches: int,
                     recipe: str = "none", amax_modules: Sequence[torch.nn.Module] | None = None) -> torch.Tensor:
    """Forward and backward of every microbatch of ``tokens_BS`` (``[B, S + 1]``: inputs, then shifted
    targets), deferred wgrads drained; returns the loss (token mean, summed over microbatches), detached.
    The caller ends the step with ``distwgrad.finalize_model_grads`` and the optimizer. ``amax_modules``:
    whose sharded weights' amaxes a per-tensor step syncs first (default: the whole model; under
    ``--cuda-graph`` the eager parts, ``cuda_graph.eager_modules``: the graphs compute their own)."""
    total = torch.zeros((), device=tokens_BS.device)
    if recipe.startswith("fp8_per_tensor"):
        # one amax all-reduce for every sharded weight of the step
        sync_weight_amax(model if amax_modules is None else amax_modules)
    for mb in tokens_BS.chunk(microbatches):
        with _RECIPES[recipe]():
            loss = model.loss(mb[:, :-1], mb[:, 1:]) / microbatches
            loss.backward()
        distwgrad.drain_deferred_wgrads(model)
        total += loss.detach()
    return total


def _optimizer_step(optimizer: torch.optim.Optimizer, lr: float | None = None) -> None:
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _comm_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """All-gathered and reduce-scattered bytes so far, summed over distinct weights (tied: once)."""
    params = [p for _, p in distwgrad.wgrad.distributed_parameters(model)]
    return sum(p.bytes_gathered for p in params), sum(p.bytes_reduced for p in params)


# --- [Note: parity] --------------------------------------------------------------------------------------

def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _reference_model(config: TrainConfig, rt: _Runtime) -> MoEGPT | None:
    """The unsharded reference, on rank 0. Without FP8 it is plain torch (no distwgrad code at all).
    Under an FP8 recipe plain torch has no FP8 path, so the reference is the same distwgrad model with
    its weights whole on rank 0 (a group of one): it checks that sharding changes nothing under FP8,
    while the FP8 numerics themselves are checked against the emulation reference in the tests. With
    ``--compile`` that model's blocks are compiled as the run's are: an eager reference would differ from
    the compiled run by inductor's bf16 roundings of the norms and attention, which FP8 quantization turns
    into whole FP8 steps (on one H200, tiny preset, per-tensor: gradients 0.104 of their largest entry apart
    at world 1, where nothing is sharded). The plain reference stays eager: it checks the compiled modules'
    gradients against plain torch."""
    mc, pd = config.model_config(), rt.param_dtype
    if config.recipe == "none":
        return MoEGPT(mc, device=rt.device, sharded=False, param_dtype=pd) if rt.rank == 0 else None
    solo = [dist.new_group([r]) for r in range(rt.world_size)]  # every rank creates every group
    if rt.rank != 0:
        return None
    ref = MoEGPT(mc, device=rt.device, sharded=True, group=solo[0], param_dtype=pd)
    if config.compile:
        compile_blocks(ref)
    return ref


class _Lockstep:
    """The unsharded reference on rank 0, re-synchronised to the sharded weights before every step."""

    def __init__(self, config: TrainConfig, rt: _Runtime, start: int) -> None:
        self.config, self.rt = config, rt
        self.ref = _reference_model(config, rt)
        self.opt = _optimizer(self.ref, config) if self.ref is not None else None
        # Updates compare only when both optimizers share their history: not after a resume, where the
        # sharded AdamW state comes from the checkpoint and the reference's starts empty.
        self.compare_weights, self.stepped = start == 0, False
        self.worst = {"loss_abs": 0.0, "grad_rel": 0.0, "weight_rel": 0.0}
        self.ref_loss: list[float] = []

    def _gather(self, model: torch.nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in model.named_parameters():
            local = p.detach() if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
            out[name] = full_tensor(local, p)  # collective: every rank takes part
        return out

    def sync(self, model: torch.nn.Module) -> None:
        """Before a step: compare the reference's own last update with the sharded one, then adopt it."""
        full = self._gather(model, grads=False)
        if self.ref is None:
            return
        with torch.no_grad():
            for name, q in self.ref.named_parameters():
                if self.compare_weights and self.stepped:
                    self.worst["weight_rel"] = max(self.worst["weight_rel"], _max_rel(full[name], q))
                q.copy_(full[name])

    def check(self, model: torch.nn.Module, tokens_BS: torch.Tensor, loss: float, step: int) -> None:
        """After ``finalize_model_grads``: the reference's step on the global batch, compared."""
        grads = self._gather(model, grads=True)
        if self.ref is None:
            return
        # world x microbatches chunks of the global batch are exactly the ranks' microbatches, so the
        # reference quantizes the same activations under a per-tensor FP8 recipe.
        ref_loss = forward_backward(self.ref, tokens_BS.to(self.rt.device),
                                    self.config.microbatches * self.rt.world_size, self.config.recipe).item()
        distwgrad.finalize_model_grads([self.ref])  # plain parameters: a no-op, kept for symmetry
        self.ref_loss.append(ref_loss)
        self.worst["loss_abs"] = max(self.worst["loss_abs"], abs(loss - ref_loss))
        for name, q in self.ref.named_parameters():
            self.worst["grad_rel"] = max(self.worst["grad_rel"], _max_rel(grads[name], q.grad))
            q.grad = grads[name]  # the update is compared given the same gradient: see [Note: parity]
        _optimizer_step(self.opt, self.config.lr_at(step))
        self.stepped = True

    def verdict(self, final_model: torch.nn.Module) -> dict[str, Any] | None:
        self.sync(final_model)  # compares the last step's update
        if self.ref is None:
            return None
        limits = _tolerances(self.rt)
        passed = all(self.worst[k] <= limits[k] for k in limits)
        return {"max_abs_diff": self.worst["loss_abs"], "max": dict(self.worst), "tolerance": limits,
                "weights_compared": self.compare_weights, "passed": passed, "reference_loss": self.ref_loss}


def _tolerances(rt: _Runtime) -> dict[str, float]:
    if rt.param_dtype is None:
        return {"loss_abs": PARITY_LOSS_ATOL, "grad_rel": PARITY_GRAD_RTOL, "weight_rel": PARITY_WEIGHT_RTOL}
    return dict(PARITY_BF16)


def _free_running(config: TrainConfig, rt: _Runtime, corpus: MarkovCorpus | TokenFile) -> list[float]:
    """The reference trained alone from the same init on the same global batches (rank 0)."""
    ref = MoEGPT(config.model_config(), device=rt.device, sharded=False, param_dtype=rt.param_dtype)
    opt = _optimizer(ref, config)
    losses = []
    for step in range(1, config.steps + 1):
        tokens = corpus.global_batch(step, config.global_batch).to(rt.device)
        losses.append(forward_backward(ref, tokens, config.microbatches, config.recipe).item())
        distwgrad.finalize_model_grads([ref])
        _optimizer_step(opt, config.lr_at(step))
    return losses


def _parity_result(config, rt, corpus, r: dict[str, Any], hist) -> dict[str, Any]:
    """The lockstep verdict ``r`` with the free-running reference added (rank 0, after the last collective)."""
    free = _free_running(config, rt, corpus)
    ours = hist["loss"]
    r["free_running_steps"] = hist["steps"]
    r["free_running_loss"] = [free[s - 1] for s in hist["steps"]]
    r["free_running_max_abs_diff"] = max((abs(a - b) for a, b in zip(ours, r["free_running_loss"])),
                                         default=0.0)
    tol = r["tolerance"]
    log.info("parity (lockstep, %d steps, %s): max |loss diff| %.2e (tol %.0e), max rel grad diff %.2e "
             "(tol %.0e), max rel weight diff %.2e (tol %.0e): %s; free-running max |loss diff| %.2e "
             "(chaotic, not gated)", len(ours), rt.precision, r["max"]["loss_abs"], tol["loss_abs"],
             r["max"]["grad_rel"], tol["grad_rel"], r["max"]["weight_rel"], tol["weight_rel"],
             "PASSED" if r["passed"] else "FAILED", r["free_running_max_abs_diff"])
    return r


# --- the loop --------------------------------------------------------------------------------------------

# [Note: garbage collection in training]
# Python's automatic collector runs when allocations outnumber frees by a threshold, wherever in a step that
# happens, and its full collections walk every object of the process (the model, the optimizer, compiled
# graphs); a step of distwgrad's modules allocates many short-lived Python objects (autograd contexts,
# per-call records). So, as torchtitan trains (its ``gc_freq``), the loop switches the automatic collector
# off and runs a generation-1 collection every ``--gc-every`` steps, after the optimizer, inside the step's
# timing; the collector's state is restored when training ends. ``--gc-every 0`` leaves it on.

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
           lockstep: _Lockstep | None, progress: _Progress) -> dict[str, list]:
    hist = progress.hist
    tokens_per_step = config.global_batch * config.seq_len
    bar = tqdm(total=config.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
               disable=rt.rank != 0 or not config.progress, file=sys.stderr)
    amax_modules = _graph.eager_modules(model) if config.cuda_graph else None
    for step in range(start + 1, config.steps + 1):
        progress.step = step
        local_BS = corpus.local_batch(step, config.global_batch, rt.rank, rt.world_size)
        if lockstep:
            lockstep.sync(model)
        gathered0, reduced0 = _comm_bytes(model)
        t0 = time.perf_counter()
        loss = forward_backward(model, local_BS.to(rt.device), config.microbatches, config.recipe, amax_modules)
        distwgrad.finalize_model_grads([model])
        dist.all_reduce(loss, group=rt.group)
        loss = loss.item() / rt.world_size  # .item() synchronises, so the step time is real
        dt = time.perf_counter() - t0
        if lockstep:
            lockstep.check(model, corpus.global_batch(step, config.global_batch), loss, step)
            _faults.wait_for_rank0(rt.monitor, config.timeout)  # rank 0 alone ran the reference step
        t0 = time.perf_counter()
        _optimizer_step(optimizer, config.lr_at(step))
        if config.gc_every and step % config.gc_every == 0:
            gc.collect(1)  # [Note: garbage collection in training]
        dt += time.perf_counter() - t0
        gathered, reduced = _comm_bytes(model)
        for key, value in (("steps", step), ("loss", loss), ("step_time_s", dt),
                           ("tokens_per_s", tokens_per_step / dt), ("bytes_all_gathered", gathered - gathered0),
                           ("bytes_reduce_scattered", reduced - reduced0)):
            hist[key].append(value)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        if config.log_every and (step % config.log_every == 0 or step == config.steps):
            log.info("step %d/%d  loss %.4f  %.0f tokens/s", step, config.steps, loss, tokens_per_step / dt)
        if config.save_every and (step % config.save_every == 0 or step == config.steps):
            hist["checkpoints"].append(_save(config, rt, step, model, optimizer))
    bar.close()
    return hist


def _model_meta(config: TrainConfig) -> dict[str, Any]:
    return {"model_config": dict(config.model_config().__dict__)}


def _save(config: TrainConfig, rt: _Runtime, step: int, model, optimizer) -> str:
    path = save_checkpoint(os.path.join(config.out, "checkpoints"), step, model, optimizer, group=rt.group,
                           meta=_model_meta(config), keep_last=config.keep_last)
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
    earlier = _out.earlier_history(config.out, start, dict(mc.__dict__)) if config.resume else {}
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
    start = load_checkpoint(config.resume, model, optimizer, group=rt.group, expect=_model_meta(config))
    if start >= config.steps:
        raise CheckpointError(f"--resume {config.resume!r} is at step {start}, at or past --steps "
                              f"{config.steps}: nothing to train (pass --steps greater than {start})")
    log.info("resumed from %s at step %d", config.resume, start)
    return start


def _run(config: TrainConfig, rt: _Runtime, progress: _Progress) -> int:
    corpus = progress.corpus = _data(config)  # DataError on every rank alike, before any collective
    mc = config.model_config()
    log.info("MoEGPT %s: %s parameters (%s active per token), %d layers, d_model %d, %d experts top-%d; "
             "%d rank(s) on %s (%s), %s%s", config.model, f"{mc.num_params():,}",
             f"{(mc.flops_per_token() - 6 * mc.n_layers * mc.seq_len * mc.d_model) // 6:,}", mc.n_layers,
             mc.d_model, mc.n_experts, mc.top_k, rt.world_size, rt.device, rt.backend, rt.precision,
             "" if config.recipe == "none" else f", recipe {config.recipe}")
    peak = progress.peak = [None] * rt.world_size
    dist.all_gather_object(peak, _out.measure_peak_flops(rt.device), group=rt.group)
    model = MoEGPT(mc, device=rt.device, group=rt.group, param_dtype=rt.param_dtype)
    if config.coalesce and rt.world_size > 1:  # one gather and one reduction per block: [Note: coalesced units]
        distwgrad.coalesce(model)
    if config.compile:
        compile_blocks(model)
    optimizer = _optimizer(model, config)
    start = progress.start = progress.step = _resume(config, rt, model, optimizer) if config.resume else 0
    log.info("%d weights; steps %d..%d; data: %s", len(distwgrad.wgrad.distributed_parameters(model)), start + 1,
             config.steps, config.data or "synthetic Markov corpus")
    lockstep = _Lockstep(config, rt, start) if config.check_parity else None
    if config.cuda_graph:
        rows = config.global_batch // (rt.world_size * config.microbatches)
        progress.graphed = _graph.graph_blocks(model, rows, recipe=_graph.recipe_for_graphs(config.recipe))
        log.info("CUDA graphs: %d blocks captured for microbatches of %s in %.1f s (%.2f GiB); %s eager",
                 len(progress.graphed["graphed"]), "x".join(map(str, progress.graphed["sample_shape"])),
                 progress.graphed["capture_s"], progress.graphed["graph_bytes"] / 2**30,
                 ", ".join(progress.graphed["eager"]))
    with _collector(config.gc_every):
        hist = _train(config, rt, model, optimizer, corpus, start, lockstep, progress)
    if config.cuda_graph:
        _graph.release(model)  # the free-running reference below may need the memory
    verdict = lockstep.verdict(model) if lockstep else None  # collective; the verdict on rank 0
    memory = _out.peak_memory(rt.device, rt.group, rt.world_size)
    passed = [verdict["passed"] if verdict else True]
    if lockstep:
        dist.broadcast_object_list(passed, src=0, group=rt.group)
    # The last collective: what follows is rank 0's alone, so no rank waits on its free-running
    # reference (which may take longer than --timeout: docs/training.md, Faults).
    if rt.rank == 0:
        parity = _parity_result(config, rt, corpus, verdict, hist) if verdict else None
        _write_report(config, _report(config, rt, progress, parity, memory))
    return 0 if passed[0] else 1


def _write_report(config: TrainConfig, report: dict[str, Any]) -> None:
    """report.json, then loss.png and the closing log line unless interrupted (that run prints its own
    line, and leaves the plot to the run that resumes it: importing matplotlib takes seconds)."""
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
    """A collective failed or timed out, or torchrun sent SIGTERM ([Note: lost rank] in launch/faults.py):
    find the lost ranks; the lowest survivor prints one line and writes report.json. No collective of the
    job's group runs here."""
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


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv, prog="distwgrad.launch.train", description=__doc__.split("[Note: parity]")[0])
    try:
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


if __name__ == "__main__":
    sys.exit(main())
