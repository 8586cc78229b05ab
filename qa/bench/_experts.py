"""Expert parallelism measured ([Note: expert-parallel dispatch] in ``distwgrad/parallel/experts.py``).

    torchrun --standalone --nproc-per-node 4 qa/bench/parallelism.py experts --no-record              # CPU ranks, gloo
    python qa/bench/parallelism.py experts --compute --model large --no-record                        # one GPU

Under torchrun (CPU ranks over gloo, the job's ``--model`` preset): one process trains, side by side and in
rotated rounds, ``MoEGPT`` at each ``--ep`` size (1: every weight sharded over every rank, coalesced as the
job runs it) with and without the overlap of the dispatch's backward ([Note: the dispatch's backward hides
behind the experts' wgrads]), and the FSDP2 build of the same model (``fully_shard`` per block). Per build
and rank, per step: the time (median of ``--steps`` after ``--warmup``), the bytes each collective moved,
and for expert parallelism the seconds waited on all-to-alls. Bytes: distwgrad's all-gather outputs and
reduce-scatter inputs (``bytes_gathered``, ``bytes_reduced``) and the all-to-all payloads sent; FSDP2's
from its parameters: each block's all-gather in forward and again in backward, the reduce-scatter of its
gradients, every microbatch. The hidden fraction is one minus the exposed all-to-all time with the overlap
over that without it. Every rank shares the same CPU cores, so times are ratios within this run, never
absolute.

``--compute`` (one GPU, bf16): the experts' work on one rank at ``E / ep`` local experts for each ``--ep``,
the rows a rank receives when routing is uniform (its ``tokens x top_k`` assignments, spread over its local
experts): fc1, GELU and fc2 forward, the input gradients, the deferred wgrads, each timed apart. With the
``--nvlink-gbps`` bandwidth it prints the model of one layer's step at ``ep x dp = --world`` GPUs
(docs/experts.md, "Measured").

Rows: ``bench`` "experts"; CPU: ``impl`` "distwgrad ep=N" / "distwgrad ep=N no-overlap" / "fsdp2", metrics
``step_ratio`` (to ep 1), ``bytes_per_step``, ``hidden_fraction``; GPU: ``impl`` "distwgrad", case
"experts ep=N", metrics ``fwd_ms``, ``dgrad_ms``, ``wgrad_ms``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import distwgrad  # noqa: E402
from distwgrad.models import MoEGPT  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from launch.step import comm_bytes, forward_backward  # noqa: E402
from qa.bench import results  # noqa: E402


def _fsdp2_bytes(model, param_bytes: int, micro: int) -> int:
    """FSDP2's bytes a step, counted as distwgrad counts its own: each microbatch all-gathers every parameter
    in forward and again in backward (``reshard_after_forward``) and reduce-scatters its gradient in fp32
    (FSDP2's default: gradients sync in every backward)."""
    n = sum(p.numel() for p in model.parameters())
    return micro * (2 * n * param_bytes + n * 4)


def _builds(config: TrainConfig, eps: list[int]):
    """(name, model, ep or None) for each build, weights from the same seed."""
    world = dist.get_world_size()
    mc = config.model_config()
    for ep in eps:
        for overlap in (True, False) if ep > 1 else (True,):
            mesh = None
            if ep > 1:
                from torch.distributed.device_mesh import init_device_mesh
                mesh = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "dp"))
            model = MoEGPT(mc, ep_mesh=mesh)
            if ep == 1 and world > 1:
                distwgrad.coalesce(model)  # as the job does without --ep ([Note: coalesced units])
            expert = model.blocks[0].moe.ep
            if expert is not None:
                expert.overlap_wgrads = overlap
            yield f"distwgrad ep={ep}" + ("" if overlap else " no-overlap"), model, expert
    from torch.distributed.fsdp import fully_shard
    model = MoEGPT(mc, sharded=False)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    yield "fsdp2", model, None


def _step(name: str, model, tokens: torch.Tensor, micro: int) -> None:
    """The job's step without the optimizer (its ``forward_backward``: each microbatch's wgrads drained)."""
    if name == "fsdp2":
        for mb in tokens.chunk(micro):
            (model.loss(mb[:, :-1], mb[:, 1:]) / micro).backward()
    else:
        forward_backward(model, tokens, micro)
        distwgrad.finalize_model_grads([model])
    for p in model.parameters():
        p.grad = None


