"""One training step of the MoE GPT three ways, in one process, timed in interleaved rounds.

    # CPU, 2 ranks over gloo (eager only: inductor on two cores takes minutes per build)
    torchrun --standalone --nproc-per-node 2 qa/bench/train_step.py --model small --modes eager
    # one H200: FP8 against torchao's FP8 peers (the plain and FSDP2 builds converted; pip install .[bench])
    torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large --batch 8 --microbatches 1 \
        --impls distwgrad,torch,fsdp2 --precisions bf16,fp8_per_tensor --modes eager,compiled
    # one H200: every precision, eager and compiled, with a profiler trace per build (and each build's op
    # table, idle device time and kernel time by kind: GEMMs, quantization, optimizer, attention, other)
    torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large --batch 8 --profile runs/trace
    # one H200, bf16, each build eager and in its best configuration (FSDP2 compiled; distwgrad and plain
    # torch compiled, then graphed): the issue's bf16 table
    torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large --batch 8 --microbatches 1 \
        --precisions bf16 --modes eager,compiled,compiled_cuda_graph
    # 8 GPUs over NCCL: the same command with --nproc-per-node 8
    # one H200: eager against each build's blocks replayed from CUDA graphs
    torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large --batch 8 --modes eager --cuda-graph
    python qa/bench/train_step.py --help

The builds share the model (``distwgrad.models.MoEGPT``: same config, same initial weights from
``init_full_weights``) and the data (one seeded global batch per step, each rank taking its rows):

* ``distwgrad``: ``MoEGPT(sharded=True)`` on ``ShardedWeight``s (bf16 compute copies, fp32 ``main_grad``,
  deferred expert wgrads); the step is the job's own ``launch.train.forward_backward`` then
  ``distwgrad.finalize_model_grads`` then the optimizer.
* ``fsdp2``: ``MoEGPT(sharded=False)`` with fp32 parameters, experts through ``torch._grouped_mm``,
  ``fully_shard`` on each block and on the root with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, as torchtitan builds MoE.
* ``torch``: the same plain model unsharded (world 1: the upper bound); at world > 1 it is wrapped in
  ``DistributedDataParallel`` (rows say ``"torch_mode": "ddp"``).

Every build uses AdamW, fused on CUDA (``foreach`` on CPU, or where fused refuses the parameters: the
rows' ``optimizer`` field says which ran). ``--modes`` compiled adds ``torch.compile`` on each block; a
build that fails to compile is reported and left out. FP8 (``fp8_per_tensor``, ``fp8_blockwise``) runs
distwgrad under ``distwgrad.fp8.fp8_autocast``. The peers' FP8 is torchao's, as torchtitan converts a model
(``_torchao_fp8.py``: tensorwise ``Float8Linear`` attention projections, FP8 rowwise grouped experts, the tied
embedding and the routers bf16), in ``fp8_per_tensor`` where torchao imports (the optional extra ``bench``);
their rows carry ``recipe`` "torchao" and say what was converted. On a CPU (a smoke run) the experts stay bf16
(``fp8_experts`` false: ``torch._scaled_grouped_mm`` is CUDA only); on a GPU the peer runs the whole recipe
or is listed as not run with the reason, as it is without torchao and in ``fp8_blockwise``.

``--cuda-graph`` (mode ``cuda_graph``, CUDA only) replays each block's forward, backward and deferred wgrads
from CUDA graphs, the embedding and loss head eager: distwgrad's blocks through the job's own ``--cuda-graph``
(``launch/cuda_graph.py``, ``distwgrad.make_graphed_callables``), the plain build's through
``torch.cuda.make_graphed_callables`` (world 1; at world > 1 it is DDP, not graphed here). FSDP2 is not
graphed: ``fully_shard`` works through module hooks, which ``make_graphed_callables`` refuses; it is listed
as not run with that reason, as are the FP8 recipes the job's ``--cuda-graph`` refuses (``launch/config.py``).
Mode ``compiled_cuda_graph`` does both, as the job's ``--compile --cuda-graph``: each block's forward
compiled (``launch.train.compile_blocks``), then the blocks graphed as above ([Note: compiled blocks under
CUDA graphs] in ``launch/cuda_graph.py``).

Timing: ``--warmup`` steps per build, then ``--rounds`` rounds cycling through the builds of one
(precision, mode), ``--steps`` steps per build per round, synchronised at the end of each block; the
median over rounds is reported. Round r starts with build r (mod the builds), so with a number of rounds
that is a multiple of the builds' (the default 6: two or three builds) every build is timed in every place
of a round equally often ([Note: each build in each place of a round]). After the rounds one more step per
build runs under ``torch.profiler`` to count its collectives and bytes (``_trace.py`` says how; not for
graphed builds, whose collectives replay inside the graphs, out of the profiler's and the weights'
counters' sight). Peak memory (CUDA only) is the build's persistent tensors (parameters, gradients,
``main_grad``, optimizer state) plus the high-water mark of ``torch.cuda.max_memory_allocated`` above the
allocation at the start of its steps (graphed, plus what the capture kept allocated: the graph pool, static
buffers and graph-owned gradient buffers); on CPU one process's allocations are not separable by build, so
it is not reported. The rows' ``allocator_per_step`` (CUDA only) counts the caching allocator's slow paths
in the timed steps: retries, cudaMalloc and cudaFree.
MFU: the model's training FLOPs (6 x matmul parameters used per token, plus attention 12 x layers x
d_model x seq_len, torchtitan's convention) over the dense bf16 peak measured at start (an 8192^3 bf16
matmul); CUDA only.

[Note: each build in each place of a round]
A build's place in a round changes its time: on an H200, two identical graphed bf16 builds of the large
preset (one process, interleaved rounds) stepped in 91.1 and 95.2 ms with either of them first, the build
timed right after another one always about 4% slower (docs/benchmarks/LOG.md, 2026-12-02 (night)). A fixed
order would give that bias to whichever implementation comes first; rotating the order spreads it over all.
Builds of different modes are in different groups, timed at other times, unless ``--together`` puts every
mode of a precision in one group (memory permitting: every build of the group is alive at once); the
best-configuration ratios compare builds of different modes.

[Note: garbage collection in the timed steps]
Python's automatic collector runs when allocations outnumber frees by a threshold, at whatever point of a
step that happens, and a full collection walks every object in the process: every build's model, optimizer
and compiled graphs. So a build that allocates many Python objects per step (distwgrad's modules: autograd
contexts, closures, per-call records) pays for the other builds' objects, and more so the more builds share
the process. The bench trains as torchtitan does (its ``gc_freq``): automatic collection off, and a
generation-1 collection before each build's timed block, outside its timing; every build alike.
``--python-gc`` leaves the automatic collector on.

Rows go to ``docs/benchmarks/results.jsonl`` (``qa/bench/results.py``; ``--no-record`` skips it), one per
(impl, precision, mode, metric). The step-1 losses of all builds are printed side by side and compared
(``LOSS_ATOL``): same weights, same data, so a gap is a bug in a build (or in this bench). Last, each
build's best configuration (its fastest mode) with the ratios the targets compare (``best_configurations``;
``--json``'s ``best``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torchao_fp8  # noqa: E402
import _trace  # noqa: E402
import results  # noqa: E402

import distwgrad  # noqa: E402
from distwgrad.data import MarkovCorpus  # noqa: E402
from distwgrad.models import MoEGPT, MoEGPTConfig  # noqa: E402

IMPLS = ("distwgrad", "fsdp2", "torch")
PRECISIONS = ("fp32", "bf16", "fp8_per_tensor", "fp8_blockwise")
MODES = ("eager", "compiled", "cuda_graph", "compiled_cuda_graph")
UNGRAPHED = {"cuda_graph": "eager", "compiled_cuda_graph": "compiled"}  # a graphed mode -> the mode it replays
GRAPHED = tuple(UNGRAPHED)  # modes whose blocks replay from CUDA graphs
METRICS = ("step_ms", "tokens_per_s", "peak_gib", "mfu", "collectives_per_step", "comm_bytes_per_step",
           "comm_hidden")
# Step-1 loss agreement between builds, by precision. fp32: the job's parity tolerance (the same sums in
# other orders; launch/train.py PARITY_LOSS_ATOL). bf16 and FP8: every build rounds the same weights to
# bf16 but the activations in its own order; a loss is a mean over tokens of per-token errors of a few
# ulps of the logits (|logit| << 1 at init). Measured on CPU (tiny and small, 1 and 2 ranks): bf16 builds
# 0 to 1e-4 apart, FP8 vs plain bf16 at most 6.3e-4. The bound is half a bf16 ulp at a loss of 4 (3.1e-2).
# FP8 rounds GEMM operands to e4m3 (3 mantissa bits: 16 times bf16's step), which the mean over tokens mostly
# averages out: torchao's peers (every FP8 build is checked against plain bf16) measured at most 9.8e-4 on
# CPU (attention only) and 1.5e-3 on an H100 (small, experts too), an order under the bound.
LOSS_ATOL = {"fp32": 1e-5, "bf16": 1.6e-2, "fp8_per_tensor": 1.6e-2, "fp8_blockwise": 1.6e-2}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _launch_train():
    try:
        from distwgrad.launch import train
    except ImportError:  # a bare checkout: the job's package is launch/ at the repository root
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from launch import train
    return train


# --- model configs and builds ----------------------------------------------------------------------------

def model_config(args) -> tuple[str, MoEGPTConfig, int, int]:
    """(name, config, global batch, microbatches): the job's ``--model`` preset resolved by the job's own
    ``TrainConfig`` (launch/config.py), explicit size and batch flags overriding it."""
    fields = [f.name for f in dataclasses.fields(MoEGPTConfig)]
    overrides = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    batch = {k: v for k, v in (("global_batch", args.batch), ("microbatches", args.microbatches)) if v is not None}
    job = sys.modules[_launch_train().__package__ + ".config"].TrainConfig(model=args.model, **overrides, **batch)
    name = args.model + "".join(f" {k}={v}" for k, v in overrides.items())
    return name, job.model_config(), job.global_batch, job.microbatches


def build_model(impl: str, cfg: MoEGPTConfig, param_dtype: torch.dtype, device: torch.device,
                group: Any, *, precision: str = "bf16", tokens: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """The one place models are built: (model, facts recorded with its rows). Masters are fp32 everywhere:
    distwgrad's shards gather in ``param_dtype``, the plain build casts at each use, FSDP2 casts with its
    ``MixedPrecisionPolicy`` (so its model is built without ``param_dtype``). A peer in an FP8 precision is
    converted to torchao's FP8 (``_torchao_fp8.convert``; ``tokens``: rows of a microbatch on a rank)."""
    facts: dict[str, Any] = {"param_dtype": str(param_dtype).removeprefix("torch."), "master_dtype": "float32"}
    mixed = None if param_dtype == torch.float32 else param_dtype
    if impl == "distwgrad":
        model = MoEGPT(cfg, device=device, group=group, sharded=True, param_dtype=mixed)
        if dist.is_initialized() and dist.get_world_size(group) > 1:  # as the job does: one gather per block
            facts["units"] = len(distwgrad.coalesce(model))
        return model, facts
    facts["experts"] = "torch._grouped_mm"
    model = MoEGPT(cfg, device=device, sharded=False, experts="grouped_mm",
                   param_dtype=mixed if impl == "torch" else None)
    if precision.startswith("fp8"):
        facts.update(_torchao_fp8.convert(model, tokens=tokens, experts=_torchao_fp8.experts_why(device) is None))
    return model, facts


