"""FP8 weights kept across microbatches against quantized at every use: one process, rounds interleaved.

    torchrun --standalone --nproc-per-node 1 qa/studies/fp8_weights_kept.py --model large --batch 8 \\
        --microbatches 2 --modes eager,compiled --recipes fp8_per_tensor,fp8_blockwise

The job's step (``launch.step.forward_backward``, then ``finalize_model_grads`` and fused AdamW) on one model,
three arms a round, their order rotated from round to round: bf16, FP8 with every weight quantized at each use
(``keep_fp8_weights=False``) and FP8 with each microbatch's ``is_first_microbatch`` ([Note: fp8 weights kept
across microbatches] in ``distwgrad/fp8/weights.py``). Two-microbatch FP8 steps without CUDA graphs are bound by
the host, whose speed differs from process to process (docs/fp8.md, "At ``large`` on an H100"), so only arms of
one process, interleaved, compare. Prints medians and ratios; appends rows (case "... fp8 weights kept,
interleaved", ``variant`` "kept" or "fresh") unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "qa" / "bench"))
sys.path.insert(0, str(ROOT))

MODES = ("eager", "compiled")
RECIPES = ("fp8_per_tensor", "fp8_blockwise")


def _preset(name: str) -> dict:
    from launch.config import PRESETS

    if name not in PRESETS:
        raise SystemExit(f"--model must be one of {tuple(PRESETS)}, got {name!r}")
    return PRESETS[name]


def _model(preset: str, device: torch.device):
    from distwgrad.models import MoEGPT, MoEGPTConfig

    names = {f.name for f in dataclasses.fields(MoEGPTConfig)}
    cfg = MoEGPTConfig(**{k: v for k, v in _preset(preset).items() if k in names})
    torch.manual_seed(0)
    return MoEGPT(cfg, device=device, sharded=True, param_dtype=torch.bfloat16), cfg


def measure(args, mode: str, recipe: str, device: torch.device) -> dict[str, list[float]]:
    """ms a step of each arm, one value a round."""
    import distwgrad
    from launch.step import forward_backward

    model, cfg = _model(args.model, device)
    if mode == "compiled":  # as train_step.py's compiled mode; each model its own graphs (a new dynamo cache)
        torch._dynamo.reset()
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen).to(device)
    arms = {"bf16": ("none", True), "fresh": (recipe, False), "kept": (recipe, True)}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def steps(arm: str, n: int) -> float:
        name, keep = arms[arm]
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            forward_backward(model, tokens, args.microbatches, name, keep_fp8_weights=keep)
            distwgrad.finalize_model_grads([model])
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        return (time.perf_counter() - t0) / n * 1e3

    order = list(arms)
    for arm in order:
        steps(arm, args.warmup)
    times: dict[str, list[float]] = {arm: [] for arm in order}
    for r in range(args.rounds):
        for arm in order[r % 3:] + order[: r % 3]:
            times[arm].append(steps(arm, args.steps))
    return times


def main(argv=None) -> int:
    from results import add_arguments, record, row

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="large", help="a launch.config preset (default large)")
    p.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated subset of " + ",".join(RECIPES))
    p.add_argument("--warmup", type=int, default=2, help="steps of each arm before timing")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="steps a round and arm")
    add_arguments(p)
    args = p.parse_args(argv)
    modes, recipes = args.modes.split(","), args.recipes.split(",")
    if any(m not in MODES for m in modes) or any(r not in RECIPES for r in recipes):
        p.error(f"--modes from {MODES}, --recipes from {RECIPES}; got {args.modes!r}, {args.recipes!r}")
    for name in ("batch", "microbatches", "rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.batch % args.microbatches:
        p.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    print(f"{'recipe':16s} {'mode':9s} {'bf16 ms':>9s} {'fresh ms':>9s} {'kept ms':>9s} {'fresh/bf16':>10s} "
          f"{'kept/bf16':>10s} {'kept speedup':>12s}  (medians of the rounds; then their minima)")
    for mode in modes:
        for recipe in recipes:
            t = measure(args, mode, recipe, device)
            med = {arm: statistics.median(v) for arm, v in t.items()}
            low = {arm: min(v) for arm, v in t.items()}
            for label, m in (("median", med), ("min", low)):
                print(f"{recipe:16s} {mode:9s} {m['bf16']:9.2f} {m['fresh']:9.2f} {m['kept']:9.2f} "
                      f"{m['bf16'] / m['fresh']:10.3f} {m['bf16'] / m['kept']:10.3f} "
                      f"{m['fresh'] / m['kept']:12.3f}  {label}", flush=True)
            seq = _preset(args.model)["seq_len"]
            case = f"{args.model} b{args.batch}x{seq} mb{args.microbatches} {mode}, fp8 weights kept, interleaved"
            for arm, v in t.items():
                rows.append(row(bench="train_step", case=case, impl="distwgrad",
                                precision="bf16" if arm == "bf16" else recipe, world=1, metric="step_ms",
                                value=med[arm], unit="ms", device=device, rounds_ms=v,
                                **({} if arm == "bf16" else {"variant": arm})))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    record(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
