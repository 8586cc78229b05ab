"""Where the Gluon FP8 wgrad kernel's time goes, tile by tile ([Note: tracing the MMA warps' tile phases]
in ``kernels/gluon/grouped_wgrad_fp8.py``): one traced launch per shape and routing, the MMA warps'
cycle counter read at four points of each tile, summarised as shares of the programs' spans.

    python qa/bench/fp8_wgrad_trace.py                                   # E=64 and E=8, both routings
    python qa/bench/fp8_wgrad_trace.py --shapes 64,65536,7168,2048 --accumulate --json out.json
    python qa/bench/fp8_wgrad_trace.py --epilogue-warps 0 2 --dry       # the epilogue's share, and none
    python qa/bench/fp8_wgrad_trace.py --dry --unzeroed                 # what the edge zeroing costs

Per tile (cycles): "begin" waits for the first chunk's stage, zeroes an edge chunk and issues its MMAs;
"handoff" hands the previous tile to the epilogue warps (or writes it); "chunks" runs the other chunks
and waits for the last; "between" is the rest of the program's time (the loop's own work and the next
tile's bookkeeping). A profile's counters average these away: they show which of them the per-tile cost
outside the MMAs is made of. ``--epilogue-warps`` compares the epilogue partition with the MMA warps
writing each tile; ``--dry`` adds runs that write nothing (the epilogue warps still read each tile from
shared memory; with the MMA warps writing, the whole epilogue is skipped), so the chunks' time without
the output's global traffic; ``--unzeroed`` adds dry runs without the edge chunks' zeroing.
Needs a Hopper GPU with a Triton that has Gluon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8 as B  # noqa: E402  (the FP8 bench's problems and operands)

if __package__ in (None, ""):  # run as a script: the repository root on the path, for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402

SHAPES = ("64,65536,7168,2048", "8,32768,4096,14336")


def summarize(trace: torch.Tensor) -> dict:
    """Shares of the programs' traced spans, cycles per tile and per chunk, from a [programs, tiles, 5]
    trace (clocks at the loop's top, first MMAs issued, handoff done, last chunk done; chunks). Rows with
    no chunks (tiles not run, empty groups) are skipped."""
    t = trace.to(torch.float64).cpu()
    ok = t[..., 4] > 0
    begin = (t[..., 1] - t[..., 0])[ok].sum()
    handoff = (t[..., 2] - t[..., 1])[ok].sum()
    chunks = (t[..., 3] - t[..., 2])[ok].sum()
    first = torch.where(ok, t[..., 0], float("inf")).amin(1)
    last = torch.where(ok, t[..., 3], float("-inf")).amax(1)
    has = ok.any(1)
    span = (last - first)[has].sum()
    n_tiles = int(ok.sum())
    later_chunks = (t[..., 4] - 1)[ok].sum()
    return {"tiles": n_tiles, "chunks_per_tile": float(t[..., 4][ok].mean()),
            "cycles_per_tile": float(span / n_tiles), "cycles_per_later_chunk": float(chunks / later_chunks),
            "share_begin": float(begin / span), "share_handoff": float(handoff / span),
            "share_chunks": float(chunks / span), "share_between": float(1 - (begin + handoff + chunks) / span)}


def run(shape: str, routing: str, accumulate: bool, epilogue_warps: int, dry: bool = False,
        zero_edges: bool = True) -> dict:
    from distwgrad.kernels import current
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    from distwgrad.kernels.gluon import grouped_wgrad_fp8_launch as kl
    from distwgrad.kernels.grouped_gemm import _num_sms
    from triton.testing import do_bench

    from distwgrad.fp8.recipe import PerTensorScaling

    E, T, K, N = (int(v) for v in shape.split(","))
    p = B._gemm_problem(E, T, K, N, "cuda", routing)
    q = B._fp8_operands(p, PerTensorScaling())
    a, b = q["dy_qt"], q["x_qt"]
    out = torch.zeros(E, N, K, device="cuda")
    sms = _num_sms(out.device)
    tiles = E * -(-N // kw.BLOCK) * -(-K // kw.BLOCK)
    trace = torch.zeros(kl.trace_shape(tiles, min(tiles, sms)), dtype=torch.int64, device="cuda")
    kwargs = dict(add_mode=-1 if dry else 3 if accumulate else 0,
                  stages=current().grouped_gemm_fp8.wgrad_gluon_stages, epilogue_warps=epilogue_warps, num_sms=sms,
                  zero_edges=zero_edges)

    def call(tr=None):
        kl.launch(a.data, a.scale_inv, b.data, b.scale_inv, p["offs"], out, None, trace=tr, **kwargs)

    traced_ms = do_bench(lambda: call(trace))
    plain_ms = traced_ms if dry else do_bench(call)  # a dry run is traced only
    trace.zero_()
    call(trace)
    torch.cuda.synchronize()
    op = ("dry" if zero_edges else "dry_unzeroed") if dry else "wgrad_accumulate" if accumulate else "wgrad"
    row = {"shape": [E, T, K, N], "routing": routing, "op": op, "epilogue_warps": epilogue_warps, "ms": plain_ms,
           "ms_traced": traced_ms, "tflops": 2.0 * T * N * K / plain_ms / 1e9}
    row.update(summarize(trace))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="E,T,K,N each")
    ap.add_argument("--routing", nargs="+", choices=("random", "balanced"), default=["random", "balanced"])
    ap.add_argument("--accumulate", action="store_true", help="fp32 reductions into an existing output")
    ap.add_argument("--epilogue-warps", nargs="+", type=int, choices=(0, 2), default=None,
                    help="the launch choice(s) to trace (default: the tuning's wgrad_gluon_epilogue_warps)")
    ap.add_argument("--dry", action="store_true", help="also trace runs that write nothing")
    ap.add_argument("--unzeroed", action="store_true", help="also trace dry runs that skip the edge chunks' "
                    "zeroing (what it costs; their sums are wrong, and nothing is written)")
    ap.add_argument("--json", default=None)
    results.add_arguments(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_wgrad_trace.py needs a GPU (Hopper, a Triton with Gluon)")
    from distwgrad.kernels import current
    warps = args.epilogue_warps or [current().grouped_gemm_fp8.wgrad_gluon_epilogue_warps]
    rows = [run(s, r, args.accumulate, w, dry) for s in args.shapes for r in args.routing for w in warps
            for dry in ((False, True) if args.dry else (False,))]
    if args.unzeroed:
        rows += [run(s, r, args.accumulate, w, True, zero_edges=False) for s in args.shapes for r in args.routing
                 for w in warps]
    cols = ("tflops", "ms_traced", "chunks_per_tile", "cycles_per_tile", "cycles_per_later_chunk", "share_begin",
            "share_handoff", "share_chunks", "share_between")
    print(f"{'shape':>20} {'routing':>9} {'op':>16} {'epi':>3} {'ms':>7} " + " ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(f"{','.join(map(str, r['shape'])):>20} {r['routing']:>9} {r['op']:>16} {r['epilogue_warps']:>3} "
              f"{r['ms']:7.3f} " + " ".join(f"{r[c]:12.3f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    results.record(results.from_records(rows, bench="fp8_wgrad_trace", precision="fp8_per_tensor", device="cuda",
                                        case_keys=("routing", "epilogue_warps"),
                                        metrics={"tflops": "TFLOP/s", "ms": "ms", "ms_traced": "ms"}), args)


if __name__ == "__main__":
    main()