def _loss(model: Callable, tokens_BS: torch.Tensor) -> torch.Tensor:
    """``MoEGPT.loss`` through the wrapper's ``__call__`` (DDP hooks run only there)."""
    logits = model(tokens_BS[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens_BS[:, 1:].flatten())


def _optimizer(model: nn.Module, device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    params = list(model.parameters())
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(params, lr=1e-3, fused=True), "AdamW(fused=True)"
        except (RuntimeError, TypeError, ValueError) as exc:
            print(f"  fused AdamW refused these parameters ({exc}); foreach=True instead", flush=True)
    return torch.optim.AdamW(params, lr=1e-3, foreach=True), "AdamW(foreach=True)"


@dataclass
class Build:
    impl: str
    precision: str
    mode: str
    model: nn.Module
    step_fn: Callable[[torch.Tensor], torch.Tensor]  # this rank's tokens -> its loss (detached)
    optimizer: torch.optim.Optimizer
    facts: dict[str, Any]
    step: int = 0
    times_ms: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    comm: dict[str, Any] = field(default_factory=dict)
    loss1: float | None = None
    allocator: dict[str, int] = field(default_factory=dict)  # _ALLOCATOR_STATS summed over the timed steps
    timed_steps: int = 0

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.precision}/{self.mode}"

    def run_step(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        loss = self.step_fn(tokens_BS)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss


def _graph_why(impl: str, precision: str, rt: dict) -> str | None:
    """Why a build is not graphed (None: it is); the job's own checks for distwgrad's FP8 recipes."""
    if impl == "fsdp2":
        return ("FSDP2 cannot be graphed: fully_shard all-gathers and reduce-scatters from module hooks (host-side "
                "unshard state, stream waits), and make_graphed_callables refuses modules with hooks")
    if impl == "torch" and rt["world"] > 1:
        return "the plain build is graphed at world 1 only: at world > 1 it is DDP, not graphed here"
    if impl == "distwgrad":
        try:
            sys.modules[_launch_train().__package__ + ".config"].TrainConfig(
                recipe=precision if precision.startswith("fp8") else "none", cuda_graph=True,
                global_batch=rt["world"], microbatches=1).check_world_size(rt["world"])
        except ValueError as exc:
            return str(exc)
    return None


def _graph_torch_blocks(model: nn.Module, rows: int, cfg: MoEGPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The plain build's blocks through ``torch.cuda.make_graphed_callables`` (one callable per block)."""
    device = next(model.parameters()).device
    samples = tuple((torch.randn(rows, cfg.seq_len, cfg.d_model, device=device, dtype=dtype, requires_grad=True),)
                    for _ in model.blocks)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.make_graphed_callables(tuple(model.blocks), samples)
    torch.cuda.synchronize(device)
    return {"graphed_by": "torch.cuda.make_graphed_callables, one callable per block",
            "graph_bytes": torch.cuda.memory_allocated(device) - before}


def recipe_name(precision: str) -> str:
    """The job's ``--recipe`` for a precision of this bench."""
    return precision if precision.startswith("fp8") else "none"


def _graph(impl: str, model: nn.Module, precision: str, cfg: MoEGPTConfig, dtype: torch.dtype, args,
           rt: dict) -> dict[str, Any]:
    rows = args.batch // (rt["world"] * args.microbatches)
    if impl == "torch":
        return _graph_torch_blocks(model, rows, cfg, dtype)
    graphs = sys.modules[_launch_train().__package__ + ".cuda_graph"]
    recipe = graphs.recipe_for_graphs(recipe_name(precision))
    keep = _launch_train().keeps_fp8_weights(not args.no_fp8_weight_cache, args.microbatches, recipe_name(precision))
    info = graphs.graph_blocks(model, rows, recipe=recipe, keep_fp8_weights=keep)
    return {"graphed_by": "distwgrad.make_graphed_callables, one callable per block (the job's --cuda-graph)",
            **{k: info[k] for k in ("graph_bytes", "capture_s", "sample_shape", "num_warmup_iters")}}


def make_build(impl: str, precision: str, mode: str, cfg: MoEGPTConfig, rt: dict, args) -> Build:
    dtype = _DTYPES["fp32" if precision == "fp32" else args.param_dtype]
    tokens = args.batch // (rt["world"] * args.microbatches) * (cfg.seq_len - 1)
    model, facts = build_model(impl, cfg, dtype, rt["device"], rt["group"], precision=precision, tokens=tokens)
    if mode == "compiled":
        for block in model.blocks:
            block.compile()
    if mode == "compiled_cuda_graph":
        _launch_train().compile_blocks(model)  # as the job's --compile
    if mode in GRAPHED:
        facts.update(_graph(impl, model, precision, cfg, dtype, args, rt))
    mb = args.microbatches
    if impl == "distwgrad":
        forward_backward = _launch_train().forward_backward
        recipe = recipe_name(precision)
        amax_modules = (sys.modules[_launch_train().__package__ + ".cuda_graph"].eager_modules(model)
                        if mode in GRAPHED else None)  # as the job does

        def step_fn(tok):
            loss = forward_backward(model, tok, mb, recipe, amax_modules,
                                    keep_fp8_weights=not args.no_fp8_weight_cache)
            distwgrad.finalize_model_grads([model])
            return loss
        runner = model
    elif impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=rt["mesh"], mp_policy=mp)
        fully_shard(model, mesh=rt["mesh"], mp_policy=mp)
        facts["mp_policy"] = f"MixedPrecisionPolicy(param_dtype={facts['param_dtype']}, reduce_dtype=float32)"
        runner = model
    else:
        runner = model
        if rt["world"] > 1:
            # the buffers are the rotary tables, constants equal on every rank: no per-step broadcast
            runner = nn.parallel.DistributedDataParallel(model, process_group=rt["group"], broadcast_buffers=False)
        facts["torch_mode"] = "ddp" if rt["world"] > 1 else "single"
    if impl != "distwgrad":
        no_sync = getattr(runner, "no_sync", contextlib.nullcontext)

        def step_fn(tok):
            total = torch.zeros((), device=tok.device)
            for i, chunk in enumerate(tok.chunk(mb)):
                with no_sync() if i < mb - 1 else contextlib.nullcontext():
                    loss = _loss(runner, chunk) / mb
                    loss.backward()
                total += loss.detach()
            return total
    optimizer, facts["optimizer"] = _optimizer(model, rt["device"])
    return Build(impl, precision, mode, model, step_fn, optimizer, facts)


# --- measurement -----------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resident_bytes(b: Build) -> int:
    """Bytes of the build's persistent tensors: parameters (local), gradients, main_grad, optimizer state."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and hasattr(t, "__tensor_flatten__"):  # DTensor, torchao's wrappers
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        elif isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    for p in b.model.parameters():
        for t in (p, p.grad, getattr(p, "main_grad", None)):
            add(t)
    for state in b.optimizer.state.values():
        for t in state.values():
            add(t)
    return sum(seen.values())


# The caching allocator's counters of its slow paths: a retry frees every cached block and synchronizes
# the device; cudaMalloc / cudaFree mean the cache did not hold a fitting block. A build whose steps show
# them pays for allocator churn (for instance where the other builds' cached blocks fill the device).
_ALLOCATOR_STATS = {"num_alloc_retries": "retries", "num_device_alloc": "cuda_mallocs",
                    "num_device_free": "cuda_frees"}


def _allocator_counts(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for key, name in _ALLOCATOR_STATS.items()}


def _timed_block(b: Build, batches: list[torch.Tensor], device: torch.device) -> None:
    cuda = device.type == "cuda"
    _sync(device)
    if cuda:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = _allocator_counts(device)
    t0 = time.perf_counter()
    for tok in batches:
        b.run_step(tok)
    _sync(device)
    b.times_ms.append((time.perf_counter() - t0) * 1e3 / len(batches))
    b.timed_steps += len(batches)
    if cuda:
        for name, n in _allocator_counts(device).items():
            b.allocator[name] = b.allocator.get(name, 0) + n - before[name]
        b.peak_bytes = max(b.peak_bytes, torch.cuda.max_memory_allocated(device) - base + _resident_bytes(b)
                           + b.facts.get("graph_bytes", 0))


def _count_comm(b: Build, tok: torch.Tensor, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    params = [p for _, p in distwgrad.wgrad.distributed_parameters(b.model)] if b.impl == "distwgrad" else []
    own0 = [(p.bytes_gathered, p.bytes_reduced) for p in params]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        b.run_step(tok)
        _sync(device)
    b.comm = _trace.comm_from_events(prof.events())
    b.comm["source"] = "torch.profiler c10d:: operators, one step"
    b.comm["hidden_fraction"] = _trace.overlap_fraction(prof.events())
    if params:  # the weights' own counters: the bytes the job reports (launch/train.py _comm_bytes)
        gathered = sum(p.bytes_gathered - g for p, (g, _) in zip(params, own0))
        reduced = sum(p.bytes_reduced - r for p, (_, r) in zip(params, own0))
        b.comm.update(bytes_trace=b.comm["bytes"], bytes=gathered + reduced, bytes_all_gathered=gathered,
                      bytes_reduce_scattered=reduced, source="ShardedWeight bytes_gathered + bytes_reduced; "
                      "collectives from torch.profiler c10d:: operators, one step")


def _profile(b: Build, tok: torch.Tensor, device: torch.device, out: str, rank: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for t in (tok, tok):
            b.run_step(t)
        _sync(device)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{b.impl}_{b.precision}_{b.mode}_rank{rank}.json")
    prof.export_chrome_trace(path)
    idle = kinds = None
    if device.type == "cuda":  # where the device waited for the host: [Note: idle device time] in _trace.py
        with open(path) as f:
            trace = json.load(f)
        idle, kinds = _trace.idle_gaps(trace), _trace.kinds_of_trace(trace, steps=2)
    if rank == 0:
        print(f"== {b.name}: two steps, {path}\n{_trace.op_table(prof)}", flush=True)
        if idle is not None:
            print(_trace.idle_table(idle), flush=True)
        if kinds is not None:  # [Note: kernel time by kind] in _trace.py
            print(_trace.kinds_table(kinds), flush=True)
    return {"trace": path, "comm_hidden_fraction": _trace.overlap_fraction(prof.events()),
            "idle_ms": None if idle is None else idle["idle_us"] / 1e3,
            "kernel_ms_by_kind": None if kinds is None else {k: round(v, 3) for k, v in kinds.items()}}


def peak_bf16_tflops(device: torch.device) -> float | None:
    """Dense bf16 matmul throughput of this device (8192^3, median of 20); None on CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    bmat = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ bmat
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ bmat
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * 8192 ** 3 / statistics.median(times) / 1e9


# --- the run ---------------------------------------------------------------------------------------------

def _batches(corpus: MarkovCorpus, args, rt: dict, start: int, n: int) -> list[torch.Tensor]:
    """Global batches ``start+1 .. start+n`` (seeded by step), this rank's rows, on the device."""
    rows = args.batch // rt["world"]
    r = rt["rank"]
    return [corpus.global_batch(s, args.batch)[r * rows:(r + 1) * rows].to(rt["device"])
            for s in range(start + 1, start + n + 1)]


def _mean_over_ranks(x: torch.Tensor, rt: dict) -> float:
    x = x.detach().float().reshape(1).to(rt["device"])
    dist.all_reduce(x, group=rt["group"])
    return x.item() / rt["world"]


def _warm_up(specs: list[tuple[str, str, str]], cfg: MoEGPTConfig, corpus, rt: dict, args,
             not_run: list[dict]) -> list[Build]:
    """Builds each spec and runs its warm-up steps; a build that fails is reported and left out."""
    builds = []
    for impl, precision, mode in specs:
        try:
            b = make_build(impl, precision, mode, cfg, rt, args)
            losses = [b.run_step(tok) for tok in _batches(corpus, args, rt, 0, args.warmup)]
            _sync(rt["device"])
        except Exception as exc:  # every rank fails alike (same program); report, do not hide
            not_run.append({"impl": impl, "precision": precision, "mode": mode,
                            "why": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})
            _say(rt, f"  {impl}/{precision}/{mode}: not run ({not_run[-1]['why']})")
            continue
        b.loss1 = _mean_over_ranks(losses[0], rt)
        builds.append(b)
    return builds


def run_group(specs, cfg, corpus, rt: dict, args, not_run: list[dict]) -> list[Build]:
    """Warm-up, then interleaved rounds over the builds of one (precision, mode), then per-build extras."""
    builds = _warm_up(specs, cfg, corpus, rt, args, not_run)
    for r in range(args.rounds):
        start = args.warmup + r * args.steps
        batches = _batches(corpus, args, rt, start, args.steps)
        first = r % max(len(builds), 1)  # [Note: each build in each place of a round]
        for b in builds[first:] + builds[:first]:
            if not args.python_gc:  # [Note: garbage collection in the timed steps]
                gc.collect(1)
            _timed_block(b, batches, rt["device"])
    after = _batches(corpus, args, rt, args.warmup + args.rounds * args.steps, 1)[0]
    for b in builds:
        if b.mode in GRAPHED:
            b.comm = {"source": "not counted: the blocks' collectives replay inside the CUDA graphs"}
        else:
            _count_comm(b, after, rt["device"])
        if args.profile:
            b.facts.update(_profile(b, after, rt["device"], args.profile, rt["rank"]))
    return builds


def _say(rt: dict, msg: str) -> None:
    if rt["rank"] == 0:
        print(msg, flush=True)


def measurements(b: Build, cfg: MoEGPTConfig, args, rt: dict, peak_tflops: float | None) -> dict[str, tuple]:
    """metric -> (value, unit) for one build; CPU has no peak_gib or mfu (see the module docstring)."""
    ms = statistics.median(b.times_ms)
    tokens = args.batch * cfg.seq_len
    out = {"step_ms": (ms, "ms"), "tokens_per_s": (tokens / ms * 1e3, "tokens/s")}
    if "collectives" in b.comm:  # graphed builds: not counted (the module docstring says why)
        out.update(collectives_per_step=(b.comm["collectives"], "count"),
                   comm_bytes_per_step=(b.comm["bytes"], "bytes"))
    if rt["world"] > 1 and b.comm.get("hidden_fraction") is not None:  # _trace.overlap_fraction
        out["comm_hidden"] = (b.comm["hidden_fraction"], "fraction")
    if rt["device"].type == "cuda":
        peak = torch.tensor([float(b.peak_bytes)], device=rt["device"])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=rt["group"])
        out["peak_gib"] = (peak.item() / 2 ** 30, "GiB")
        flops = cfg.flops_per_token() * tokens / rt["world"] / (ms * 1e-3)
        out["mfu"] = (flops / (peak_tflops * 1e12), "fraction")
    return out


@dataclass(frozen=True)
class Seen:
    """What the loss check keeps of a build once its model is freed."""
    impl: str
    precision: str
    mode: str
    loss1: float

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.precision}/{self.mode}"


