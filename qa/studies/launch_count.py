"""Triton launches and torch operations one training step issues, counted on the CPU.

    TRITON_INTERPRET=1 DISTWGRAD_KERNELS_ON_CPU=1 python qa/studies/launch_count.py
    TRITON_INTERPRET=1 DISTWGRAD_KERNELS_ON_CPU=1 python qa/studies/launch_count.py --layers 2 --json counts.json
    TRITON_INTERPRET=1 DISTWGRAD_KERNELS_ON_CPU=1 python qa/studies/launch_count.py --microbatches 2 \
        --no-fp8-weight-cache

Where a step is host-bound (eager, compiled without CUDA graphs; docs/fp8.md), what the host issues is the cost,
and it is the same on any device: so the job's model (``MoEGPT``, small widths) runs one eager step per precision
with CPU tensors routed through the Triton kernels' code ([Note: fp8 gemm dispatch]), every launch counted by
kernel and skipped, and every torch operation counted by a dispatch mode. Nothing reads a skipped kernel's output
on the host, so the step issues what a CUDA step issues through the Triton kernels; on Hopper a Gluon kernel
replaces some of them one for one, and cuBLAS the dense bf16 GEMMs and a Linear's FP8 GEMMs (per tensor, and
blockwise on Hopper: [Note: a Linear's fp8 GEMMs on cuBLASLt]).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PRECISIONS = ("bf16", "fp8_per_tensor", "fp8_blockwise")


class _Ops(TorchDispatchMode):
    """Counts every torch operation by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _stub_launches(counts: collections.Counter) -> None:
    """Every interpreted kernel's ``kernel[grid](...)`` counts the launch and runs nothing."""
    from triton.runtime.interpreter import InterpretedFunction

    def getitem(self, grid):
        def launch(*args, **kwargs):
            counts[getattr(self.fn, "__name__", repr(self.fn))] += 1
        return launch
    InterpretedFunction.__getitem__ = getitem


def count(precision: str, layers: int, d_model: int, experts: int, tokens: int, microbatches: int = 1,
          keep_fp8_weights: bool = True) -> dict:
    """``{"launches": {kernel: n}, "ops": {name: n}}`` of one step after one warm-up step."""
    from distwgrad.launch.train import forward_backward

    import distwgrad
    from distwgrad.models import MoEGPT, MoEGPTConfig

    launches: collections.Counter[str] = collections.Counter()
    _stub_launches(launches)
    seq = 128
    cfg = MoEGPTConfig(vocab_size=256, seq_len=seq + 1, d_model=d_model, n_layers=layers, n_heads=4,
                       n_experts=experts, top_k=2, d_ff=d_model)
    torch.manual_seed(0)
    model = MoEGPT(cfg, device=torch.device("cpu"), sharded=True, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batch = torch.randint(0, cfg.vocab_size, (microbatches * max(1, tokens // seq), seq + 1))
    recipe = precision if precision.startswith("fp8") else "none"

    def step() -> None:
        forward_backward(model, batch, microbatches, recipe, None, keep_fp8_weights=keep_fp8_weights)
        distwgrad.finalize_model_grads([model])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    launches.clear()
    ops = _Ops()
    with ops:
        step()
    return {"launches": dict(launches.most_common()), "ops": dict(ops.counts.most_common())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated subset of "
                   + ",".join(PRECISIONS))
    p.add_argument("--layers", type=int, default=8, help="blocks of the model (default 8, the large preset's)")
    p.add_argument("--d-model", type=int, default=128, help="width, also the experts' (default 128: blockwise's "
                   "weight blocks; the counts are those of any multiple of 128, narrower experts quantize one by one)")
    p.add_argument("--experts", type=int, default=16, help="experts (default 16, the large preset's)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens a microbatch (sequences of 128)")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches a step (default 1)")
    p.add_argument("--no-fp8-weight-cache", action="store_true", help="quantize the weights at every use, not once "
                   "a step, with several microbatches (the job's --no-fp8-weight-cache)")
    p.add_argument("--json", help="also write the counts here")
    args = p.parse_args(argv)
    precisions = [v for v in args.precisions.split(",") if v]
    if not precisions or any(v not in PRECISIONS for v in precisions):
        p.error(f"--precisions: choose from {','.join(PRECISIONS)}, got {args.precisions!r}")
    for name in ("layers", "d_model", "experts", "tokens", "microbatches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("DISTWGRAD_KERNELS_ON_CPU") != "1":
        p.error("run with TRITON_INTERPRET=1 DISTWGRAD_KERNELS_ON_CPU=1 (CPU tensors through the kernels' code)")
    out = {}
    for precision in precisions:
        out[precision] = got = count(precision, args.layers, args.d_model, args.experts, args.tokens,
                                     args.microbatches, not args.no_fp8_weight_cache)
        top = ", ".join(f"{k} {v}" for k, v in list(got["launches"].items())[:6])
        print(f"{precision:15s} {sum(got['launches'].values()):6d} Triton launches  {sum(got['ops'].values()):6d} "
              f"torch operations a step ({args.layers} layers)  {top}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
