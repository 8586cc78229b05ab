"""Summarises an Nsight Compute report on the machine that made it: per kernel, the headline throughput
and scheduler numbers and, for a report of one kernel, the warp-state (stall) breakdown and the SASS
instructions with the most stall samples.

    ncu --profile-from-start off --set full --import-source no -o rep python qa/bench/gemm_profile.py --ncu
    python qa/bench/ncu_hotspots.py rep.ncu-rep [--top 30]

(the SASS hot spots are read for a report that holds one kernel: profile one target per report)
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess

HEADLINE = ("Warp State", "Scheduler", "Duration", "SM Frequency", "Compute (SM) Throughput", "L2 Cache Throughput",
            "Registers Per Thread", "Achieved Occupancy")
# raw-page metrics read as "% of peak, elapsed" (a column ends with the name; ncu may prefix a section):
# how busy the tensor pipes were, and the shared-memory and TMA traffic beside them
PIPES = (("tensor pipes", "sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed"),
         ("shared-memory LSU", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed"),
         ("of it loads", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum.pct_of_peak_sustained_elapsed"),
         ("of it stores", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum.pct_of_peak_sustained_elapsed"),
         ("TMA loads", "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum.pct_of_peak_sustained_elapsed"))


def parse_csv(text: str, source_page: bool = False) -> list[dict]:
    """Rows of ncu's ``--csv`` output (lines that are not CSV records dropped); the source page opens
    with a ``"Kernel Name",<name>`` line before its header, which is skipped."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if source_page and lines and lines[0].startswith('"Kernel Name"'):
        lines = lines[1:]
    return [{k: v for k, v in r.items() if k is not None} for r in csv.DictReader(io.StringIO("\n".join(lines)))]


def _num(v) -> float:
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def summary(details: list[dict], raw: list[dict] | None = None, source: list[dict] | None = None,
            top: int = 30) -> list[str]:
    """The report's lines: per kernel of the details page its headline metrics; with one kernel, the
    sampled stall reasons of the raw page (as shares) and the ``top`` SASS lines of the source page
    by stall samples (as shares of all samples)."""
    kernels: dict[str, dict] = {}
    for r in details:
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"][:70], "m": {}})
        k["m"][f'{r["Section Name"]} / {r["Metric Name"]} [{r["Metric Unit"]}]'] = r["Metric Value"]
    out = []
    if len(kernels) != 1:
        out.append(f"{len(kernels)} kernels in the report: stalls and SASS lines are read for one kernel only")
    for kid, k in kernels.items():
        out.append(f"== {kid} {k['name']}")
        out += [f"   {name}: {v}" for name, v in k["m"].items() if any(s in name for s in HEADLINE)]
    if len(kernels) != 1:
        return out
    if raw:
        pipes = [f"{label} {_num(v):.1f}%" for label, name in PIPES
                 for k, v in raw[-1].items() if k and k.endswith(name) and (k == name or k[-len(name) - 1] == ".")]
        if pipes:
            out.append("   % of peak: " + ", ".join(pipes))
        stalls = {k.split("issue_stalled_")[1]: _num(v) for k, v in raw[-1].items()
                  if k.startswith("smsp__pcsamp") and "issue_stalled_" in k and not k.endswith("_not_issued")}
        tot = sum(stalls.values()) or 1.0
        out.append("   stall samples (all warps): " + ", ".join(
            f"{k} {100 * v / tot:.1f}%" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]) if v))
    if source:
        key = next((c for c in source[0] if c.startswith("Warp Stall Sampling (All")), None)
        if key is None:
            out.append(f"   no stall-sample column among {list(source[0])[:30]}")
            return out
        total = sum(_num(r.get(key)) for r in source) or 1.0
        out.append(f"   top {top} of {len(source)} SASS lines by '{key}' (total {total:.0f}):")
        for r in sorted(source, key=lambda r: _num(r.get(key)), reverse=True)[:top]:
            share = 100 * _num(r.get(key)) / total
            out.append(f"   {share:5.1f}%  {r.get('Address', '')}  {r.get('Source', '')[:110]}")
    return out


def _ncu(*args: str) -> str:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    return subprocess.run([ncu, *args, "--csv"], capture_output=True, text=True, check=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--raw", nargs="+", default=(), metavar="SUBSTRING",
                    help="also print every raw-page metric whose name contains one of these (e.g. pipe_tensor)")
    args = ap.parse_args()
    details = parse_csv(_ncu("-i", args.report, "--page", "details"))
    raw = parse_csv(_ncu("-i", args.report, "--page", "raw"))
    for k, v in (raw[-1].items() if raw and args.raw else ()):
        if k and any(sub in k for sub in args.raw):
            print(f"{k}: {v} {raw[0].get(k, '')}")
    try:
        source = parse_csv(_ncu("-i", args.report, "--page", "source", "--print-source", "sass"), source_page=True)
    except subprocess.CalledProcessError as exc:
        print("(no source page:", exc.stderr[-300:], ")")
        source = None
    print("\n".join(summary(details, raw, source, args.top)))


if __name__ == "__main__":
    main()
