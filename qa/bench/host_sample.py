"""Where one build's host time goes in steady-state training steps, sampled from outside the process.

    # one H200: sample 20 s of FP8 per-tensor steps at the large preset (needs py-spy), then read the samples
    python qa/bench/host_sample.py --model large --batch 8 --microbatches 1 --precisions fp8_per_tensor \
        --modes eager --seconds 20 --stacks runs/stacks.txt
    python qa/bench/host_sample.py --summarize runs/stacks.txt

The step is ``train_step.py``'s (same builds, flags and data; world 1). After ``--warmup`` steps the
script starts py-spy on itself and runs steps for ``--seconds``, with no synchronisation but the
allocator's own; it prints the wall time per step and the host's time to issue one (a step whose end is
not waited for). py-spy samples every thread (the autograd engine runs CUDA backward on its own), from
the first sampled step to the last.

[Note: sampling the host]
``torch.profiler`` changes what it measures on the host: while it records, distwgrad's kernel entry
points go through their ``torch.library`` ops instead of calling the implementation directly ([Note:
custom op bypass] in ``kernels/_dispatch.py``), and recording Python frames (``with_stack``) slows every
call. A sampler outside the process (py-spy, ``--nonblocking``: the process is never paused) sees the
step as it runs. Idle threads are not sampled (py-spy's default), so the samples are host work; warm-up,
compilation and set-up happen before py-spy starts. ``--summarize`` prints each function's share of the
samples, self (the innermost Python frame) and total (anywhere on its thread's stack), and with
``--per-step-ms`` (the host's issue time per step that the run printed) each share as milliseconds a step.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

RATE = 250  # py-spy samples per second and thread
NATIVE_RATE = 50  # with C frames: each sample pauses the process while py-spy unwinds every thread


def _find_syncs(build, tokens) -> list[str]:
    """One step under CUDA's sync debug mode: each host-device synchronisation once, with where it was."""
    import torch

    seen: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        where = " <- ".join(f"{f.name} {Path(f.filename).name}:{f.lineno}"
                            for f in reversed(traceback.extract_stack()[-9:-2]))
        key = f"{message}: {where}"
        seen[key] = seen.get(key, 0) + 1

    with warnings.catch_warnings():  # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")  # its own notice
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            build.run_step(tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [f"{n} x {k}" for k, n in seen.items()]


def _sampled_steps(build, batches, seconds: float, stacks: str | None, native: bool) -> tuple[int, float, float]:
    """Steps for ``seconds`` under py-spy when ``stacks`` is a path: (steps, wall s, s to issue them).
    ``native``: py-spy pauses the process for each sample and records C frames and idle threads too."""
    import torch

    device = batches[0].device
    sampler = None
    if stacks:
        Path(stacks).parent.mkdir(parents=True, exist_ok=True)
        how = ["--native", "--idle", "--rate", str(NATIVE_RATE)] if native else ["--nonblocking", "--rate", str(RATE)]
        sampler = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), *how,
                                    "--format", "raw", "--duration", str(math.ceil(seconds)), "-o", stacks],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # py-spy attached
    steps, issue = 0, 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        build.run_step(batches[steps % len(batches)])
        issue += time.perf_counter() - t0
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    if sampler is not None:
        _, err = sampler.communicate()
        if sampler.returncode:
            raise RuntimeError(f"py-spy exited with {sampler.returncode}: {err.strip()[-500:]}")
    return steps, wall, issue


def run(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_step as ts
    from torch import distributed as dist

    from distwgrad.data import MarkovCorpus

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--impl", default="distwgrad", choices=ts.IMPLS)
    p.add_argument("--stacks", default=None, help="py-spy's samples (raw format) to this file")
    p.add_argument("--native", action="store_true", help="with --stacks: C frames and idle threads too (py-spy "
                   "pauses the process for each sample)")
    p.add_argument("--find-syncs", action="store_true", help="first, one step under CUDA's sync debug mode: "
                   "print each host-device synchronisation and where it happened")
    own, rest = p.parse_known_args(argv)
    args = ts.parse_args(rest)
    if len(args.precisions) != 1 or len(args.modes) != 1:
        raise SystemExit(f"host_sample.py samples one build: give one --precisions and one --modes, got "
                         f"{','.join(args.precisions)} and {','.join(args.modes)}")
    if own.seconds <= 0:
        raise SystemExit(f"--seconds must be positive, got {own.seconds}")
    rt = ts._runtime()
    try:
        name, cfg, args.batch, args.microbatches = ts.model_config(args)
        corpus = MarkovCorpus(cfg.vocab_size, cfg.seq_len, cfg.seed)
        build = ts.make_build(own.impl, args.precisions[0], args.modes[0], cfg, rt, args)
        for tok in ts._batches(corpus, args, rt, 0, args.warmup):
            build.run_step(tok)
        ts._sync(rt["device"])
        batches = ts._batches(corpus, args, rt, args.warmup, 4)
        if own.find_syncs and rt["device"].type == "cuda":
            syncs = _find_syncs(build, batches[0])
            print(f"{len(syncs)} synchronising call sites in one step" + "".join(f"\n  {s}" for s in syncs))
        steps, wall, issue = _sampled_steps(build, batches, own.seconds, own.stacks, own.native)
        print(f"{build.name} {name} batch {args.batch}: {steps} steps sampled in {wall:.2f} s: "
              f"{1e3 * wall / steps:.2f} ms a step, the host issued a step in {1e3 * issue / steps:.2f} ms", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def _frame(f: str) -> str:
    """``fn (path/file.py:line)`` -> ``fn file.py``: one entry per function."""
    fn, _, where = f.partition(" (")
    return f"{fn} {where.split(':')[0].rstrip(')').rsplit('/', 1)[-1]}" if where else fn


def summarize(path: str, steps: int | None = None, rate: int = RATE, rows: int = 40) -> str:
    """Self and total sample shares of each function (and host milliseconds a step, given ``steps``)."""
    self_n: Counter[str] = Counter()
    total_n: Counter[str] = Counter()
    kept = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        names = [_frame(f) for f in stack.split(";")]
        n = int(count)
        kept += n
        self_n[names[-1]] += n
        for fn in set(names):
            total_n[fn] += n
    if not kept:
        return f"{path}: no samples"
    ms_per = 1e3 / rate / steps if steps else None
    unit = f", host ms a step ({kept * ms_per:.1f} in all)" if ms_per else ""
    lines = [f"{kept} samples; each function's share, self (innermost Python frame) and total{unit}:"]
    for title, counts in (("self", self_n), ("total", total_n)):
        lines.append(f"  by {title}:")
        for fn, n in counts.most_common(rows):
            ms = f"{n * ms_per:8.2f}" if ms_per else ""
            lines.append(f"    {100 * n / kept:5.1f}% {ms}  {fn[:110]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summarize"]:
        p = argparse.ArgumentParser(prog="host_sample.py --summarize")
        p.add_argument("stacks", help="py-spy record --format raw output")
        p.add_argument("--steps", type=int, default=None, help="the steps sampled (the run prints them)")
        p.add_argument("--rate", type=int, default=RATE, help=f"samples per second ({NATIVE_RATE} with --native)")
        a = p.parse_args(argv[1:])
        if a.steps is not None and a.steps < 1 or a.rate < 1:
            p.error(f"--steps and --rate must be positive, got {a.steps} and {a.rate}")
        print(summarize(a.stacks, a.steps, a.rate))
        return 0
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
