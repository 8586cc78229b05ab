"""Every dtype's grouped-GEMM route against torch's own: distwgrad's dispatch (``distwgrad.ops.grouped_gemm``)
beside a per-expert loop of ``torch.mm`` and ``torch._grouped_mm``, for fp32, bf16 and fp16, one process.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python qa/bench/dtype_paths.py                       # E=16, T=16384, K=N=1024; all dtypes
    PYTHONPATH=. python qa/bench/dtype_paths.py --shapes 8,32768,4096,14336 --dtypes bf16
    PYTHONPATH=. python qa/bench/dtype_paths.py --device cpu --shapes 4,64,32,48 --no-record   # smoke

Ops: ``fprop`` y = x_e W_e^T, ``dgrad`` dx = dy_e W_e, ``wgrad`` dW_e = dy_e^T x_e (fresh, dy's dtype),
``wgrad_accumulate`` fp32 main_grad[e] += dy_e^T x_e (the peers add a fresh product: ``loop`` per expert in
the operands' dtype, ``torch_grouped_mm`` one add). FLOPs 2*T*N*K each. Routing: tokens pick one of E
experts uniformly at random (seed 0). Before timing, distwgrad's result is checked against the loop (the
in-package reference) with a bound of 8 ulps of the operand dtype times K-scaled magnitudes; a failure
stops the run. Timing: CUDA events around ``--iters`` back-to-back calls after a warm-up, ``--rounds``
rounds interleaved across the implementations, median. fp32 follows torch's TF32 switch (off by default).
Rows: ``bench`` "dtype_paths", metric "tflops", appended to docs/benchmarks/results.jsonl (``--no-record``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from distwgrad.ops import grouped_gemm as gg  # noqa: E402
from distwgrad.testing import reference as R  # noqa: E402
from qa.bench import results  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPS = ("fprop", "dgrad", "wgrad", "wgrad_accumulate")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["16,16384,1024,1024"], help="E,T,K,N each")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-record", action="store_true", help="do not append rows to the results file")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        p.error(f"--rounds and --iters must be positive, got {args.rounds} and {args.iters}")
    args.shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    return args


def _problem(E, T, K, N, dtype, device):
    gen = torch.Generator().manual_seed(0)
    expert = torch.multinomial(torch.ones(E), T, replacement=True, generator=gen)
    splits = torch.bincount(expert, minlength=E)
    offs = splits.cumsum(0).to(torch.int32).to(device)
    r = lambda *s: (torch.randn(*s, generator=gen) / 4).to(device=device, dtype=dtype)  # noqa: E731
    return r(T, K), r(E, N, K), r(T, N), offs, splits.tolist()


def _impls(op, x, w, dy, offs, splits, acc):
    """op -> {impl: zero-argument callable}; the loop reads the splits on the host once, outside timing."""
    xs, dys = x.split(splits), dy.split(splits)
    loop = {
        "fprop": lambda: torch.cat([a.mm(b.t()) for a, b in zip(xs, w.unbind(0))]),
        "dgrad": lambda: torch.cat([a.mm(b) for a, b in zip(dys, w.unbind(0))]),
        "wgrad": lambda: torch.stack([a.t().mm(b) for a, b in zip(dys, xs)]),
        "wgrad_accumulate": lambda: [m.add_(a.t().mm(b)) for m, a, b in zip(acc.unbind(0), dys, xs)],
    }[op]
    ours = {
        "fprop": lambda: gg.grouped_fprop(x, w, offs),
        "dgrad": lambda: gg.grouped_dgrad(dy, w, offs),
        "wgrad": lambda: gg.grouped_wgrad(dy, x, offs),
        "wgrad_accumulate": lambda: gg.grouped_wgrad(dy, x, offs, out=acc),
    }[op]
    out = {"distwgrad": ours, "loop": loop}
    if gg._torch_grouped_mm(x.dtype, x.device):
        out["torch_grouped_mm"] = {
            "fprop": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
            "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
            "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
            "wgrad_accumulate": lambda: acc.add_(torch._grouped_mm(dy.t(), x, offs=offs)),
        }[op]
    return out


def _check(op, x, w, dy, offs):
    """distwgrad's dispatch against the reference loop, before any timing."""
    K, N = x.shape[1], w.shape[1]
    eps = torch.finfo(x.dtype).eps
    if op == "fprop":
        got, ref, terms, a, b = gg.grouped_fprop(x, w, offs), R.grouped_fprop(x, w, offs), K, x, w
    elif op == "dgrad":
        got, ref, terms, a, b = gg.grouped_dgrad(dy, w, offs), R.grouped_dgrad(dy, w, offs), N, dy, w
    else:
        got, ref, terms, a, b = gg.grouped_wgrad(dy, x, offs), R.grouped_wgrad(dy, x, offs), x.shape[0], dy, x
    bound = 8 * eps * terms ** 0.5 * float(a.abs().max()) * float(b.abs().max())  # random signs: sqrt(terms)
    err = float((got.float() - ref.float()).abs().max())
    if not err <= bound:
        raise SystemExit(f"dtype_paths: {op} {x.dtype}: max error {err:.3e} exceeds {bound:.3e}")


def _time(fn, iters, device) -> float:
    """Milliseconds per call."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows, table = [], []
    for E, T, K, N in args.shapes:
        for dname in args.dtypes:
            x, w, dy, offs, splits = _problem(E, T, K, N, DTYPES[dname], device)
            acc = torch.zeros(E, N, K, dtype=torch.float32, device=device)
            for op in args.ops:
                if op != "wgrad_accumulate":
                    _check(op, x, w, dy, offs)
                impls = _impls(op, x, w, dy, offs, splits, acc)
                times = {name: [] for name in impls}
                for _ in range(args.rounds):
                    for name, fn in impls.items():
                        times[name].append(_time(fn, args.iters, device))
                tflops = {name: 2.0 * T * N * K / (statistics.median(t) * 1e-3) / 1e12 for name, t in times.items()}
                table.append((f"E={E} T={T} K={K} N={N}", dname, op, tflops))
                for name, v in tflops.items():
                    rows.append(results.row(bench="dtype_paths", case=f"{op} E={E} T={T} K={K} N={N}", impl=name,
                                            precision=dname, world=1, metric="tflops", value=v, unit="TFLOP/s",
                                            device=device))
    print(f"{'shape':<28} {'dtype':<5} {'op':<17} {'distwgrad':>10} {'loop':>10} {'grouped_mm':>10} {'vs best':>8}")
    for shape, dname, op, t in table:
        peers = [v for k, v in t.items() if k != "distwgrad"]
        gm = t.get("torch_grouped_mm")
        print(f"{shape:<28} {dname:<5} {op:<17} {t['distwgrad']:>10.1f} {t['loop']:>10.1f} "
              f"{'-' if gm is None else f'{gm:.1f}':>10} {t['distwgrad'] / max(peers):>7.2f}x")
    if not args.no_record:
        results.append(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
