"""Grouped GEMM throughput: distwgrad's Triton kernels beside torch._grouped_mm, a per-expert torch.mm loop
and a dense mm of the same FLOPs, in one process on one GPU (bf16 operands, fp32 accumulation).

Run on a GPU machine from the repository root::

    PYTHONPATH=. python qa/bench/kernels.py gemm --rounds 3 --json out.json --plot out.png   # the record
    PYTHONPATH=. python qa/bench/kernels.py gemm --sweep --sweep-json sweep.json   # + every candidate config
    PYTHONPATH=. python qa/bench/kernels.py gemm --shapes 8,4096,512,1024 --ops fprop   # a subset
    TRITON_INTERPRET=1 PYTHONPATH=. python qa/bench/kernels.py gemm --device cpu --shapes 3,64,32,48   # smoke

Ops (FLOPs 2*T*N*K for all; ``E, T, K, N`` = experts, tokens, in-features, out-features):
    fprop             y = x_e @ W_e^T                                per group
    dgrad             dx = dy_e @ W_e
    wgrad             dW_e = dy_e^T @ x_e into a fresh bf16 [E, N, K]
    wgrad_accumulate  main_grad[e] += dy_e^T @ x_e, main_grad fp32 [E, N, K]
Implementations: ``distwgrad`` (the kernels, fused accumulate); ``torch_grouped_mm``
(``torch._grouped_mm(..., offs=int32 ends)``; for wgrad_accumulate followed by ``main_grad.add_``);
``loop`` (one ``torch.mm`` per expert into slices of a preallocated output; for wgrad_accumulate
``main_grad[e].add_(mm)``, the unfused peer); ``dense`` (one ``torch.mm`` of [T, K] x [K, N] or, for the
wgrads, [N, T] x [T, K]: the same FLOPs without groups; no accumulate).

Routing: every token picks one expert uniformly at random (``torch.multinomial`` over equal weights,
seed 0), so groups hold about T/E +- sqrt(T/E) tokens: balanced, as after an auxiliary-loss-balanced
router, but ragged. The loop reads the splits on the host once, outside the timed region.

Timing: ``triton.testing.do_bench`` (L2 flushed before every run), median, after a warm-up call; with
``--cuda-graph``, ``triton.testing.do_bench_cudagraph`` (back-to-back calls captured in one graph and
replayed: device time only, L2 not flushed between calls). ``--rounds R`` times every implementation R
times, interleaved (all of them once, then again), and reports each one's median: the chip's clock drifts
by several percent over a run, and interleaving spreads the drift over the peers alike. Kernels
shorter than ~0.3 ms (the E=128 shape) can be host-bound here: each of our calls spends ~0.1 ms in Python
(custom-op dispatch, checks, descriptor encoding) and the loop peer 128 launches; a slow host shows up
as a slow E=128 row and a slow loop (docs/benchmarks/LOG.md, 2026-11-29 round 3). Before
timing, each (op, shape) of ``distwgrad`` is checked against the in-package reference and an fp64
oracle with the bound in [Note: grouped gemm error bound] (kernels/_grouped_gemm_configs.py).

Output: a table on stdout; ``--json`` writes a list of rows ``{"op", "shape": [E, T, K, N], "impl",
"tflops"}`` (extra keys: ``ms``, ``device``, ``config`` for distwgrad, ``ms_rounds`` with ``--rounds``);
``--plot`` a PNG of TFLOP/s by shape. ``--sweep`` also times every candidate tile config of ours
(kernels/_grouped_gemm_configs.py).
With ``wgrad_accumulate`` among the ops, the run ends with its memory roofline per shape (``roofline``):
the fp32 read-modify-write of ``main_grad`` at the measured copy bandwidth against the MMAs at the dense
mm's rate, i.e. the most any accumulating kernel can reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from distwgrad.kernels import _grouped_gemm_configs as C
from distwgrad.kernels import grouped_gemm as G

from distwgrad.testing import reference as R

if __package__ in (None, ""):  # run as a script: the repository root on the path, for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402

SHAPES = ((8, 32768, 4096, 14336), (64, 65536, 7168, 2048), (128, 16384, 2048, 768))
OPS = ("fprop", "dgrad", "wgrad", "wgrad_accumulate")
IMPLS = ("distwgrad", "torch_grouped_mm", "loop", "dense")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=None, help="E,T,K,N each (default: the three MoE shapes)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--json", default=None, help="write the rows here")
    results.add_arguments(p)
    p.add_argument("--plot", default=None, help="write a PNG of TFLOP/s by shape here (matplotlib, Agg)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate config of ours")
    p.add_argument("--sweep-ops", nargs="+", choices=OPS, default=list(OPS), help="ops to sweep (default all)")
    p.add_argument("--sweep-json", default=None, help="write the sweep's rows here")
    p.add_argument("--sweep-rep", type=int, default=50, help="do_bench repetition time in the sweep, ms")
    p.add_argument("--sweep-match", nargs="+", default=None,
                   help="sweep only the candidates whose short name contains one of these (e.g. /l2pf); the "
                        "default config is always timed")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check before timing")
    p.add_argument("--half-tail-rows", action="store_true",
                   help="fprop/dgrad: also time the default tile config with half_tail flipped (impl "
                        "'distwgrad_half_tail' or 'distwgrad_full_tail'; [Note: half tail tiles])")
    p.add_argument("--wide-tail-rows", action="store_true",
                   help="fprop/dgrad: also time the default tile config with wide_tail flipped (impl "
                        "'distwgrad_wide_tail' or 'distwgrad_no_wide_tail'; [Note: wide tail tiles])")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every implementation this many times, interleaved, and report the median")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test, TRITON_INTERPRET=1)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time CUDA-graph replays (triton.testing.do_bench_cudagraph): device time without "
                        "the host's launch cost; rows get timing='cuda_graph'")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    args.shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    return args


@dataclasses.dataclass
class Problem:
    E: int
    T: int
    K: int
    N: int
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    offs: torch.Tensor
    ranges: list

    @property
    def flops(self) -> float:
        return 2.0 * self.T * self.N * self.K


def make_problem(E, T, K, N, device) -> Problem:
    gen = torch.Generator(device="cpu").manual_seed(0)
    expert = torch.multinomial(torch.ones(E), T, replacement=True, generator=gen)
    offs = torch.bincount(expert, minlength=E).cumsum(0).to(torch.int32)
    dtype = torch.bfloat16 if device != "cpu" else torch.float16  # interpreter: no bf16 stores
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype)
    torch.manual_seed(0)
    return Problem(E, T, K, N, x=r(T, K), w=r(E, N, K) * K ** -0.5, dy=r(T, N), offs=offs.to(device),
                   ranges=R.group_ranges(offs))


def _loop(p: Problem, fn) -> None:
    for e, (s, t) in enumerate(p.ranges):
        if t > s:
            fn(e, s, t)


def impls_for(op: str, p: Problem) -> dict:
    """name -> zero-argument callable running that implementation once (outputs preallocated)."""
    x, w, dy, offs = p.x, p.w, p.dy, p.offs
    gmm = torch._grouped_mm
    bf = x.dtype  # bf16 on the GPU
    if op == "fprop":
        y = torch.empty(p.T, p.N, device=x.device, dtype=bf)
        return {"distwgrad": lambda: G.grouped_fprop(x, w, offs),
                "torch_grouped_mm": lambda: gmm(x, w.transpose(-2, -1), offs=offs, out_dtype=bf),
                "loop": lambda: _loop(p, lambda e, s, t: torch.mm(x[s:t], w[e].t(), out=y[s:t])),
                "dense": lambda: torch.mm(x, w[0].t())}
    if op == "dgrad":
        dx = torch.empty(p.T, p.K, device=x.device, dtype=bf)
        return {"distwgrad": lambda: G.grouped_dgrad(dy, w, offs),
                "torch_grouped_mm": lambda: gmm(dy, w, offs=offs, out_dtype=bf),
                "loop": lambda: _loop(p, lambda e, s, t: torch.mm(dy[s:t], w[e], out=dx[s:t])),
                "dense": lambda: torch.mm(dy, w[0])}
    dense = {"dense": lambda: torch.mm(dy.t(), x)}
    if op == "wgrad":
        dw = torch.zeros(p.E, p.N, p.K, device=x.device, dtype=bf)
        return {"distwgrad": lambda: G.grouped_wgrad(dy, x, offs),
                "torch_grouped_mm": lambda: gmm(dy.t(), x, offs=offs, out_dtype=bf),
                "loop": lambda: _loop(p, lambda e, s, t: torch.mm(dy[s:t].t(), x[s:t], out=dw[e])), **dense}
    main = torch.zeros(p.E, p.N, p.K, device=x.device, dtype=torch.float32)
    return {"distwgrad": lambda: G.grouped_wgrad(dy, x, offs, out=main),
            "torch_grouped_mm": lambda: main.add_(gmm(dy.t(), x, offs=offs, out_dtype=bf)),
            "loop": lambda: _loop(p, lambda e, s, t: main[e].add_(torch.mm(dy[s:t].t(), x[s:t]))), **dense}


def expected(op: str, p: Problem) -> tuple:
    """(fresh output factory, bf16 reference, fp64 oracle) for one op; the output is NaN-poisoned
    (or, for the accumulating op, a random fp32 main_grad that the oracle starts from)."""
    x, w, dy, offs = p.x, p.w, p.dy, p.offs
    if op in ("fprop", "dgrad"):
        fn, a = (R.grouped_fprop, x) if op == "fprop" else (R.grouped_dgrad, dy)
        shape = (p.T, p.N if op == "fprop" else p.K)
        return (lambda: torch.full(shape, math.nan, device=x.device, dtype=x.dtype),
                fn(a, w, offs), fn(a.double(), w.double(), offs))
    if op == "wgrad":
        return (lambda: torch.full((p.E, p.N, p.K), math.nan, device=x.device, dtype=x.dtype),
                R.grouped_wgrad(dy, x, offs), R.grouped_wgrad(dy.double(), x.double(), offs))
    main0 = torch.randn(p.E, p.N, p.K, device=x.device) * 4
    return (main0.clone, R.grouped_wgrad(dy, x, offs, out=main0.clone()),
            R.grouped_wgrad(dy.double(), x.double(), offs, out=main0.double()))


def check(launch, exp) -> dict:
    """``launch(out) -> out`` on a fresh output, judged by the shared bound."""
    fresh, ref, oracle = exp
    ours = launch(fresh())
    res = C.error_vs_oracle(ours, ref, oracle)
    del ours
    torch.cuda.empty_cache()
    return res


def _launch_ours(op, p, out, config=None, use_tma=None):
    if op in ("fprop", "dgrad"):
        a = p.x if op == "fprop" else p.dy
        return G._launch_ragged(a, p.w, p.offs, None, out, w_trans=op == "fprop", config=config,
                                use_tma=use_tma)
    G._launch_wgrad(p.dy, p.x, p.offs, out, accumulate=op == "wgrad_accumulate", table=None,
                    config=config, use_tma=use_tma)
    return out


def time_ms(fn, args, rep=None) -> float:
    import triton
    fn()
    if args.device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    if args.cuda_graph:  # replays of a graph of back-to-back calls; L2 is not flushed between them
        return triton.testing.do_bench_cudagraph(fn, rep=rep or args.rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=rep or args.rep, return_mode="median")


def default_config(op: str, p: Problem) -> C.TileConfig:
    if p.x.device.type == "cpu":
        return C.INTERPRETER
    smem = torch.cuda.get_device_properties(p.x.device).shared_memory_per_block_optin
    kw = dict(num_groups=p.E, elem_bytes=2, smem_limit=smem, num_tokens=p.T)
    if op == "fprop":
        return C.pick_ragged(n=p.N, k=p.K, **kw)
    if op == "dgrad":
        return C.pick_ragged(n=p.K, k=p.N, **kw)
    return C.pick_wgrad(n=p.N, k=p.K, accumulate=op == "wgrad_accumulate", **kw)


def sweep(op: str, p: Problem, args, exp) -> list[dict]:
    """Every candidate config (TMA as the layout allows) plus the pointer path of the default config."""
    cands = {"fprop": C.RAGGED_CANDIDATES, "dgrad": C.RAGGED_CANDIDATES, "wgrad": C.WGRAD_CANDIDATES,
             "wgrad_accumulate": C.WGRAD_ACC_CANDIDATES}[op]
    match = getattr(args, "sweep_match", None)
    cands = [c for c in cands if not match or any(m in c.short() for m in match)]
    if match:
        cands.append(default_config(op, p))
    runs = [(c, None) for c in cands] + [(default_config(op, p), False)]
    rows = []
    for cfg, tma in runs:
        if op in ("fprop", "dgrad"):
            shape = (p.T, p.N if op == "fprop" else p.K)
            out = torch.empty(shape, device=p.x.device, dtype=p.x.dtype)
        else:
            out = torch.zeros(p.E, p.N, p.K, device=p.x.device,
                              dtype=torch.float32 if op == "wgrad_accumulate" else p.x.dtype)
        try:
            ok = check(lambda o, cfg=cfg, tma=tma: _launch_ours(op, p, o, cfg, tma), exp)["ok"]
            ms = time_ms(functools.partial(_launch_ours, op, p, out, cfg, tma), args, rep=args.sweep_rep)
            row = dict(op=op, shape=[p.E, p.T, p.K, p.N], config=cfg.short(), tma=tma, ok=ok, ms=ms,
                       tflops=p.flops / ms / 1e9)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
            row = dict(op=op, shape=[p.E, p.T, p.K, p.N], config=cfg.short(), tma=tma, error=repr(exc)[:300])
        print("  sweep", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _flipped_row(op: str, p: Problem, exp, cfg, field: str, names: tuple[str, str], impls: dict,
                 check_it: bool) -> bool:
    """Adds the default fprop/dgrad config with the boolean ``field`` flipped to ``impls`` as
    "distwgrad_" + ``names[flipped value]``, checked against the oracle first unless ``check_it`` is False."""
    flipped = dataclasses.replace(cfg, **{field: not getattr(cfg, field)})
    out = torch.empty(p.T, p.N if op == "fprop" else p.K, device=p.x.device, dtype=p.x.dtype)
    ok = True
    if check_it:
        ok = check(lambda o: _launch_ours(op, p, o, flipped), exp)["ok"]
        print(f"check {op:17s} {[p.E, p.T, p.K, p.N]} {flipped.short()}: {'PASS' if ok else 'FAIL'}", flush=True)
    impls[f"distwgrad_{names[getattr(flipped, field)]}"] = functools.partial(_launch_ours, op, p, out, flipped)
    return ok


def run(args) -> tuple[list[dict], list[dict], bool]:
    dev = torch.cuda.get_device_name() if args.device != "cpu" else "cpu (interpreter)"
    rows, sweep_rows, all_ok = [], [], True
    for shape in args.shapes:
        p = make_problem(*shape, device=args.device)
        for op in args.ops:
            exp = expected(op, p) if not args.no_check or args.sweep else None
            if not args.no_check:
                res = check(functools.partial(_launch_ours, op, p), exp)
                all_ok &= res["ok"]
                print(f"check {op:17s} {shape}: {'PASS' if res['ok'] else 'FAIL'}  "
                      f"fro {res['fro']['ours']:.3e} <= {res['fro']['bound']:.3e}  "
                      f"max {res['max']['ours']:.3e} <= {res['max']['bound']:.3e}", flush=True)
            impls = impls_for(op, p)
            cfg = default_config(op, p)
            if op in ("fprop", "dgrad") and cfg.block_m >= 32:
                for flag, field, names in ((args.half_tail_rows, "half_tail", ("full_tail", "half_tail")),
                                           (args.wide_tail_rows, "wide_tail", ("no_wide_tail", "wide_tail"))):
                    if flag:
                        all_ok &= _flipped_row(op, p, exp, cfg, field, names, impls, check_it=not args.no_check)
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):  # the peers interleaved: clock drift hits each alike
                for name, fn in impls.items():
                    if name in times and not times[name]:
                        continue  # failed in an earlier round
                    try:
                        times.setdefault(name, []).append(time_ms(fn, args))
                    except Exception as exc:  # noqa: BLE001 - a peer that refuses a layout is reported
                        print(f"  {name} failed on {op} {shape}: {exc!r}"[:400], flush=True)
                        times[name] = []
            for name, ms_rounds in times.items():
                if not ms_rounds:
                    continue
                ms = statistics.median(ms_rounds)
                row = dict(op=op, shape=list(shape), impl=name, tflops=p.flops / ms / 1e9, ms=ms, device=dev,
                           timing="cuda_graph" if args.cuda_graph else "do_bench")
                if args.rounds > 1:
                    row["ms_rounds"] = ms_rounds
                if name == "distwgrad":
                    row["config"] = default_config(op, p).short()
                rows.append(row)
                print(f"  {op:17s} {str(shape):26s} {name:17s} {row['tflops']:7.1f} TFLOP/s  {ms:8.3f} ms",
                      flush=True)
            if args.sweep and op in args.sweep_ops:
                sweep_rows += sweep(op, p, args, exp)
            exp = None
            torch.cuda.empty_cache()
        p = None
        torch.cuda.empty_cache()
    return rows, sweep_rows, all_ok


def copy_gbps(device: str) -> float:
    """Device copy bandwidth (``clone`` of 1 GiB; bytes read + written per second / 1e9), the memory
    roofline of the accumulating wgrad's fp32 read-modify-write."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    if device == "cpu":
        t0 = time.perf_counter()
        x.clone()
        return 2 * x.numel() / (time.perf_counter() - t0) / 1e9
    import triton
    return 2 * x.numel() / (triton.testing.do_bench(x.clone, return_mode="median") * 1e-3) / 1e9


