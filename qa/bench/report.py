"""Generates ``docs/benchmarks.md`` (and the grouped GEMM plot) from ``docs/benchmarks/results.jsonl``.

    PYTHONPATH=. python qa/bench/report.py            # rewrite docs/benchmarks.md and the plot
    PYTHONPATH=. python qa/bench/report.py --check    # exit 1 when docs/benchmarks.md is stale (CI, tests)

The page shows current results only: each line of a table (a case, world and precision) keeps the rows
of its newest run that measured the most columns (its ``date`` and ``commit``), from one process ([Note: one
process per line]).
Each bench is one table: one row per case, precision, world and metric, one column per ``impl`` (or per
``precision``, where a bench compares precisions), and the ratio of every other column to the baseline
column (``distwgrad`` unless ``_LAYOUT`` says otherwise). Under each table: the commands, commits, dates,
devices and versions its rows came from.
History (what was tried, what lost, and why) lives in ``docs/benchmarks/LOG.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: put the repository root on the path for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402

__all__ = ["current", "render", "plot_grouped_gemm", "main"]

PAGE = results.RESULTS.parents[1] / "benchmarks.md"
PLOT = results.RESULTS.parent / "grouped_gemm_h200.png"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one bench's table is laid out.

    Args:
        title: the table's heading.
        columns: the field whose values become columns ("impl" or "precision").
        baseline: the column the others are divided by (ratios are shown when it is present).
        metrics: the metrics shown (``None``: all); the rest stay in results.jsonl.
        only: ``(field, values)`` pairs: rows whose field is not among the values are left off the page
            (they stay in results.jsonl).
        on_page: False keeps the whole bench off the page (an A/B whose result the log discusses).
        off_page: cases kept off the page (likewise: a variant of a run that the log discusses).
    """

    title: str
    columns: str = "impl"
    baseline: str = "distwgrad"
    metrics: tuple[str, ...] | None = None
    only: tuple[tuple[str, tuple[str, ...]], ...] = ()
    on_page: bool = True
    off_page: tuple[str, ...] = ()

    def __post_init__(self):
        if self.columns not in ("impl", "precision"):
            raise ValueError(f"Layout.columns must be 'impl' or 'precision', got {self.columns!r}")