def _measure_group(specs, label: str, case: Callable[[str], str], cfg: MoEGPTConfig, corpus, rt: dict, args,
                   not_run: list[dict], peak_tflops: float | None, rows: list[dict], seen: list[Seen]) -> None:
    """Runs one group (a precision's builds of one mode, or of every mode with ``--together``) and appends its
    rows, each under ``case(its mode)``; its models are freed on return."""
    t0 = time.perf_counter()
    builds = run_group(specs, cfg, corpus, rt, args, not_run)
    _say(rt, f"  {label}: {', '.join(b.name for b in builds) or 'nothing'} measured ({time.perf_counter() - t0:.0f} s)")
    command = results.provenance(rt["device"])["command"]
    for b in builds:
        if b.allocator:
            _say(rt, f"    {b.name} allocator per timed step: " + ", ".join(
                f"{k} {v:g}" for k, v in _allocator_extras(b)["allocator_per_step"].items()))
        for metric, (value, unit) in measurements(b, cfg, args, rt, peak_tflops).items():
            rows.append({**results.row(bench="train_step", case=case(b.mode), impl=b.impl, precision=b.precision,
                                       world=rt["world"], metric=metric, value=value, unit=unit,
                                       device=rt["device"], command=command), **_extras(b, args, peak_tflops)})
        assert b.loss1 is not None
        seen.append(Seen(b.impl, b.precision, b.mode, b.loss1))
        if b.mode in GRAPHED and b.impl == "distwgrad":
            b.model.blocks[0].reset()  # releases the graphs' pool