def cpu_ranks(args) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = TrainConfig(model=args.model, n_layers=args.n_layers, global_batch=args.global_batch, device="cpu")
    mc = config.model_config()
    eps = [e for e in args.ep if world % e == 0 and mc.n_experts % e == 0]
    builds = list(_builds(config, eps))
    local = config.global_batch // world
    times: dict[str, list[float]] = {name: [] for name, _, _ in builds}
    counted: dict[str, tuple[float, float]] = {}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, mc.vocab_size, (config.global_batch, mc.seq_len + 1),
                               generator=torch.Generator().manual_seed(step))[rank * local:(rank + 1) * local]
        for name, model, ep in builds[step % len(builds):] + builds[:step % len(builds)]:  # rotated rounds
            before = (sum(comm_bytes(model)) if name != "fsdp2" else 0, ep.bytes_sent if ep else 0,
                      ep.exposed_s if ep else 0.0)
            dist.barrier()
            t0 = time.perf_counter()
            _step(name, model, tokens, config.microbatches)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
                weights = (sum(comm_bytes(model)) - before[0] if name != "fsdp2"
                           else _fsdp2_bytes(model, 4, config.microbatches))
                a2a = (ep.bytes_sent - before[1]) if ep else 0
                exposed = (ep.exposed_s - before[2]) if ep else 0.0
                b, e = counted.get(name, (0.0, 0.0))
                counted[name] = (b + (weights + a2a) / args.steps, e + exposed / args.steps)
    mine = {name: (statistics.median(t), *counted[name]) for name, t in times.items()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        _report_cpu(args, config, every, world)
    dist.destroy_process_group()


def _report_cpu(args, config: TrainConfig, every: list[dict], world: int) -> None:
    names = list(every[0])
    step = {n: max(r[n][0] for r in every) for n in names}  # the slowest rank sets the step
    nbytes = {n: statistics.mean(r[n][1] for r in every) for n in names}
    exposed = {n: statistics.mean(r[n][2] for r in every) for n in names}
    base = step[names[0]]
    print(f"{world} CPU ranks (gloo), --model {args.model}, {config.n_layers} layers, batch {config.global_batch}, "
          f"{args.steps} steps after {args.warmup}")
    print(f"{'build':28} {'step / ep=1':>11} {'MB a rank a step':>17} {'a2a exposed ms':>15}")
    rows = []
    case = f"{args.model} L={config.n_layers} batch {config.global_batch}"
    for n in names:
        print(f"{n:28} {step[n] / base:11.3f} {nbytes[n] / 1e6:17.2f} {exposed[n] * 1e3:15.2f}")
        rows.append(results.row(bench="experts", case=case, impl=n, precision="fp32", world=world,
                                metric="step_ratio", value=step[n] / base, unit="x", device="cpu"))
        rows.append(results.row(bench="experts", case=case, impl=n, precision="fp32", world=world,
                                metric="bytes_per_step", value=nbytes[n], unit="B", device="cpu"))
    for n in names:
        off = f"{n} no-overlap"
        if off in exposed and exposed[off] > 0:
            hidden = 1 - exposed[n] / exposed[off]
            print(f"{n}: the overlap hides {hidden:.0%} of the exposed all-to-all time "
                  f"({exposed[off] * 1e3:.2f} -> {exposed[n] * 1e3:.2f} ms a step)")
            rows.append(results.row(bench="experts", case=case, impl=n, precision="fp32", world=world,
                                    metric="hidden_fraction", value=hidden, unit="fraction", device="cpu"))
    results.record(rows, args)


def _time_ms(fn, device: torch.device) -> float:
    """One call of ``fn``, in milliseconds (CUDA events on a GPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _expert_times(L: int, A: int, D: int, Fd: int, args) -> tuple[float, float, float]:
    """Milliseconds of ``L`` experts' forward, input gradients and deferred wgrads on ``A`` rows (bf16)."""
    import torch.nn.functional as F

    from distwgrad.nn import GroupedLinear

    dev, dt = torch.device(args.device), torch.bfloat16
    split = [A // L + (i < A % L) for i in range(L)]
    fc1, fc2 = (GroupedLinear(L, n, m, bias=False, params_dtype=dt, device=dev, delay_wgrad_compute=True,
                              single_grouped_weight=True) for n, m in ((D, Fd), (Fd, D)))
    x = torch.randn(A, D, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(A, D, device=dev, dtype=dt)
    state = {}

    def fwd():
        state["y"] = fc2(F.gelu(fc1(x, split)), split)

    def wgrad():
        fc2.backward_dw()
        fc1.backward_dw()

    for _ in range(args.warmup):
        fwd()
        state["y"].backward(dy)
        wgrad()
    f_ms, b_ms, w_ms = [], [], []
    for _ in range(args.steps):
        f_ms.append(_time_ms(fwd, dev))
        b_ms.append(_time_ms(lambda: state["y"].backward(dy), dev))
        w_ms.append(_time_ms(wgrad, dev))
    return statistics.median(f_ms), statistics.median(b_ms), statistics.median(w_ms)


def compute(args) -> None:
    """The experts' work on one rank at each ep size, and the model of the multi-GPU layer step."""
    config = TrainConfig(model=args.model, global_batch=args.global_batch, n_experts=args.n_experts,
                         device=args.device)
    mc = config.model_config()
    D, Fd, E, k = mc.d_model, mc.d_ff, mc.n_experts, mc.top_k
    tokens = config.global_batch // args.world * mc.seq_len  # a rank's tokens a step (one microbatch)
    A = tokens * k  # the rows a rank sends, and (uniform routing) receives
    rows, table = [], []
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for ep in (e for e in args.ep if E % e == 0):
        f_ms, b_ms, w_ms = _expert_times(E // ep, A, D, Fd, args)
        table.append((ep, E // ep, f_ms, b_ms, w_ms))
        case = f"experts ep={ep} {args.model} E={E} tokens={tokens}"
        for metric, value in (("fwd_ms", f_ms), ("dgrad_ms", b_ms), ("wgrad_ms", w_ms)):
            rows.append(results.row(bench="experts", case=case, impl="distwgrad", precision="bf16", world=1,
                                    metric=metric, value=value, unit="ms", device=torch.device(args.device)))
    print(f"{name}, --model {args.model}: a rank's {tokens} tokens x top_k {k} = {A} rows, "
          f"D {D}, d_ff {Fd}, {E} experts, bf16")
    print(f"{'ep':>3} {'local':>5} {'fwd ms':>7} {'dgrad ms':>9} {'wgrad ms':>9}")
    for ep, L, f, b, w in table:
        print(f"{ep:3d} {L:5d} {f:7.3f} {b:9.3f} {w:9.3f}")
    _model(args, table, A, D, Fd, E)
    results.record(rows, args)


def _model(args, table, A: int, D: int, Fd: int, E: int) -> None:
    """One MoE layer's step on ``--world`` GPUs at ``ep x dp`` (docs/experts.md, "Measured"): compute measured
    above; communication at ``--nvlink-gbps`` each way per GPU."""
    bw = args.nvlink_gbps * 1e9
    print(f"\nmodel, {args.world} GPUs, {args.nvlink_gbps:.0f} GB/s a GPU each way; ms per layer a step")
    print(f"{'ep':>3} {'dp':>3} {'experts':>8} {'gather+RS':>10} {'a2a':>7} {'a2a hidden':>10} {'exposed':>8} "
          f"{'step':>7}")
    for ep, _L, f, b, w in table:
        if args.world % ep:
            continue
        dp = args.world // ep
        # the local experts' weights (bf16, 2 GEMMs of Fd x D each) gathered twice over dp, their fp32
        # gradient reduce-scattered: each GPU receives / sends (dp - 1) / dp of them
        local_w = E // ep * 2 * Fd * D
        weights = (2 * local_w * 2 + local_w * 4) * (dp - 1) / dp
        # each row out and back, forward and backward, bf16; (ep - 1) / ep of the rows leave the GPU
        a2a = 4 * A * D * 2 * (ep - 1) / ep
        weights_ms, a2a_ms = weights / bw * 1e3, a2a / bw * 1e3
        hidden = min(a2a_ms / 4, w)  # the dispatch's backward (one of four) behind the wgrads
        # the gathers are prefetched and the reductions asynchronous: they hide behind the experts' compute
        # as far as it lasts; the all-to-alls are on the critical path but for the hidden one
        exposed = max(0.0, weights_ms - (f + b + w)) + a2a_ms - hidden
        print(f"{ep:3d} {dp:3d} {f + b + w:8.3f} {weights_ms:10.3f} {a2a_ms:7.3f} {hidden:10.3f} {exposed:8.3f} "
              f"{f + b + w + exposed:7.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compute", action="store_true", help="the experts' compute on one GPU, and the model")
    p.add_argument("--model", default="small", help="the job's preset (default: small; --compute: large)")
    p.add_argument("--n-layers", type=int, default=None, help="blocks (default: the preset's)")
    p.add_argument("--n-experts", type=int, default=None, help="--compute: experts a layer (default: the preset's)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences a step (default: the preset's)")
    p.add_argument("--ep", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="ep sizes, comma-separated (default: 1,2,4 on CPU ranks, 1,2,4,8 with --compute)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="--compute: cuda, or cpu for a smoke run")
    p.add_argument("--world", type=int, default=8, help="--compute: the GPUs the model spreads over")
    p.add_argument("--nvlink-gbps", type=float, default=350.0,
                   help="--compute: the model's all-to-all and all-gather bandwidth a GPU each way")
    results.add_arguments(p)
    args = p.parse_args(argv)
    if args.compute:
        args.ep = args.ep or [1, 2, 4, 8]
        compute(args)
    else:
        args.ep = args.ep or [1, 2, 4]
        cpu_ranks(args)
