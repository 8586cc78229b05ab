"""The training job's loss curves under FP8 against bf16, and bf16 against fp32: the FP8 loss bound.

    # four runs of the job, alike but for the precision (CPU, tiny preset: 1.5-7 minutes each; on a GPU add
    # --model large), then the comparison (prints the table, appends the rows to the results file)
    python -m distwgrad.launch.train --precision fp32 --steps 200 --out runs/curve_fp32
    python -m distwgrad.launch.train --precision bf16 --steps 200 --out runs/curve_bf16
    python -m distwgrad.launch.train --precision bf16 --recipe fp8_per_tensor --steps 200 --out runs/curve_pt
    python -m distwgrad.launch.train --precision bf16 --recipe fp8_blockwise --steps 200 --out runs/curve_bw
    python qa/bench/loss_curves.py runs/curve_fp32 runs/curve_bf16 runs/curve_pt runs/curve_bw

[Note: the FP8 loss bound]
Training is chaotic: any change of rounding moves a loss curve away from another by more than the change
itself, so no fixed tolerance says what an FP8 run may cost. The bound is measured instead from what is
already accepted: how far the bf16 run lies from the fp32 run of the same job (same sizes, seed, data and
steps). The distance of run a from run b is the largest difference of their trailing means of ``WINDOW``
steps (a mean, since one step's loss moves with its batch), from the first full window on, each step's
difference over the fp32 run's mean there (one fixed scale for every pair, so the distance is a metric).
An FP8 run that costs the curve no more than bf16 did lies within d(bf16, fp32) of the fp32 run, and so, by
the triangle inequality, within 2 d(bf16, fp32) of the bf16 run: that is the bound on its distance from
the bf16 curve. Its own distance from the fp32 run is printed beside it. One seed of each run is one
sample of a chaotic process: a run near the bound says little either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: put the repository root on the path for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402

WINDOW = 20
# what may differ between the compared runs; every other config field must agree
_FREE = ("precision", "recipe", "out", "log_every", "save_every", "keep_last", "resume", "progress", "timeout",
         "check_parity", "gc_every")


def trailing_means(losses: list[float], window: int = WINDOW) -> list[float]:
    """The mean of each step's last ``window`` losses, from the first full window on."""
    return [sum(losses[i - window:i]) / window for i in range(window, len(losses) + 1)]


def _differences(a: list[float], b: list[float], scale: list[float], window: int) -> list[float]:
    """a's trailing mean minus b's at each step, over ``scale``'s trailing mean there."""
    if not len(a) == len(b) == len(scale) or len(a) < window:
        raise ValueError(f"loss_curves: curves of one length >= {window} steps, got {len(a)}, {len(b)} and "
                         f"{len(scale)}")
    return [(x - y) / abs(z) for x, y, z in zip(trailing_means(a, window), trailing_means(b, window),
                                               trailing_means(scale, window))]


def distance(a: list[float], b: list[float], scale: list[float], window: int = WINDOW) -> float:
    """[Note: the FP8 loss bound]: the largest difference of a's and b's trailing means, each over ``scale``'s
    (the fp32 run's losses) trailing mean at that step."""
    return max(abs(d) for d in _differences(a, b, scale, window))


def above(a: list[float], b: list[float], scale: list[float], window: int = WINDOW) -> float:
    """How far a's trailing mean rose above b's at most, over ``scale``'s trailing mean (negative: a was below b
    at every step). Printed beside the distance, which counts a run below its reference as much as one above."""
    return max(_differences(a, b, scale, window))


def _name(config: dict) -> str:
    return config["recipe"] if config.get("recipe", "none") != "none" else config["precision"]


def load_runs(dirs: list[str]) -> dict[str, dict]:
    """Each run's report (``report.json`` of the job's ``--out``, or a report file itself), by its precision
    name; the runs must agree on every config field but the precision, the recipe and where they wrote."""
    runs: dict[str, dict] = {}
    for d in dirs:
        path = Path(d) if Path(d).is_file() else Path(d) / "report.json"
        if not path.is_file():
            raise FileNotFoundError(f"loss_curves: {path} does not exist (a run folder of distwgrad.launch.train, "
                                    f"or its report.json)")
        report = json.loads(path.read_text())
        name = _name(report["config"])
        if name in runs:
            raise ValueError(f"loss_curves: two runs of {name}: {runs[name]['dir']} and {d}")
        runs[name] = {**report, "dir": d}
    first = next(iter(runs.values()))
    for run in runs.values():
        for key, value in first["config"].items():
            if key not in _FREE and run["config"].get(key) != value:
                raise ValueError(f"loss_curves: the runs differ in {key}: {value!r} ({first['dir']}) and "
                                 f"{run['config'].get(key)!r} ({run['dir']})")
    for need in ("fp32", "bf16"):
        if need not in runs:
            raise ValueError(f"loss_curves: no {need} run among {sorted(runs)}: the bound needs fp32 and bf16")
    return runs


