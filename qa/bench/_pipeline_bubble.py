"""Each pipeline schedule's measured step time and bubble beside the simulator's prediction from the same
run's stage times ([Note: the pipeline simulator] in ``distwgrad/parallel/simulate.py``).

    torchrun --standalone --nproc-per-node 2 qa/bench/parallelism.py pipeline --no-record
    torchrun --standalone --nproc-per-node 4 qa/bench/parallelism.py pipeline --microbatches 8 --no-record

One pipeline rank per process (dp 1), the job's MoE GPT (``--model`` preset, ``--n-layers``) cut into each
schedule's stages. Per schedule: ``--warmup`` steps, then ``--steps`` timed ones (each a barrier, the
schedule's step and the finalize, then a barrier). Measured: the step's wall time, each rank's busy time
(the sum of its stages' F, B and W actions) and so its idle over busy time (the bubble); each stage's mean
F, B (the input gradient) and W (the deferred wgrads) times feed the simulator, with the measured time of one
microbatch's activations sent between two ranks as the transfer cost. On a CPU every rank shares the same
cores, so the measured times carry contention the simulator does not model.

Rows: ``bench`` "pipeline_bubble", ``impl`` the schedule, metrics ``step_ms``, ``predicted_step_ms``,
``bubble``, ``predicted_bubble`` (``--no-record``).

``--layer-times`` measures the simulator's inputs alone, in one process on one device (a GPU where there is
one, in bf16): ``--n-layers`` blocks of the preset as a middle stage, one microbatch's F (forward), B (the
input gradient, the wgrads queued) and W (the queued wgrads) timed apart, each ``--steps`` times after
``--warmup``, divided by the layer count; it prints the ``distwgrad.parallel.simulate`` command to feed them to.

    torchrun --standalone --nproc-per-node 1 qa/bench/parallelism.py pipeline --layer-times --model large \\
        --n-layers 2 --global-batch 8 --microbatches 8 --no-record
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

from distwgrad.parallel import SCHEDULES  # noqa: E402
from distwgrad.parallel.simulate import StageTimes, analytic_bubble, simulate  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from launch.pipeline import build_pipeline  # noqa: E402
from qa.bench import results  # noqa: E402


def _transfer_ms(shape: tuple[int, ...], repeats: int = 20) -> float:
    """One microbatch's activations sent from rank 0 to rank 1 and back, halved (median of ``repeats``)."""
    t = torch.zeros(shape)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif dist.get_rank() == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        samples.append((time.perf_counter() - t0) * 1e3 / 2)
    out = [statistics.median(samples)]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def _measure(args, schedule: str) -> dict:
    world = dist.get_world_size()
    config = TrainConfig(model=args.model, n_layers=args.n_layers, pp=world, pp_schedule=schedule,
                         microbatches=args.microbatches, global_batch=args.global_batch, device="cpu")
    pipe = build_pipeline(config, world, torch.device("cpu"), None)
    mc = config.model_config()
    walls, busy, stage_samples = [], [], {}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, mc.vocab_size, (config.global_batch, mc.seq_len + 1),
                               generator=torch.Generator().manual_seed(step))
        dist.barrier()
        t0 = time.perf_counter()
        pipe.forward_backward(tokens)
        pipe.finalize()
        wall = time.perf_counter() - t0
        dist.barrier()
        for p in pipe.model.parameters():
            p.grad = None
        if step < args.warmup:
            continue
        walls.append(wall * 1e3)
        busy.append(1e3 * sum(sum(v) for s in pipe.stages for v in s.times.values()))
        for s in pipe.stages:
            stage_samples.setdefault(s.stage_index, []).append({k: 1e3 * sum(v) / len(v) for k, v in s.times.items()})
    mine = {i: {k: statistics.median(x[k] for x in xs) for k in ("F", "B", "W")} for i, xs in stage_samples.items()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (statistics.median(walls), statistics.median(busy), mine))
    return {"step_ms": max(g[0] for g in gathered), "busy_ms": [g[1] for g in gathered],
            "stages": {i: t for g in gathered for i, t in g[2].items()},
            "activation": (config.global_batch // config.microbatches, mc.seq_len, mc.d_model)}


def _layer_times(args) -> None:
    """``--layer-times``: one layer's F, B and W milliseconds (median over ``--steps`` microbatches)."""
    import distwgrad
    from distwgrad.models.moe_gpt_stage import MoEGPTStage

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else None
    config = TrainConfig(model=args.model, n_layers=args.n_layers, microbatches=args.microbatches,
                         global_batch=args.global_batch, device=device.type)
    mc = config.model_config()
    stage = MoEGPTStage(mc, range(args.n_layers), first=False, last=False, device=device, param_dtype=dtype)
    rows = config.global_batch // config.microbatches
    x = torch.randn(rows, mc.seq_len, mc.d_model, device=device, dtype=dtype or torch.float32, requires_grad=True)
    g = torch.randn_like(x)

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timed.result = out
        return (time.perf_counter() - t0) * 1e3

    samples = {"F": [], "B": [], "W": []}
    for i in range(args.warmup + args.steps):
        f = timed(lambda: stage(x))
        b = timed(lambda: timed.result.backward(g))
        w = timed(lambda: distwgrad.drain_deferred_wgrads(stage))
        distwgrad.finalize_model_grads([stage])
        for p_ in stage.parameters():
            p_.grad = None
        x.grad = None
        if i >= args.warmup:
            for k, v in zip("FBW", (f, b, w)):
                samples[k].append(v / args.n_layers)
    f, b, w = (statistics.median(samples[k]) for k in "FBW")
    print(f"{args.model}, {args.n_layers} layers, microbatch {rows} x {mc.seq_len} on {device} "
          f"({dtype or torch.float32}): one layer's F / B / W ms {f:.3f} / {b:.3f} / {w:.3f}")
    layers = TrainConfig(model=args.model, device=device.type).model_config().n_layers  # the preset's
    print(f"python -m distwgrad.parallel.simulate --layer-ms {f:.3f} {b:.3f} {w:.3f} --layers {layers} "
          "--comm-ms <one microbatch's transfer between two devices>")
    rows_out = [results.row(bench="pipeline_bubble", case=f"{args.model} one layer, microbatch {rows}x{mc.seq_len}",
                            impl="distwgrad", precision="bf16" if dtype else "fp32", world=1,
                            metric=f"layer_{k}_ms", value=v, unit="ms", device=device)
                for k, v in zip("FBW", (f, b, w))]
    results.record(rows_out, args)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layer-times", action="store_true", help="only one layer's F, B and W times, one process")
    results.add_arguments(p)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    if args.layer_times:
        _layer_times(args)
        dist.destroy_process_group()
        return
    torch.set_num_threads(1)
    world, rows, table = dist.get_world_size(), [], []
    comm = None
    for schedule in args.schedules.split(","):
        m = _measure(args, schedule)
        comm = _transfer_ms(m["activation"]) if comm is None else comm
        times = {i: StageTimes(t["F"], t["B"], t["W"]) for i, t in m["stages"].items()}
        pred = simulate(schedule, world, args.microbatches, times, comm_ms=comm)
        bubble = sum(m["step_ms"] / b - 1 for b in m["busy_ms"]) / world
        per_layer = args.n_layers / len(times)
        layer = [statistics.mean(getattr(t, k) for t in times.values()) / per_layer for k in ("f", "i", "w")]
        table.append((schedule, m["step_ms"], pred.step_ms, bubble, pred.bubble, layer))
        case = f"{args.model} L={args.n_layers} pp={world} m={args.microbatches} comm={comm:.3f}ms"
        for metric, value, unit in (("step_ms", m["step_ms"], "ms"), ("predicted_step_ms", pred.step_ms, "ms"),
                                    ("bubble", bubble, "ratio"), ("predicted_bubble", pred.bubble, "ratio")):
            rows.append(results.row(bench="pipeline_bubble", case=case, impl=schedule, precision="fp32", world=world,
                                    metric=metric, value=value, unit=unit, device="cpu"))
    if dist.get_rank() == 0:
        one_f1b = analytic_bubble(world, args.microbatches)["1F1B"]
        print(f"pp={world}, {args.microbatches} microbatches, {args.n_layers} layers ({args.model}); transfer "
              f"{comm:.3f} ms; analytic 1F1B bubble (p-1)/m = {one_f1b:.3f}")
        print("| schedule | step ms | predicted | bubble | predicted | one layer's F / B / W ms |")
        print("|---|---|---|---|---|---|")
        for s, step, pstep, b, pb, layer in table:
            print(f"| {s} | {step:.1f} | {pstep:.1f} | {b:.3f} | {pb:.3f} | {' / '.join(f'{v:.2f}' for v in layer)} |")
        results.record(rows, args)
    dist.destroy_process_group()