def _check_losses(builds: list[Seen], rt: dict) -> list[dict]:
    """Step-1 losses side by side per precision; a gap above LOSS_ATOL is a failed check."""
    checks = []
    for precision in dict.fromkeys(b.precision for b in builds):
        group = [b for b in builds if b.precision == precision]
        # the plain eager build of this precision; every FP8 build (distwgrad's, torchao's) against plain bf16
        plain = {b.precision: b for b in builds if b.impl == "torch" and b.mode == "eager"}
        ref = (None if precision.startswith("fp8") else plain.get(precision)) or plain.get("bf16") or group[0]
        for b in group:
            diff = abs(b.loss1 - ref.loss1)
            checks.append({"build": b.name, "loss_step1": b.loss1, "reference": ref.name, "abs_diff": diff,
                           "atol": LOSS_ATOL[precision], "ok": diff <= LOSS_ATOL[precision]})
            own = next((e for e in group if e.impl == b.impl and e.mode == UNGRAPHED.get(b.mode)), None)
            if b.mode in GRAPHED and own is not None:  # shown, not gated: a replay runs its ungraphed kernels
                checks[-1]["vs_ungraphed_abs_diff"] = abs(b.loss1 - own.loss1)
    _say(rt, "step-1 loss (same weights, same data):")
    for c in checks:
        _say(rt, f"  {c['build']:32s} {c['loss_step1']:.7f}   |diff| vs {c['reference']} {c['abs_diff']:.2e} "
                 f"(atol {c['atol']:.0e}) {'ok' if c['ok'] else 'MISMATCH'}"
                 + (f"; vs its ungraphed build {c['vs_ungraphed_abs_diff']:.2e}"
                    if "vs_ungraphed_abs_diff" in c else ""))
    return checks


