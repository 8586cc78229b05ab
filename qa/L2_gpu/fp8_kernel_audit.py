"""Audit every FP8 grouped GEMM a real training job makes: kernel result vs emulation, call by call.

Runs ``distwgrad.launch.train`` in this process with the three FP8 products of
``distwgrad.ops.grouped_gemm_fp8`` wrapped: each call runs the Triton kernel (what the job uses) and
then the emulation path (dequantize, fp32 grouped GEMM) on the same quantized operands, and records the
relative Frobenius difference. Both compute the same product; they differ by accumulation order and
Hopper's fp8 accumulation, ~1e-3 relative at most, so a call above ``--flag`` (default 2e-2) or with a
NaN in one result only is a kernel bug at that call's shapes and splits, which are printed. The
quantizations (activations, gradients, weights) are checked the same way against the torch reference,
bit for bit. ``--reference-quantize`` / ``--emulate-gemm`` make the job itself use the torch quantizers /
the emulated products, to tell which part a loss difference comes from. GPU only::

    python qa/L2_gpu/fp8_kernel_audit.py --recipe fp8_blockwise --steps 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import sys
import tempfile

import torch

from distwgrad.fp8 import quantize as reference
from distwgrad.fp8 import weights
from distwgrad.ops import grouped_gemm_fp8 as ops

RECORDS: list[dict] = []


@contextlib.contextmanager
def _emulating():
    real = ops.fp8_kernels_accept
    ops.fp8_kernels_accept = lambda *a, **k: False
    try:
        yield
    finally:
        ops.fp8_kernels_accept = real


@contextlib.contextmanager
def _reference_quantizers():
    real = weights._quantizers
    weights._quantizers = lambda w: (reference.quantize_per_tensor, reference.quantize_blockwise, False)
    try:
        yield
    finally:
        weights._quantizers = real


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _same(qs, refs) -> bool:
    return all(torch.equal(_bits(a.data), _bits(b.data)) and torch.equal(_bits(a.scale_inv), _bits(b.scale_inv))
               for a, b in zip(qs, refs, strict=True))


def _wrap_quantizers(use_reference: bool) -> None:
    """Checks every quantization bit for bit against the torch reference (or, ``use_reference``, has
    the job use the reference)."""
    real_op, real_w = ops.quantize_operand, weights.quantize_weight

    def quantize_operand(x_MK, recipe, *, grad):
        ref = reference.quantize_rowwise_and_columnwise(x_MK, recipe, grad=grad)
        got = ref if use_reference else real_op(x_MK, recipe, grad=grad)
        RECORDS.append({"op": "quantize_operand", "rel": 0.0 if _same(got, ref) else float("inf"),
                        "shapes": [tuple(x_MK.shape)], "splits": []})
        return got

    def quantize_weight(w, recipe, *, amax=None):
        with _reference_quantizers():
            ref = real_w(w, recipe, amax=amax)
        got = ref if use_reference else real_w(w, recipe, amax=amax)
        RECORDS.append({"op": "quantize_weight", "rel": 0.0 if _same(got, ref) else float("inf"),
                        "shapes": [tuple(w.shape)], "splits": []})
        return got

    ops.quantize_operand, weights.quantize_weight = quantize_operand, quantize_weight


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    if bool(got.isnan().any() != ref.isnan().any()):
        return float("inf")
    ok = ~(got.isnan() | ref.isnan())
    return float((got[ok] - ref[ok]).norm() / ref[ok].norm().clamp_min(1e-30))


def _record(op: str, got, ref, offs_E: torch.Tensor, shapes: list) -> None:
    got = torch.stack(list(got)) if isinstance(got, (list, tuple)) else got
    ref = torch.stack(list(ref)) if isinstance(ref, (list, tuple)) else ref
    scale = float(ref.double().nan_to_num().abs().max().clamp_min(1e-30))
    rel_max = float((got.double() - ref.double()).nan_to_num().abs().max()) / scale
    RECORDS.append({"op": op, "rel": _rel(got, ref), "rel_max": rel_max, "shapes": shapes,
                    "splits": torch.diff(offs_E.long(), prepend=offs_E.new_zeros(1).long()).tolist()})


def _wrap(name: str, emulate: bool):
    real = getattr(ops, name)

    def wrapped(*args, **kwargs):
        if emulate:
            with _emulating():
                return real(*args, **kwargs)
        out = kwargs.get("out")
        before = None if out is None else ([t.clone() for t in out] if isinstance(out, (list, tuple))
                                           else out.clone())
        got = real(*args, **kwargs)
        got_t = got if out is None else out
        if out is not None:  # the emulation adds into a copy of the buffers as they were before
            got_t = [t.clone() for t in out] if isinstance(out, (list, tuple)) else out.clone()
            kwargs = dict(kwargs, out=before)
        with _emulating():
            ref = real(*args, **kwargs)
        ref = ref if out is None else before
        _record(name.removeprefix("grouped_").removesuffix("_fp8"), got_t, ref, args[2],
                [tuple(a.shape) for a in args[:2] if hasattr(a, "shape")])
        return got

    setattr(ops, name, wrapped)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="fp8_blockwise", choices=("fp8_blockwise", "fp8_per_tensor"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--flag", type=float, default=2e-2, help="relative difference that marks a call")
    p.add_argument("--json", default=None, help="write every call's record here")
    p.add_argument("--reference-quantize", action="store_true", help="the job quantizes with the torch reference")
    p.add_argument("--emulate-gemm", nargs="?", const="fprop,dgrad,wgrad", default="",
                   help="the job runs these FP8 products emulated (comma-separated; bare flag: all three)")
    p.add_argument("--first-picks", action="store_true",
                   help="the kernels use the first, untuned tile table (128x128x128/w8/s4, 'load') instead of "
                        "the tuned one: bisects a difference between the two")
    p.add_argument("--out", default=None, help="the job's output folder (default: fp8_audit_<recipe> in the "
                                              "temporary directory)")
    args = p.parse_args(argv)
    emulated = {op for op in args.emulate_gemm.split(",") if op}
    if emulated - {"fprop", "dgrad", "wgrad"}:
        p.error(f"--emulate-gemm takes fprop, dgrad, wgrad; got {args.emulate_gemm!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not ops.gg.kernels_available(torch.zeros(1)):
        raise SystemExit("needs a GPU (or, slowly, DISTWGRAD_KERNELS_ON_CPU=1 TRITON_INTERPRET=1 on CPU)")
    out = args.out or os.path.join(tempfile.gettempdir(), f"fp8_audit_{args.recipe}")
    for name in ("grouped_fprop_fp8", "grouped_dgrad_fp8", "grouped_wgrad_fp8"):
        _wrap(name, name.split("_")[1] in emulated)
    if args.first_picks:
        from distwgrad.kernels import _grouped_gemm_fp8_configs as cfg
        first = cfg.TileConfig(128, 128, 128, num_warps=8, num_stages=4)
        cfg.pick = lambda op, *, block, **kw: cfg.with_block_k(first, block)
    _wrap_quantizers(args.reference_quantize)
    sys.argv = ["train", "--steps", str(args.steps), "--recipe", args.recipe, "--no-progress", "--device", device,
                "--out", out]
    with contextlib.suppress(SystemExit):
        runpy.run_module("distwgrad.launch.train", run_name="__main__")
    if not RECORDS:
        raise SystemExit("no fp8 GEMM call reached the kernels")
    worst = max(RECORDS, key=lambda r: r["rel"])
    flagged = [r for r in RECORDS if not r["rel"] <= args.flag]
    print(f"{len(RECORDS)} calls audited (quantizations, fp8 GEMMs); worst relative difference {worst['rel']:.3g} "
          f"({worst['op']}, "
          f"splits {worst['splits']}); {len(flagged)} above {args.flag}")
    worst_max = max(RECORDS, key=lambda r: r.get("rel_max", 0.0))
    print(f"worst max-norm difference relative to the largest element: {worst_max.get('rel_max', 0.0):.3g} "
          f"({worst_max['op']}, splits {worst_max['splits']})")
    for r in flagged[:20]:
        print("FLAGGED", json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RECORDS, f)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