_LAYOUT = {
    "train_step": Layout("Training step: distwgrad against FSDP2 and plain torch (a run before `68697e9` timed "
                         "distwgrad first in every round, which favours it by up to 2-4%)",
                         metrics=("tokens_per_s", "peak_gib", "collectives_per_step"),
                         off_page=("large b8x2048 compiled, two builds",  # all three discussed in LOG.md, 2026-12-02
                                   "large d_model=4096 n_layers=2 n_heads=32 n_experts=8 d_ff=14336 b4x2048 eager",
                                   "large b8x2048 mb2 cuda_graph",  # and in docs/fp8.md
                                   "large b8x2048 cuda_graph",  # graphed eager: compiled_cuda_graph is faster
                                   # the blockwise wgrad's A/B: LOG.md, 2026-12-02 (late night)
                                   "large b8x2048 compiled_cuda_graph, triton blockwise wgrad",
                                   # the weight lifecycle against the commit before it: LOG.md, 2026-12-05
                                   "large b8x2048 eager, commits A/B",
                                   "large b8x2048 compiled_cuda_graph, commits A/B",
                                   # the first-write flag off and on: LOG.md, 2026-12-05 (fourth)
                                   "large b8x2048 compiled_cuda_graph, first-write flag A/B (H100)",
                                   "large b8x2048 eager (H100)",  # beside torchao: docs/fp8.md
                                   # the accumulating wgrad's dispatch: LOG.md, 2026-12-06 (later)
                                   "large b8x2048 mb2 compiled_cuda_graph, wgrad dispatch A/B",
                                   # cached launches, and the recipes profiled: LOG.md, 2026-12-06 (evening)
                                   "large b8x2048 compiled, launches A/B (H100)",
                                   "large b8x2048 eager, launches A/B (H100)",
                                   "large b8x2048 compiled, recipes profiled (H100)",
                                   "large b8x2048 mb2 compiled, recipes profiled (H100)",
                                   *(f"large b8x2048 {mb}{mode}, recipes (H100)" for mb in ("", "mb2 ")
                                     for mode in ("eager", "compiled", "compiled_cuda_graph")),
                                   # the recipes at 4a57d04, the RMSNorm and rotary A/Bs: LOG.md, 2026-12-06 (midday)
                                   "large b8x2048 eager, recipes profiled (H100)",
                                   "large b8x2048 eager, RMSNorm A/B (H100)",
                                   "large b8x2048 eager, rotary A/B (H100)",
                                   # two-microbatch FP8 steps, process to process: LOG.md, 2026-12-06 (afternoon)
                                   "large b8x2048 mb2 compiled, host spread (H100)",
                                   "large b8x2048 mb2 eager, host spread (H100)",
                                   # FP8 weights kept across microbatches: LOG.md, 2026-12-06 (late afternoon)
                                   *(f"large b8x2048 mb2 {mode}, fp8 weights kept, interleaved (H100)"
                                     for mode in ("eager", "compiled")),
                                   # graphed two-microbatch steps re-measured: LOG.md, 2026-12-06 (late evening)
                                   "large b8x2048 mb2 compiled_cuda_graph, fp8 weights at every use (H100)",
                                   # and kept in the graphs: LOG.md, 2026-12-06 (late night)
                                   "large b8x2048 mb2 compiled_cuda_graph, fp8 weights kept in graphs (H100)",
                                   # a Linear's FP8 GEMMs on cuBLASLt, on and off: LOG.md, 2026-12-06 (night)
                                   *(f"large b8x2048 {mb}{mode}, Linear cuBLASLt A/B (H100)"
                                     for mb, mode in (("", "eager"), ("", "compiled"), ("mb2 ", "compiled"))),
                                   # and blockwise: LOG.md, 2026-12-06 (morning)
                                   *(f"large b8x2048 {mode}, Linear cuBLASLt blockwise A/B (H100)"
                                     for mode in ("eager", "compiled")),
                                   # the xl preset's plain build and torchao, in a process of their own (one
                                   # xl build fits an H200 at a time), and the H100's side by side: docs/fp8.md
                                   "xl b8x2048 compiled_cuda_graph, the plain build and torchao",
                                   "large b8x2048 compiled (H100)",
                                   # xl's shapes at 3 layers (an H100 holds them), every mode: docs/fp8.md
                                   *(f"xl n_layers=3 b8x2048 {mb}{mode} (H100)" for mb, mode in (
                                       ("", "eager"), ("", "compiled"), ("", "compiled_cuda_graph"),
                                       ("mb2 ", "compiled_cuda_graph"))),
                                   "xl n_layers=3 b8x2048 compiled, recipes profiled (H100)",
                                   "large b8x2048 mb2 eager",  # two microbatches: docs/fp8.md has the H100's
                                   "small b16x64 mb2 eager")),  # CPU ranks: small b16x128 supersedes it
    "layer_step": Layout("Layer step (forward, backward, deferred wgrads, finalize): FP8 against bf16 (TFLOP/s)",
                         columns="precision", baseline="bf16", metrics=("tflops",),
                         only=(("impl", ("distwgrad",)),),  # not layer_step.py --tunings' rows (distwgrad@...)
                         off_page=("moe E=8 T=32768 K=4096 N=14336 top_k=2 (H100)",)),  # beside torchao: docs/fp8.md
    "loss_curve": Layout("The job's loss curves: an FP8 run's distance from bf16's, bf16's from fp32's "
                         "([Note: the FP8 loss bound] in `qa/bench/loss_curves.py`: within the bound at <= 2.00x)",
                         columns="precision", baseline="bf16", metrics=("distance",),
                         off_page=("tiny 200 steps seed 0",)),  # the CPU preset: the large preset's seeds decide
    "train_job": Layout("Training job (`distwgrad.launch.train`)"),
    "grouped_gemm": Layout("Grouped GEMM, bf16 (TFLOP/s)", baseline="torch_grouped_mm", metrics=("tflops",),
                           off_page=(*(f"{op} E=16 T=32768 K=2048 N=2048 (H100)"  # LOG.md, 2026-12-06 (later)
                                       for op in ("fprop", "dgrad", "wgrad", "wgrad_accumulate")),
                                     *(f"wgrad_accumulate {shape}, wgrad dispatch A/B"  # the same entry
                                       for shape in ("E=16 T=32768 K=2048 N=2048", "E=16 T=16384 K=2048 N=2048",
                                                     "E=8 T=32768 K=4096 N=14336", "E=64 T=16384 K=2048 N=768")))),
    "dtype_paths": Layout("Grouped GEMM by dtype: distwgrad's route against torch's (TFLOP/s, host time included)",
                          baseline="loop", metrics=("tflops",), on_page=False),  # LOG, 2026-12-01
    "grouped_gemm_tails": Layout("Grouped GEMM tail tiles, bf16 (TFLOP/s)", baseline="distwgrad_full_tail",
                                 on_page=False),
    "fp8_grouped_gemm": Layout("FP8 grouped GEMM against our bf16 (TFLOP/s; `_wT`, `_aligned`, `_bf16out`: "
                               "the modules' operand layouts and output)", columns="precision", baseline="bf16",
                               metrics=("tflops",),
                               only=(("impl", ("distwgrad", "distwgrad_wT", "distwgrad_aligned",
                                               "distwgrad_bf16out")),)),
    "fp8_module": Layout("FP8 GroupedLinear steps (ms per step)", columns="precision", baseline="bf16",
                         only=(("impl", ("distwgrad",)),), on_page=False),  # the layer step supersedes it
    "fp8_module_host": Layout("FP8 GroupedLinear host time per step", columns="precision", baseline="bf16",
                              on_page=False),
    "fp8_quantize": Layout("FP8 quantization (GB/s, bytes read + written)", baseline="torch_clone",
                           off_page=("copy 8192x16384 fp32", "per_tensor 8192x16384 fp32",  # fp32 inputs:
                                     "rowcol_per_tensor 8192x16384 fp32")),  # LOG.md, 2026-12-03 (morning)
    "step_phases": Layout("Host against device time per phase of a training step (ms)", on_page=False),
    "pipeline_bubble": Layout("Pipeline schedules on CPU, measured and predicted", on_page=False),  # docs/pipeline.md
    "experts": Layout("Expert parallelism: CPU ranks' steps and bytes, one GPU's experts", on_page=False),  # experts.md
    "grouped_gemm_fp32_weights": Layout("Grouped GEMM reading fp32 weights against the cast and the bf16 GEMM (ms)",
                                        baseline="cast+distwgrad", metrics=("ms",), on_page=False),  # LOG, 2026-12-03
    "ncu_wgrad": Layout("The FP8 wgrad's Nsight Compute counters", columns="precision", on_page=False),
    "promoting_loop_partitions": Layout("The fp8 promoting loop alone: the MMA warpgroups in lockstep or as two "
                                        "partitions", baseline="lockstep", on_page=False),  # LOG, 2026-12-03
    "fp8_transpose": Layout("FP8 transposes (GB/s)", baseline="plain_triton",
                            only=(("precision", ("fp8_per_tensor",)),), on_page=False),
}
_ORDER = ("train_step", "layer_step", "loss_curve", "train_job", "grouped_gemm", "dtype_paths", "grouped_gemm_tails",
          "fp8_grouped_gemm", "fp8_module", "fp8_module_host", "fp8_quantize", "fp8_transpose", "step_phases",
          "grouped_gemm_fp32_weights", "ncu_wgrad", "promoting_loop_partitions")