def _table(rows: list[dict], rt: dict) -> None:
    cols = ("step_ms", "tokens_per_s", "mfu", "peak_gib", "collectives_per_step", "comm_bytes_per_step",
            "comm_hidden")
    heads = ("ms/step", "tokens/s", "MFU", "peak GiB", "colls/step", "MiB/step", "comm hidden")
    table: dict[tuple, dict] = {}
    for r in rows:
        table.setdefault((r["precision"], r["impl"], r["case"].rsplit(" ", 1)[1]), {})[r["metric"]] = r["value"]
    _say(rt, f"{'precision':15s} {'impl':10s} {'mode':19s} " + " ".join(f"{h:>11s}" for h in heads))
    for (precision, impl, mode), vals in table.items():
        cells = []
        for c in cols:
            v = vals.get(c)
            cells.append("-" if v is None else f"{v / 2 ** 20:.2f}" if c == "comm_bytes_per_step" else
                         f"{v:.1%}" if c in ("mfu", "comm_hidden") else f"{v:,.0f}" if c == "tokens_per_s"
                         else f"{v:.2f}" if c != "collectives_per_step" else f"{v:.0f}")
        _say(rt, f"{precision:15s} {impl:10s} {mode:19s} " + " ".join(f"{c:>11s}" for c in cells))