def roofline(rows: list[dict], gbps: float) -> list[str]:
    """Per shape, the accumulating wgrad's bound: its fp32 ``main_grad`` read + write (8 bytes per
    element) and operands at ``gbps``, overlapped at best with the MMAs at the dense mm's measured rate.
    The ratio to grouped_mm's plain wgrad (which writes 2 bytes per element and reads none) is the most
    any accumulating kernel can reach against that target."""
    tf = {(r["op"], tuple(r["shape"]), r["impl"]): r["tflops"] for r in rows}
    lines = []
    for s in sorted({tuple(r["shape"]) for r in rows if r["op"] == "wgrad_accumulate"}):
        E, T, K, N = s
        flops = 2.0 * T * N * K
        dense, plain = tf.get(("wgrad_accumulate", s, "dense")), tf.get(("wgrad", s, "torch_grouped_mm"))
        ours = tf.get(("wgrad_accumulate", s, "distwgrad"))
        if not (dense and ours):
            continue
        t_mem = (8.0 * E * N * K + 2.0 * T * (N + K)) / (gbps * 1e9)
        t_mma = flops / (dense * 1e12)
        cap = flops / max(t_mem, t_mma) / 1e12
        vs = f", {cap / plain:.2f}x grouped_mm's plain wgrad" if plain else ""
        lines.append(f"wgrad_accumulate {s}: fp32 read-modify-write >= {t_mem * 1e3:.2f} ms at {gbps:.0f} GB/s, "
                     f"MMAs >= {t_mma * 1e3:.2f} ms: cap {cap:.0f} TFLOP/s with full overlap{vs}; "
                     f"ours {ours:.0f} ({ours / cap:.0%} of the cap)")
    return lines


