"""Host time against device time for each phase of one training step: where a step waits on Python.

    # one H200: distwgrad and plain torch, eager and compiled, with the host's hottest functions
    python qa/bench/step_phases.py --model large --batch 8 --impls distwgrad,torch --cprofile 25
    # CPU smoke run (host times only: on CPU the host does the compute)
    python qa/bench/step_phases.py --model tiny --modes eager --steps 1

The builds are ``train_step.py``'s (same model, weights, data, optimizer; one microbatch, one rank). A
step is cut into phases: forward, backward, and for distwgrad the deferred-wgrad drain and
``finalize_model_grads``, then the optimizer (step and ``zero_grad``). Two measurements per phase, each
the median over ``--steps`` steps:

* host: the wall time the host spends issuing the phase, starting on an idle device (synchronised before
  the phase, not after), so the device never holds the host back unless the phase itself waits on it.
* device: the time the device needs for the phase's work alone. A ``torch.cuda._sleep`` kernel keeps the
  device busy while the host issues the whole phase; events recorded after the sleep and after the phase
  then time the phase's kernels back to back. The sleep is twice the phase's median host time (at least
  ``--sleep-ms``), so the host has issued the phase before the device reaches it.

A phase whose host time exceeds its device time leaves the device idle in a real step unless the host ran
ahead in an earlier phase; ``real step`` is the build's median step time without the cuts, for comparison.
``--cprofile N`` prints the N functions with the most own host time over one extra step of each build
(cProfile, synchronised between phases like the host measurement; autograd's multithreading is off for
that step, so backward's Python runs on the profiled thread). Python that torch's C++ calls back into
(autograd functions' ``forward``/``backward``, custom ops' implementations) is often missed by cProfile: its
time then shows as the own time of the caller (``Function.apply``, ``run_backward``, ``backend_impl``).
Rows go to the results file (bench ``step_phases``, metrics ``host_ms`` and ``device_ms``, the phase in
``case``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402
import train_step as ts  # noqa: E402

import distwgrad  # noqa: E402
from distwgrad.data import MarkovCorpus  # noqa: E402
from distwgrad.fp8.weights import sync_weight_amax  # noqa: E402

PHASES = ("forward", "backward", "drain", "finalize", "optimizer")


def phases(b: ts.Build, tok: torch.Tensor) -> Iterator[str]:
    """Runs one step of ``b``, yielding each phase's name once its work is issued."""
    if b.impl == "distwgrad":
        train = ts._launch_train()
        recipe = b.precision if b.precision.startswith("fp8") else "none"
        with train._RECIPES[recipe]():
            if recipe.startswith("fp8_per_tensor"):
                sync_weight_amax(b.model)
            loss = b.model.loss(tok[:, :-1], tok[:, 1:])
            yield "forward"
            loss.backward()
            yield "backward"
        distwgrad.drain_deferred_wgrads(b.model)
        yield "drain"
        distwgrad.finalize_model_grads([b.model])
        yield "finalize"
    else:
        loss = ts._loss(b.model, tok)
        yield "forward"
        loss.backward()
        yield "backward"
    b.optimizer.step()
    b.optimizer.zero_grad(set_to_none=True)
    yield "optimizer"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_ms(b: ts.Build, tok: torch.Tensor, device: torch.device) -> dict[str, float]:
    out, step = {}, phases(b, tok)
    while True:
        _sync(device)
        t0 = time.perf_counter()
        name = next(step, None)
        if name is None:
            return out
        out[name] = (time.perf_counter() - t0) * 1e3