_KEY = ("case", "impl", "precision", "world", "metric")


def current(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of each line of each ``(bench, case)`` table (its world and the field that is not the
    columns: precision where the columns are impls, impl where they are precisions) from the line's newest
    commit (that of its latest date), and of that commit one process only.

    [Note: one process per line]
    A line's cells are compared with each other (the ratio columns), and only measurements of one process
    compare. Several processes may have measured a line (the full comparison, an A/B of two builds, one
    build's precisions), so each line keeps the rows of one run (a commit and a command): the one that
    measured the most columns, the newest of those. So a later run of distwgrad alone does not replace a
    side-by-side comparison on the page (it is in the results file and the log). Lines are current each on
    its own: a newer run that measured only some precisions of a case leaves the other precisions' lines
    at their newest run.

    [Note: rotated runs first]
    A run whose builds were timed in a rotated order (its rows' ``timing`` says "order rotated": each build
    in each place of a round, [Note: each build in each place of a round] in ``train_step.py``) is preferred
    over any run that timed them in a fixed order, whatever the columns: the fixed order favoured the build
    timed first by up to 2-4% (LOG.md, 2026-12-02 (night)), which is the size of the ratios the page reports.
    """
    lines: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        col = _LAYOUT.get(r["bench"], Layout(r["bench"])).columns
        field = "impl" if col == "precision" else "precision"
        lines[(r["bench"], r["case"], r["world"], r[field])].append(r)
    out = []
    for (bench, *_), group in lines.items():
        col = _LAYOUT.get(bench, Layout(bench)).columns
        runs: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for r in group:
            runs[(r["commit"], r["command"])].append(r)
        out += max(runs.values(),
                   key=lambda rs: (_rotated(rs), len({r[col] for r in rs}), max(r["date"] for r in rs)))
    return out


def _rotated(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether a run timed its builds in a rotated order ([Note: rotated runs first])."""
    return any("order rotated" in str(r.get("timing", "")) for r in rows)


def _fmt(v: float) -> str:
    a = abs(v)
    return f"{v:,.0f}" if a >= 1000 else f"{v:.0f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.3g}"


def _distinct(rows: Sequence[dict[str, Any]], field: str) -> list[str]:
    return sorted({str(r.get(field)) for r in rows})


def _table(bench: str, rows: list[dict[str, Any]]) -> list[str]:
    layout = _LAYOUT.get(bench, Layout(f"`{bench}`"))
    if not layout.on_page:
        return []
    if layout.metrics is not None:
        rows = [r for r in rows if r["metric"] in layout.metrics]
    for field, values in layout.only:
        rows = [r for r in rows if r[field] in values]
    rows = [r for r in rows if r["case"] not in layout.off_page]
    if not rows:
        return []
    col = layout.columns
    keep = [f for f in _KEY if f != col]
    # A field with one value in every row goes into the heading, not a column.
    same = [f for f in keep if f != "case" and len({r[f] for r in rows}) == 1]
    keep = [f for f in keep if f not in same]
    heading = ", ".join(f"{f} {rows[0][f]}" + (f" ({rows[0]['unit']})" if f == "metric" else "") for f in same)
    columns = list(dict.fromkeys(r[col] for r in rows))
    if layout.baseline in columns:
        columns.remove(layout.baseline)
        columns.insert(0, layout.baseline)
    cells: dict[tuple, dict[str, float]] = defaultdict(dict)
    default: dict[tuple, dict[str, float]] = {}  # per case: the default impl's cells (ratio fallback)
    units: dict[tuple, str] = {}
    for r in rows:
        k = tuple(r[f] for f in keep)
        cells[k][r[col]] = r["value"]
        units[k] = r["unit"]
        if col == "precision" and r["impl"] == "distwgrad":
            default.setdefault((r["case"], r["world"], r["metric"]), {})[r[col]] = r["value"]
    ratio_cols = [c for c in columns if c != layout.baseline] if layout.baseline in columns else []
    head = [*keep, *columns, *(f"{c} / {layout.baseline}" for c in ratio_cols)]
    lines = [f"## {layout.title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, vals in cells.items():
        if all(v == 0 for v in vals.values()):  # nothing to compare (one rank's collectives, say)
            continue
        shown = [f"{v} ({units[k]})" if f == "metric" else str(v) for f, v in zip(keep, k, strict=True)]
        shown += [_fmt(vals[c]) if c in vals else "" for c in columns]
        base = vals.get(layout.baseline)
        if base is None:  # a variant row: against the default impl's baseline of the same case
            named = dict(zip(keep, k, strict=True))
            base = default.get((named["case"], named.get("world", rows[0]["world"]),
                                named.get("metric", rows[0]["metric"])), {}).get(layout.baseline)
        shown += [f"{vals[c] / base:.2f}x" if c in vals and base else "" for c in ratio_cols]
        lines.append("| " + " | ".join(shown) + " |")
    lines += ["", (f"Every row: {heading}. " if heading else "") + _provenance(rows), ""]
    return lines


def _provenance(rows: Sequence[dict[str, Any]]) -> str:
    first: dict[tuple[str, str], str] = {}  # (command, commit) -> its first row's date
    for r in rows:
        key = (r["command"], r["commit"])
        first[key] = min(first.get(key, r["date"]), r["date"])
    cmds = "; ".join(f"`{cmd}` at `{commit}` ({date})" for (cmd, commit), date in sorted(first.items(),
                                                                                        key=lambda kv: kv[1]))
    return (f"Run: {cmds}. Device: {', '.join(_distinct(rows, 'device'))}; torch "
            f"{', '.join(_distinct(rows, 'torch'))}, triton {', '.join(_distinct(rows, 'triton'))}.")


_HEADER = """# Benchmarks

<!-- Generated by qa/bench/report.py from docs/benchmarks/results.jsonl; edit those, not this page. -->

Current results: the newest run of each case, with its command, commit, date, device and versions; peers
ran side by side in one process. Every row is in [`benchmarks/results.jsonl`](benchmarks/results.jsonl)
(appended by the `qa/bench/*.py` scripts); history, negative results and the why of the tuning are in
[`benchmarks/LOG.md`](benchmarks/LOG.md). `PYTHONPATH=. python qa/bench/report.py` regenerates this page.

![grouped GEMM, bf16, TFLOP/s](benchmarks/grouped_gemm_h200.png)
"""


def render(rows: Iterable[dict[str, Any]]) -> str:
    """The whole page for ``rows`` (all of results.jsonl; only the current ones are shown)."""
    by_bench: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in current(rows):
        by_bench[r["bench"]].append(r)
    order = [b for b in _ORDER if b in by_bench] + sorted(b for b in by_bench if b not in _ORDER)
    lines = [_HEADER]
    for bench in order:
        lines += _table(bench, by_bench[bench])
    return "\n".join(lines).rstrip() + "\n"


def plot_grouped_gemm(rows: Iterable[dict[str, Any]], path: Path = PLOT) -> bool:
    """TFLOP/s by op and shape of the current grouped GEMM rows on the page, one bar per impl; False without rows."""
    off = _LAYOUT["grouped_gemm"].off_page
    rows = [r for r in current(rows)
            if r["bench"] == "grouped_gemm" and r["metric"] == "tflops" and r["case"] not in off]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    value = {(r["case"], r["impl"]): r["value"] for r in rows}
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        xs = [j + i * width for j, c in enumerate(cases) if (c, impl) in value]
        ax.bar(xs, [value[(c, impl)] for c in cases if (c, impl) in value], width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels([c.replace(" ", "\n") for c in cases], fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Grouped GEMM, bf16, {', '.join(_distinct(rows, 'device'))} at "
                 f"{', '.join(_distinct(rows, 'commit'))}")
    ax.set_ylim(0, 1.15 * max(value.values()))
    ax.legend(fontsize=8, loc="upper center", ncol=len(impls))
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="fail when the page differs from what results.jsonl gives")
    p.add_argument("--results", default=str(results.RESULTS), help="the results file (default: the repository's)")
    p.add_argument("--page", default=str(PAGE), help="the page to write or check")
    p.add_argument("--no-plot", action="store_true", help="do not redraw the grouped GEMM plot")
    args = p.parse_args(argv)
    rows = results.load(args.results)
    page = render(rows)
    target = Path(args.page)
    if args.check:
        if not target.exists() or target.read_text() != page:
            print(f"{target} is stale: run `PYTHONPATH=. python qa/bench/report.py`", file=sys.stderr)
            return 1
        return 0
    target.write_text(page)
    if not args.no_plot:
        plot_grouped_gemm(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