def first_steps(runs: dict[str, dict], steps: int | None) -> dict[str, dict]:
    """Each run's losses cut to its first ``steps`` (all of them for None): a run stopped early is compared over
    the steps every run trained."""
    if steps is None:
        lengths = {name: len(run["loss"]) for name, run in runs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"loss_curves: the runs trained different numbers of steps, {lengths}; --steps N "
                             f"compares the first N of each")
        return runs
    short = {name: len(run["loss"]) for name, run in runs.items() if len(run["loss"]) < steps}
    if short:
        raise ValueError(f"loss_curves: steps={steps} but these runs trained fewer: {short}")
    return {name: {**run, "loss": run["loss"][:steps]} for name, run in runs.items()}


def compare(runs: dict[str, dict], window: int = WINDOW) -> list[dict]:
    """One record per run but fp32: its distance from its reference (bf16 from fp32, FP8 from bf16), the bound on
    that distance (bf16's: none; FP8's: 2 d(bf16, fp32)), whether it is within (None for bf16), how far it rose
    above its reference at most (``above``), and its distance from fp32."""
    fp32 = runs["fp32"]["loss"]
    base = distance(runs["bf16"]["loss"], fp32, fp32, window)
    out = []
    for name, run in runs.items():
        if name == "fp32":
            continue
        ref = "fp32" if name == "bf16" else "bf16"
        d = distance(run["loss"], runs[ref]["loss"], fp32, window)
        bound = None if name == "bf16" else 2 * base
        out.append({"precision": name, "reference": ref, "distance": d, "bound": bound,
                    "within": None if bound is None else d <= bound,
                    "above": above(run["loss"], runs[ref]["loss"], fp32, window),
                    "from_fp32": distance(run["loss"], fp32, fp32, window),
                    "final_mean": trailing_means(run["loss"], window)[-1]})
    return out


def _provenance(run: dict) -> dict:
    """Where the runs ran, from their report (the job's ``device_name``; reports written before it had only the
    device, ``cuda:0``), so that the rows name the machine of the runs, not of this comparison."""
    return {"device": run.get("device_name", run["device"]), "torch": run.get("torch"),
            "triton": run.get("triton")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders of distwgrad.launch.train (--out) or their report.json "
                   "files, one fp32 and one bf16 among them")
    p.add_argument("--window", type=int, default=WINDOW, help="steps in each trailing mean")
    p.add_argument("--steps", type=int, default=None, help="compare the first N steps of every run (default: all; "
                   "for a run stopped early)")
    results.add_arguments(p)
    args = p.parse_args(argv)
    if args.window < 1:
        p.error(f"--window must be >= 1, got {args.window}")
    if args.steps is not None and args.steps < args.window:
        p.error(f"--steps must be >= --window ({args.window}), got {args.steps}")
    try:
        runs = first_steps(load_runs(args.runs), args.steps)
        records = compare(runs, args.window)
    except (ValueError, FileNotFoundError) as exc:  # runs that cannot be compared: the reason, no traceback
        p.error(str(exc))
    cfg = runs["fp32"]["config"]
    case = f"{cfg['model']} {len(runs['fp32']['loss'])} steps seed {cfg['seed']}"
    base = next(r["distance"] for r in records if r["precision"] == "bf16")
    print(f"{case}: distance = largest difference of {args.window}-step trailing mean losses over fp32's; "
          f"d(bf16, fp32) = {base:.4f}, so an FP8 run's bound from bf16 is {2 * base:.4f}")
    print(f"{'run':16s} {'vs':5s} {'distance':>9s} {'bound':>7s} {'above':>8s} {'from fp32':>10s} "
          f"{'final mean':>11s}  within")
    for r in records:
        bound = "-" if r["bound"] is None else f"{r['bound']:.4f}"
        print(f"{r['precision']:16s} {r['reference']:5s} {r['distance']:9.4f} {bound:>7s} {r['above']:8.4f} "
              f"{r['from_fp32']:10.4f} {r['final_mean']:11.4f}  "
              f"{'-' if r['within'] is None else 'yes' if r['within'] else 'NO'}")
    fp32_final = trailing_means(runs["fp32"]["loss"], args.window)[-1]
    print(f"{'fp32':16s} {'':5s} {'':9s} {'':7s} {'':8s} {0.0:10.4f} {fp32_final:11.4f}")
    rows = [{**results.row(bench="loss_curve", case=case, impl="distwgrad", precision=r["precision"],
                           world=int(runs["fp32"]["world_size"]), metric="distance", value=r["distance"],
                           unit="relative", reference=r["reference"], bound=r["bound"], within=r["within"],
                           above=r["above"], from_fp32=r["from_fp32"], window=args.window),
             **_provenance(runs["fp32"])}
            for r in records]
    results.record(rows, args)
    return 0 if all(r["within"] is not False for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