def _cycles_per_ms(device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def device_ms(b: ts.Build, tok: torch.Tensor, device: torch.device, sleep_ms: dict[str, float],
              cycles_per_ms: float) -> dict[str, float]:
    out, step = {}, phases(b, tok)
    names = iter(PHASES if b.impl == "distwgrad" else ("forward", "backward", "optimizer"))
    while True:
        _sync(device)
        planned = next(names, None)
        if planned is not None:
            torch.cuda._sleep(int(sleep_ms[planned] * cycles_per_ms))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        name = next(step, None)
        if name is None:
            return out
        end.record()
        end.synchronize()
        out[name] = start.elapsed_time(end)


def profile_host(b: ts.Build, tok: torch.Tensor, device: torch.device, top: int) -> str:
    prof = cProfile.Profile()
    step = phases(b, tok)
    # autograd runs a CUDA backward on its own device thread, out of a profiler enabled on this one
    with torch.autograd.set_multithreading_enabled(False):
        while True:
            _sync(device)
            prof.enable()
            name = next(step, None)
            prof.disable()
            if name is None:
                break
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in s.getvalue().splitlines() if line.strip())


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def measure(b: ts.Build, batches: list[torch.Tensor], device: torch.device, min_sleep_ms: float
            ) -> tuple[dict[str, float], dict[str, float] | None, float]:
    """(host ms per phase, device ms per phase or None on CPU, real step ms), medians over ``batches``."""
    host = _median([host_ms(b, t, device) for t in batches])
    dev = None
    if device.type == "cuda":
        cpm = _cycles_per_ms(device)
        sleep = {k: max(min_sleep_ms, 2 * v) for k, v in host.items()}
        dev = _median([device_ms(b, t, device, sleep, cpm) for t in batches])
    real = []
    for t in batches:
        _sync(device)
        t0 = time.perf_counter()
        for _ in phases(b, t):
            pass
        _sync(device)
        real.append((time.perf_counter() - t0) * 1e3)
    return host, dev, statistics.median(real)


def _table(name: str, host: dict[str, float], dev: dict[str, float] | None, real: float) -> None:
    print(f"\n{name}: real step {real:.2f} ms")
    print(f"  {'phase':<10}{'host ms':>10}{'device ms':>11}{'host/device':>13}")
    for k, h in host.items():
        d = None if dev is None else dev[k]
        ratio = "" if not d else f"{h / d:.2f}"
        print(f"  {k:<10}{h:>10.2f}{'' if d is None else f'{d:.2f}':>11}{ratio:>13}")
    total_d = "" if dev is None else f"{sum(dev.values()):.2f}"
    print(f"  {'total':<10}{sum(host.values()):>10.2f}{total_d:>11}")


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="steps per measurement (medians)")
    p.add_argument("--sleep-ms", type=float, default=20.0, help="the least device sleep before a phase")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N hottest host functions")
    own, rest = p.parse_known_args(argv)
    if own.steps < 1:
        p.error(f"--steps must be positive, got {own.steps}")
    # every other option is train_step.py's (model, batch, impls, precisions, modes, warm-up, results)
    args = ts.parse_args(rest + ["--microbatches", "1", "--rounds", "1"])
    graphed = [m for m in args.modes if m in ts.GRAPHED]
    if graphed:
        p.error(f"--modes {','.join(graphed)}: a graphed block replays as one launch, so its phases cannot be cut")
    return own, args


def main(argv=None) -> int:
    own, args = parse_args(argv)
    rt = ts._runtime()
    try:
        name, cfg, args.batch, _ = ts.model_config(args)
        corpus = MarkovCorpus(cfg.vocab_size, cfg.seq_len, cfg.seed)
        rows = []
        for precision in args.precisions:
            for mode in args.modes:
                for impl in args.impls:
                    if precision.startswith("fp8") and impl != "distwgrad":
                        continue
                    rows += _run_build(impl, precision, mode, name, cfg, corpus, rt, args, own)
        results.record(rows, args)
    finally:
        torch.distributed.destroy_process_group()
    return 0


def _run_build(impl, precision, mode, name, cfg, corpus, rt, args, own) -> list[dict]:
    device = rt["device"]
    b = ts.make_build(impl, precision, mode, cfg, rt, args)
    for t in ts._batches(corpus, args, rt, 0, args.warmup):
        b.run_step(t)
    batches = ts._batches(corpus, args, rt, args.warmup, own.steps)
    host, dev, real = measure(b, batches, device, own.sleep_ms)
    label = f"{impl}/{precision}/{mode}"
    _table(label, host, dev, real)
    if own.cprofile:
        print(profile_host(b, batches[0], device, own.cprofile))
    case = f"{name} b{args.batch}x{cfg.seq_len} {mode}"
    out = [results.row(bench="step_phases", case=f"{case} {k}", impl=impl, precision=precision, world=rt["world"],
                       metric=metric, value=round(v, 4), unit="ms", device=device, real_step_ms=round(real, 4))
           for metric, times in (("host_ms", host), ("device_ms", dev or {})) for k, v in times.items()]
    del b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    sys.exit(main())