def best_configurations(rows: list[dict]) -> list[dict]:
    """Each (precision, impl)'s fastest mode by tokens/s, what the issue's targets compare: ``vs_distwgrad``
    is distwgrad's best over a peer's best of the same precision, ``vs_bf16`` an FP8 recipe's best over
    distwgrad's own bf16 best (each where both ran)."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r["metric"] != "tokens_per_s":
            continue
        key, mode = (r["precision"], r["impl"]), r["case"].rsplit(" ", 1)[1]
        if key not in best or r["value"] > best[key]["tokens_per_s"]:
            best[key] = {"precision": r["precision"], "impl": r["impl"], "mode": mode, "tokens_per_s": r["value"]}
    for (precision, impl), b in best.items():
        ours = best.get((precision, "distwgrad"))
        if impl != "distwgrad" and ours is not None:
            b["vs_distwgrad"] = ours["tokens_per_s"] / b["tokens_per_s"]
        bf16 = best.get(("bf16", "distwgrad"))
        if impl == "distwgrad" and precision.startswith("fp8") and bf16 is not None:
            b["vs_bf16"] = b["tokens_per_s"] / bf16["tokens_per_s"]
    return list(best.values())


def _best_table(best: list[dict], rt: dict) -> None:
    _say(rt, "best configuration (tokens/s; distwgrad's best over a peer's best, an FP8 recipe's over distwgrad's "
             "bf16):")
    for b in best:
        ratio = (f"distwgrad {b['vs_distwgrad']:.3f}x" if "vs_distwgrad" in b else
                 f"{b['vs_bf16']:.3f}x distwgrad bf16" if "vs_bf16" in b else "")
        _say(rt, f"  {b['precision']:15s} {b['impl']:10s} {b['mode']:19s} {b['tokens_per_s']:>11,.0f}   {ratio}")


def _runtime() -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(minutes=20)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return {"device": device, "rank": dist.get_rank(), "world": world, "group": dist.group.WORLD,
            "mesh": init_device_mesh(device.type, (world,))}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a preset of the training job (launch/config.py PRESETS: "
                   "sizes, batch, microbatches)")
    for f in dataclasses.fields(MoEGPTConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                       help=f"override the preset's {f.name} (default without --model: {f.default})")
    p.add_argument("--batch", type=int, default=None, help="sequences per step over all ranks (default: preset)")
    p.add_argument("--microbatches", type=int, default=None, help="per rank per step (default: preset)")
    p.add_argument("--no-fp8-weight-cache", action="store_true", help="quantize FP8 weights at every use, not once "
                   "a step (the job's --no-fp8-weight-cache; the rows' case says so with several microbatches)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    p.add_argument("--precisions", default="bf16,fp8_per_tensor,fp8_blockwise",
                   help="comma-separated subset of " + ",".join(PRECISIONS))
    p.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp32"),
                   help="compute dtype of the weights under the FP8 recipes (fp32 precision: fp32)")
    p.add_argument("--modes", default="eager,compiled", help="comma-separated subset of eager, compiled (torch.compile "
                   "per block), cuda_graph (each block replayed from CUDA graphs; CUDA only), compiled_cuda_graph "
                   "(both: compiled blocks replayed from CUDA graphs; CUDA only)")
    p.add_argument("--cuda-graph", action="store_true", help="also time each build with its transformer blocks "
                   "replayed from CUDA graphs (adds mode cuda_graph; distwgrad and plain torch, not FSDP2; CUDA only)")
    p.add_argument("--together", action="store_true", help="time every mode of a precision in one group of rounds "
                   "(all its builds alive at once), so that builds of different modes, a best configuration against "
                   "another, are timed as fairly as builds of one mode ([Note: each build in each place of a round])")
    p.add_argument("--warmup", type=int, default=3, help="steps per build before timing")
    p.add_argument("--rounds", type=int, default=6, help="rounds over the builds, each starting with the next "
                   "build ([Note: each build in each place of a round])")
    p.add_argument("--steps", type=int, default=5, help="steps per build per round")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="a torch.profiler trace per build in DIR, with its op table, and on CUDA its idle device "
                   "time and kernel time by kind (GEMMs, quantization, optimizer, attention, other)")
    p.add_argument("--python-gc", action="store_true", help="leave Python's automatic garbage collection on in "
                   "the timed steps (default: off, a generation-1 collection before each build's block, as torchtitan "
                   "trains)")
    p.add_argument("--json", default=None, help="also write rows, losses and checks to this file")
    results.add_arguments(p)  # --no-record, --results
    args = p.parse_args(argv)
    for name, allowed in (("impls", IMPLS), ("precisions", PRECISIONS), ("modes", MODES)):
        chosen = tuple(v for v in getattr(args, name).split(",") if v)
        if not chosen or any(v not in allowed for v in chosen):
            p.error(f"--{name} {getattr(args, name)!r}: choose from {','.join(allowed)}")
        setattr(args, name, chosen)
    if args.cuda_graph and "cuda_graph" not in args.modes:
        args.modes += ("cuda_graph",)
    if set(GRAPHED) & set(args.modes) and not torch.cuda.is_available():
        p.error("--cuda-graph (modes cuda_graph, compiled_cuda_graph) needs a CUDA device: CUDA graphs capture CUDA "
                "kernels, and CUDA is not available on this machine")
    if min(args.warmup, args.rounds, args.steps) < 1:
        p.error("--warmup, --rounds and --steps must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rt = _runtime()
    collecting = gc.isenabled()
    if not args.python_gc:
        gc.disable()  # [Note: garbage collection in the timed steps]
    try:
        return _main(args, rt)
    finally:
        if collecting:
            gc.enable()
        dist.destroy_process_group()


def case_name(preset: str, batch: int, seq_len: int, microbatches: int, mode: str, every_use: bool = False) -> str:
    """The rows' ``case``: ``large b8x2048 eager``, with ``mb2`` before the mode when the step accumulates over
    microbatches (a step of two microbatches is another measurement than one of the same batch in one), and
    ``(fp8 weights at every use)`` after it for ``--no-fp8-weight-cache``; the mode is the last word."""
    mb = f" mb{microbatches}" if microbatches > 1 else ""
    return f"{preset} b{batch}x{seq_len}{mb}{' (fp8 weights at every use)' if every_use else ''} {mode}"


def _main(args, rt: dict) -> int:
    name, cfg, args.batch, args.microbatches = model_config(args)
    if args.batch % (rt["world"] * args.microbatches):
        raise ValueError(f"--batch {args.batch} must divide over {rt['world']} ranks x {args.microbatches} "
                         f"microbatches")
    torch.manual_seed(0)
    corpus = MarkovCorpus(cfg.vocab_size, cfg.seq_len, cfg.seed)
    peak_tflops = peak_bf16_tflops(rt["device"])
    _say(rt, f"{name}: {cfg}\nbatch {args.batch} x {cfg.seq_len} on {rt['world']} rank(s), {rt['device'].type}; "
             f"dense bf16 peak " + (f"{peak_tflops:.0f} TFLOP/s (measured)" if peak_tflops else "n/a (CPU: no MFU)")
             + "; peak memory " + ("per build" if rt["device"].type == "cuda" else "n/a (CPU: not separable)"))
    not_run: list[dict] = []
    for precision in args.precisions:
        for impl in args.impls:
            if _peer_fp8_why(impl, precision, rt):
                not_run.append({"impl": impl, "precision": precision, "mode": "*",
                                "why": _peer_fp8_why(impl, precision, rt)})
            else:
                not_run += [{"impl": impl, "precision": precision, "mode": mode, "why": _graph_why(impl, precision, rt)}
                            for mode in args.modes if mode in GRAPHED and _graph_why(impl, precision, rt)]
    rows: list[dict] = []
    seen: list[Seen] = []
    def case(mode: str) -> str:
        every_use = args.no_fp8_weight_cache and args.microbatches > 1
        return case_name(name, args.batch, cfg.seq_len, args.microbatches, mode, every_use=every_use)

    for precision in args.precisions:
        for modes in [args.modes] if args.together else [(m,) for m in args.modes]:
            specs = [(i, precision, mode) for mode in modes for i in args.impls
                     if not _peer_fp8_why(i, precision, rt)
                     and not (mode in GRAPHED and _graph_why(i, precision, rt))]
            _measure_group(specs, f"{precision}/{'+'.join(modes)}", case, cfg, corpus, rt, args, not_run, peak_tflops,
                           rows, seen)
            gc.collect()  # a graphed module's forward refers to the module: a cycle holding its graphs
            if rt["device"].type == "cuda":
                torch.cuda.empty_cache()
    checks = _check_losses(seen, rt)
    _table(rows, rt)
    best = best_configurations(rows)
    _best_table(best, rt)
    for n in not_run:
        _say(rt, f"not run: {n['impl']}/{n['precision']}/{n['mode']}: {n['why']}")
    results.record(rows, args)
    if args.json and rt["rank"] == 0:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "best": best, "loss_checks": checks, "not_run": not_run, "model_config": vars(cfg),
                       "peak_bf16_tflops": peak_tflops}, f, indent=1, default=str)
    return 0 if all(c["ok"] for c in checks) else 1


def _extras(b: Build, args, peak_tflops: float | None) -> dict[str, Any]:
    comm = {k: v for k, v in b.comm.items() if k != "by_kind"}
    if "by_kind" in b.comm:
        comm["by_kind"] = {k: {"count": n, "bytes": nb} for k, (n, nb) in b.comm["by_kind"].items()}
    return {**b.facts, "comm": comm, "loss_step1": b.loss1, "microbatches": args.microbatches,
            "timing": f"median of {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, "
                      f"interleaved{' with every mode of its precision' if args.together else ''}, order rotated",
            "rounds_ms": [round(t, 4) for t in b.times_ms],
            "python_gc": "automatic" if args.python_gc else "off, gc.collect(1) before each block",
            "peak_bf16_tflops": peak_tflops, **_allocator_extras(b)}


def _allocator_extras(b: Build) -> dict[str, Any]:
    if not b.allocator:
        return {}
    return {"allocator_per_step": {k: round(n / b.timed_steps, 2) for k, n in b.allocator.items()}}


def _peer_fp8_why(impl: str, precision: str, rt: dict) -> str | None:
    """Why a peer's FP8 build is not run (None: it runs, or it is no peer's FP8 build)."""
    if impl == "distwgrad" or not precision.startswith("fp8"):
        return None
    return _torchao_fp8.peer_why(precision, rt["device"])


if __name__ == "__main__":
    sys.exit(main())