def summarize(rows: list[dict]) -> str:
    tf = {(r["op"], tuple(r["shape"]), r["impl"]): r["tflops"] for r in rows}
    shapes = sorted({tuple(r["shape"]) for r in rows}, key=lambda s: SHAPES.index(s) if s in SHAPES else 99)
    ops = [o for o in OPS if any(r["op"] == o for r in rows)]
    lines = ["| op | E, T, K, N | distwgrad | torch._grouped_mm | loop | dense | vs grouped_mm | vs loop |",
             "|---|---|---|---|---|---|---|---|"]
    for op in ops:
        for s in shapes:
            v = [tf.get((op, s, i)) for i in IMPLS]
            cell = lambda t: "-" if t is None else f"{t:.0f}"
            ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}x"
            lines.append(f"| {op} | {', '.join(map(str, s))} | " + " | ".join(cell(t) for t in v)
                         + f" | {ratio(v[0], v[1])} | {ratio(v[0], v[2])} |")
    lines.append("")
    for op in ("fprop", "dgrad"):
        rs = [tf[(op, s, "distwgrad")] / tf[(op, s, "torch_grouped_mm")] for s in shapes
              if (op, s, "distwgrad") in tf and (op, s, "torch_grouped_mm") in tf]
        if rs:
            gm = math.exp(sum(map(math.log, rs)) / len(rs))
            lines.append(f"{op}: geomean {gm:.2f}x torch._grouped_mm (target >= 1.10), min {min(rs):.2f}x "
                         f"(target >= 0.95)")
    for s in shapes:
        acc, plain = tf.get(("wgrad_accumulate", s, "distwgrad")), tf.get(("wgrad", s, "torch_grouped_mm"))
        loop = tf.get(("wgrad_accumulate", s, "loop"))
        if acc and plain and loop:
            lines.append(f"wgrad_accumulate {s}: {acc / plain:.2f}x grouped_mm's plain wgrad (target >= 1.0), "
                         f"{acc / loop:.2f}x the mm + add_ loop (target >= 2 at E=64)")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = [o for o in OPS if any(r["op"] == o for r in rows)]
    shapes = sorted({tuple(r["shape"]) for r in rows}, key=lambda s: SHAPES.index(s) if s in SHAPES else 99)
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 4.2), sharey=True, squeeze=False)
    width = 0.8 / len(IMPLS)
    for ax, op in zip(axes[0], ops):
        for i, impl in enumerate(IMPLS):
            vals = [next((r["tflops"] for r in rows if r["op"] == op and tuple(r["shape"]) == s
                          and r["impl"] == impl), 0.0) for s in shapes]
            ax.bar([j + (i - (len(IMPLS) - 1) / 2) * width for j in range(len(shapes))], vals, width,
                   label=impl)
        ax.set_xticks(range(len(shapes)), [f"E={s[0]}\nT={s[1]}\nK={s[2]} N={s[3]}" for s in shapes],
                      fontsize=7)
        ax.set_title(op)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("TFLOP/s (bf16, median)")
    axes[0][0].legend(fontsize=7)
    dev = rows[0].get("device", "") if rows else ""
    fig.suptitle(f"Grouped GEMM, {dev}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("grouped_gemm bench needs a CUDA device (or --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    import triton
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"{name}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    rows, sweep_rows, ok = run(args)
    print(summarize(rows))
    if "wgrad_accumulate" in args.ops:
        gbps = copy_gbps(args.device)
        print("\n".join(roofline(rows, gbps)))
        for r in rows:
            r["copy_gbps"] = round(gbps, 1)
    print(f"correctness before timing: {'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    results.record(results.from_records(rows, bench="grouped_gemm", device=args.device,
                                        metrics={"tflops": "TFLOP/s", "ms": "ms"}), args)
    if args.sweep_json:
        with open(args.sweep_json, "w") as f:
            json.dump(sweep_rows, f, indent=1)
    if args.plot and rows:
        plot(rows, args.plot)
    return 0 if ok else 1
