"""FP8 weights kept across microbatches against quantized at every use, or quantized for dgrad in forward's read
against in backward's own: one process, rounds interleaved.

    torchrun --standalone --nproc-per-node 1 qa/studies/fp8_weights_kept.py --model large --batch 8 \\
        --microbatches 2 --modes eager,compiled --recipes fp8_per_tensor,fp8_blockwise
    torchrun --standalone --nproc-per-node 1 qa/studies/fp8_weights_kept.py --compare pair --model xl --n-layers 3 \\
        --microbatches 1

The job's step (``launch.step.forward_backward``, then ``finalize_model_grads`` and fused AdamW) on one model,
three arms a round, their order rotated from round to round: bf16, FP8 with every weight quantized at each use
(``keep_fp8_weights=False``) and FP8 with each microbatch's ``is_first_microbatch`` ([Note: fp8 weights kept
across microbatches] in ``distwgrad/fp8/weights.py``). ``--compare pair``: bf16, FP8 with dgrad's weights read
again in backward (``QuantizeTuning.weights_pair=False``) and FP8 with them from forward's read ([Note: dgrad's
weights from forward's read]), the weights kept as the job keeps them. Two-microbatch FP8 steps without CUDA
graphs are bound by the host, whose speed differs from process to process (docs/fp8.md, "At ``large`` on an
H100"), so only arms of one process, interleaved, compare. Prints medians and ratios; appends rows (case "...
fp8 weights kept, interleaved", ``variant`` "kept" or "fresh"; "... fp8 dgrad weights, interleaved", ``variant``
"one read" or "two reads") unless ``--no-record``.
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
# per comparison: its case's words and its two FP8 arms, each (keep the weights across microbatches, weights_pair)
COMPARE = {"kept": ("fp8 weights kept", {"fresh": (False, True), "kept": (True, True)}),
           "pair": ("fp8 dgrad weights", {"two reads": (True, False), "one read": (True, True)})}


def _preset(name: str, n_layers: int | None = None) -> dict:
    from launch.config import PRESETS

    if name not in PRESETS:
        raise SystemExit(f"--model must be one of {tuple(PRESETS)}, got {name!r}")
    return {**PRESETS[name], **({} if n_layers is None else {"n_layers": n_layers})}


def _model(preset: str, device: torch.device, n_layers: int | None = None):
    from distwgrad.models import MoEGPT, MoEGPTConfig

    names = {f.name for f in dataclasses.fields(MoEGPTConfig)}
    cfg = MoEGPTConfig(**{k: v for k, v in _preset(preset, n_layers).items() if k in names})
    torch.manual_seed(0)
    return MoEGPT(cfg, device=device, sharded=True, param_dtype=torch.bfloat16), cfg


def measure(args, mode: str, recipe: str, device: torch.device) -> dict[str, list[float]]:
    """ms a step of each arm, one value a round."""
    from distwgrad.kernels import tuning

    import distwgrad
    from launch.step import forward_backward

    model, cfg = _model(args.model, device, args.n_layers)
    if mode == "compiled":  # as train_step.py's compiled mode; each model its own graphs (a new dynamo cache)
        torch._dynamo.reset()
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen).to(device)
    arms = {"bf16": ("none", True, True)} | {arm: (recipe, *how) for arm, how in COMPARE[args.compare][1].items()}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def steps(arm: str, n: int) -> float:
        name, keep, pair = arms[arm]
        sync()
        t0 = time.perf_counter()
        with tuning(quantize=dict(weights_pair=pair)):
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
    p.add_argument("--compare", default="kept", choices=tuple(COMPARE), help="kept: weights kept across "
                   "microbatches or not; pair: dgrad's weights from forward's read or backward's (default kept)")
    p.add_argument("--model", default="large", help="a launch.config preset (default large)")
    p.add_argument("--n-layers", type=int, default=None, help="the preset's layers instead (xl on 80 GB: 3)")
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
    for name in ("batch", "microbatches", "rounds", "steps") + (("n_layers",) if args.n_layers is not None else ()):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.batch % args.microbatches:
        p.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    words, (a, b) = COMPARE[args.compare][0], COMPARE[args.compare][1]
    print(f"{'recipe':16s} {'mode':9s} {'bf16 ms':>9s} {a + ' ms':>12s} {b + ' ms':>12s} {a + '/bf16':>15s} "
          f"{b + '/bf16':>15s} {b + ' speedup':>16s}  (medians of the rounds; then their minima)")
    for mode in modes:
        for recipe in recipes:
            t = measure(args, mode, recipe, device)
            med = {arm: statistics.median(v) for arm, v in t.items()}
            low = {arm: min(v) for arm, v in t.items()}
            for label, m in (("median", med), ("min", low)):
                print(f"{recipe:16s} {mode:9s} {m['bf16']:9.2f} {m[a]:12.2f} {m[b]:12.2f} "
                      f"{m['bf16'] / m[a]:15.3f} {m['bf16'] / m[b]:15.3f} {m[a] / m[b]:16.3f}  {label}", flush=True)
            seq = _preset(args.model)["seq_len"]
            layers = "" if args.n_layers is None else f" n_layers={args.n_layers}"
            case = f"{args.model}{layers} b{args.batch}x{seq} mb{args.microbatches} {mode}, {words}, interleaved"
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
