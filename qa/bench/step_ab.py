"""A kernel tuning against another in the whole training step: two distwgrad builds of one configuration in
one process, each built, warmed up, captured and stepped under its own ``distwgrad.kernels.tuning(...)``,
timed in rotated rounds. Prints each build's rounds and median, the ratio, and whether their warm-up
losses are the same bits.

    # one H200: the blockwise FP8 wgrad in the Triton kernel (a) against the default Gluon one (b), graphed
    torchrun --standalone --nproc-per-node 1 qa/bench/step_ab.py --model large --batch 8 --microbatches 1 \\
        --precision fp8_blockwise --mode compiled_cuda_graph --a grouped_gemm_fp8.wgrad_gluon_blockwise=False
    # CPU smoke (the FP8 GEMMs are emulated there: the two builds run the same code)
    torchrun --standalone --nproc-per-node 1 qa/bench/step_ab.py --model tiny --precision bf16 \\
        --a quantize.per_tensor_block=8192 --rounds 2 --steps 1 --warmup 1

``--a`` and ``--b`` are comma-separated ``family.knob=value`` assignments (the families and knobs of
``distwgrad.kernels.tuning``; values are Python literals); either may be empty, the defaults. The builds are
``train_step.py``'s (``make_build``: the same model, weights and data, the job's own step function), and so is
the timing (``_timed_block``; [Note: each build in each place of a round] in ``train_step.py``).

[Note: a tuning per build]
A build is made and stepped inside its tuning block, so whatever the kernels read of the tuning when they
launch, and whatever a CUDA graph captures, is that build's. Compiled blocks (``--mode compiled``) share
dynamo's cache between the two builds: a knob read while dynamo traces (none of the kernel families' knobs
is: the kernels read theirs inside their custom ops, at run time) would take the first build's value.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distwgrad.kernels  # noqa: E402
import train_step as ts  # noqa: E402
from _tunings import parse_assignments  # noqa: E402


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a preset of the training job (train_step.py --model)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--precision", default="bf16", choices=ts.PRECISIONS)
    p.add_argument("--mode", default="eager", choices=ts.MODES)
    p.add_argument("--a", default="", help="build a's tuning: family.knob=value,... (empty: the defaults)")
    p.add_argument("--b", default="", help="build b's tuning (empty: the defaults)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=None, help="also write both builds' rounds and the ratio to this file")
    args = p.parse_args(argv)
    try:
        args.tunings = {"a": parse_assignments(args.a, "--a"), "b": parse_assignments(args.b, "--b")}
    except (ValueError, TypeError) as exc:
        p.error(str(exc))
    if args.tunings["a"] == args.tunings["b"]:
        p.error(f"--a and --b give the same tuning ({args.a!r} and {args.b!r}): nothing to compare")
    step_argv = ["--model", args.model, "--impls", "distwgrad", "--precisions", args.precision, "--modes", args.mode,
                 "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--steps", str(args.steps), "--no-record"]
    for name in ("batch", "microbatches"):
        if getattr(args, name) is not None:
            step_argv += [f"--{name}", str(getattr(args, name))]
    return args, ts.parse_args(step_argv)


def run(args: argparse.Namespace, step_args: argparse.Namespace, rt: dict) -> dict:
    """Both builds, their warm-up, the rotated rounds; each under its tuning ([Note: a tuning per build])."""
    name, cfg, step_args.batch, step_args.microbatches = ts.model_config(step_args)
    torch.manual_seed(0)
    corpus = ts.MarkovCorpus(cfg.vocab_size, cfg.seq_len, cfg.seed)
    builds = {}
    for tag in ("a", "b"):
        with distwgrad.kernels.tuning(**args.tunings[tag]):
            b = ts.make_build("distwgrad", args.precision, args.mode, cfg, rt, step_args)
            losses = [b.run_step(t) for t in ts._batches(corpus, step_args, rt, 0, step_args.warmup)]
            ts._sync(rt["device"])
        builds[tag] = (b, [float(v) for v in losses])
    for r in range(step_args.rounds):
        batches = ts._batches(corpus, step_args, rt, step_args.warmup + r * step_args.steps, step_args.steps)
        for tag in ("a", "b")[r % 2:] + ("a", "b")[:r % 2]:
            gc.collect(1)
            with distwgrad.kernels.tuning(**args.tunings[tag]):
                ts._timed_block(builds[tag][0], batches, rt["device"])
    med = {tag: statistics.median(b.times_ms) for tag, (b, _) in builds.items()}
    return {"case": ts.case_name(name, step_args.batch, cfg.seq_len, step_args.microbatches, args.mode),
            "precision": args.precision, "tunings": args.tunings,
            "rounds_ms": {tag: b.times_ms for tag, (b, _) in builds.items()}, "median_ms": med,
            "a_over_b": med["a"] / med["b"], "warmup_losses": {tag: v for tag, (_, v) in builds.items()},
            "same_losses": builds["a"][1] == builds["b"][1]}


def main(argv=None) -> int:
    args, step_args = parse_args(argv)
    rt = ts._runtime()
    collecting = gc.isenabled()
    gc.disable()  # as train_step.py ([Note: garbage collection in the timed steps])
    try:
        out = run(args, step_args, rt)
    finally:
        if collecting:
            gc.enable()
        torch.distributed.destroy_process_group()
    if rt["rank"] == 0:
        for tag in ("a", "b"):
            rounds = ", ".join(f"{t:.2f}" for t in out["rounds_ms"][tag])
            print(f"{tag} {(args.a if tag == 'a' else args.b) or '(defaults)'}: median {out['median_ms'][tag]:.2f} "
                  f"ms a step; rounds {rounds}; warm-up losses {out['warmup_losses'][tag]}", flush=True)
        print(f"{out['case']} {args.precision}: a / b = {out['a_over_b']:.4f}x (b is {out['a_over_b']:.4f}x as "
              f"fast as a); warm-up losses {'the same bits' if out['same_losses'] else 'DIFFERENT'}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
