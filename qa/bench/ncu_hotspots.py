"""Summarises an Nsight Compute report on the machine that made it: per kernel, the warp-state
(stall) breakdown, and the SASS instructions with the most stall samples.

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


def _ncu(*args: str) -> list[dict]:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    out = subprocess.run([ncu, *args, "--csv"], capture_output=True, text=True, check=True).stdout
    lines = [l for l in out.splitlines() if l.startswith('"')]
    if lines and lines[0].startswith('"Kernel Name"') and "--page" in args and "source" in args:
        lines = lines[1:]  # the source page opens with a "Kernel Name",<name> line
    rows = csv.DictReader(io.StringIO("\n".join(lines)))
    return [{k: v for k, v in r.items() if k is not None} for r in rows]


def _num(v) -> float:
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    details = _ncu("-i", args.report, "--page", "details")
    kernels = {}
    for r in details:
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"][:70], "m": {}})
        k["m"][f'{r["Section Name"]} / {r["Metric Name"]} [{r["Metric Unit"]}]'] = r["Metric Value"]
    if len(kernels) != 1:
        print(f"{len(kernels)} kernels in the report: the source page is read for a report of one kernel only")
    for kid, k in kernels.items():
        print(f"== {kid} {k['name']}")
        for name, v in k["m"].items():
            if any(s in name for s in ("Warp State", "Scheduler", "Duration", "SM Frequency", "Compute (SM) Throughput",
                                       "L2 Cache Throughput", "Registers Per Thread", "Achieved Occupancy")):
                print(f"   {name}: {v}")
        if len(kernels) != 1:
            continue
        raw = _ncu("-i", args.report, "--page", "raw")
        if raw:
            stalls = {k.split("issue_stalled_")[1]: _num(v) for k, v in raw[-1].items()
                      if "issue_stalled_" in k and k.startswith("smsp__pcsamp") and not k.endswith("_not_issued")}
            if not stalls:
                print("   raw stall metrics:", [k for k in raw[-1] if "stall" in k][:40])
            tot = sum(stalls.values()) or 1.0
            print("   stall samples (all warps):", ", ".join(f"{k} {100 * v / tot:.1f}%" for k, v in
                                                            sorted(stalls.items(), key=lambda kv: -kv[1]) if v))
        try:
            src = _ncu("-i", args.report, "--page", "source", "--print-source", "sass")
        except subprocess.CalledProcessError as exc:
            print("   (no source page:", exc.stderr[-300:], ")")
            continue
        if not src:
            continue
        cols = list(src[0])
        key = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
        if key is None:
            print("   source columns:", cols[:30], src[:2])
            continue
        val = lambda r: _num(r.get(key) or 0)
        total = sum(val(r) for r in src) or 1.0
        print(f"   top {args.top} of {len(src)} SASS lines by '{key}' (total {total:.0f}):")
        for r in sorted(src, key=val, reverse=True)[:args.top]:
            print(f"   {100 * val(r) / total:5.1f}%  {r.get('Address', '')}  {r.get('Source', '')[:110]}")


if __name__ == "__main__":
    main()
