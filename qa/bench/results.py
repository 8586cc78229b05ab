"""The one results file every benchmark appends to: ``docs/benchmarks/results.jsonl``.

One JSON object per line, self-describing, so a table or a plot can be rebuilt from the file alone:

    bench      which script ("train_step", "layer_step", "grouped_gemm", "fp8", ...)
    case       what was measured (a model preset and batch, an op and shape)
    impl       whose code ("distwgrad", "fsdp2", "torch", "torch_grouped_mm", "loop", ...)
    precision  "fp32", "bf16", "fp16", "fp8_per_tensor", "fp8_blockwise", ...
    world      ranks taking part
    metric     "step_ms", "tokens_per_s", "peak_gib", "mfu", "tflops", "gbps", ...
    value, unit
    device     ``torch.cuda.get_device_name()`` or "cpu"
    commit     ``git rev-parse --short HEAD`` (with "+dirty" when the tree has uncommitted changes)
    date       UTC, ISO 8601
    torch, triton   versions (triton: None when it does not import)
    command    the command line that produced the row

:func:`row` fills the provenance fields; :func:`append` writes rows (rank 0 only under torchrun);
:func:`load` reads them back. Scripts take ``--no-record`` / ``--results PATH`` (:func:`add_arguments`) and
call :func:`record`. ``DISTWGRAD_RESULTS`` names another file for both (the tests point it at a
temporary file, so a smoke run of a benchmark never writes into the repository's).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "FIELDS", "row", "append", "load", "provenance", "add_arguments", "record", "default_path",
           "case_name", "from_records", "METRICS"]

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "results.jsonl"
FIELDS = ("bench", "case", "impl", "precision", "world", "metric", "value", "unit", "device", "commit", "date",
          "torch", "triton", "command")


def default_path() -> Path:
    """Where rows go and come from: ``$DISTWGRAD_RESULTS`` when set, else :data:`RESULTS`."""
    env = os.environ.get("DISTWGRAD_RESULTS")
    return Path(env) if env else RESULTS


@functools.lru_cache(maxsize=1)
def _commit() -> str:
    """``$DISTWGRAD_COMMIT`` when set (a copy of the tree whose ``.git`` is not the source's: a device
    machine's), else ``git rev-parse --short HEAD`` with ``+dirty`` for uncommitted changes."""
    if os.environ.get("DISTWGRAD_COMMIT"):
        return os.environ["DISTWGRAD_COMMIT"]
    root = RESULTS.parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("DISTWGRAD_COMMIT", "unknown")
    return sha + ("+dirty" if dirty else "")


def _device(device: Any) -> str:
    import torch

    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def provenance(device: Any = None, command: str | None = None) -> dict[str, Any]:
    """The fields every row of one run shares."""
    import torch

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": _device(device), "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton_version,
            "command": command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])}


def row(*, bench: str, case: str, impl: str, precision: str, world: int, metric: str, value: float, unit: str,
        device: Any = None, command: str | None = None, **extra: Any) -> dict[str, Any]:
    """One measurement with its provenance; ``extra`` keys are kept after the standard ones."""
    for name, v in (("bench", bench), ("case", case), ("impl", impl), ("precision", precision), ("metric", metric),
                    ("unit", unit)):
        if not isinstance(v, str) or not v:
            raise ValueError(f"results.row: {name} must be a non-empty string, got {v!r}")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"results.row: world must be a positive int, got {world!r}")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"results.row: value must be a number, got {value!r}")
    out = {"bench": bench, "case": case, "impl": impl, "precision": precision, "world": world, "metric": metric,
           "value": float(value), "unit": unit, **provenance(device, command)}
    out.update(extra)
    return out


def append(rows: Iterable[dict[str, Any]], path: str | os.PathLike | None = None) -> int:
    """Appends ``rows`` as JSON lines; returns how many. Only rank 0 of a torchrun job writes."""
    rows = list(rows)
    if os.environ.get("RANK", "0") != "0":
        return 0
    for r in rows:
        missing = [f for f in FIELDS if f not in r]
        if missing:
            raise ValueError(f"results.append: row {r!r} lacks {missing}")
    target = Path(path) if path is not None else default_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=False) + "\n")
    return len(rows)


def load(path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Every row of the results file, in file order."""
    target = Path(path) if path is not None else default_path()
    if not target.exists():
        return []
    with open(target) as f:
        return [json.loads(line) for line in f if line.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--no-record`` and ``--results``: the options every benchmark script takes."""
    parser.add_argument("--no-record", action="store_true", help="do not append the rows to the results file")
    parser.add_argument("--results", default=None,
                        help="append here (default: $DISTWGRAD_RESULTS, else docs/benchmarks/results.jsonl)")


def record(rows: Iterable[dict[str, Any]], args: argparse.Namespace) -> int:
    """Appends ``rows`` unless ``args.no_record``; says where on stdout; returns how many."""
    rows = list(rows)
    if getattr(args, "no_record", False) or not rows:
        return 0
    target = Path(args.results) if getattr(args, "results", None) else default_path()
    n = append(rows, target)
    if n:
        print(f"results: {n} rows appended to {target}", flush=True)
    return n


# A benchmark's own record keys that are measurements, and their units.
METRICS = {"tflops": "TFLOP/s", "gbps": "GB/s", "ms": "ms", "us": "us", "wall_ms": "ms"}


def case_name(op: str, shape: Any, *more: Any) -> str:
    """``"fprop E=8 T=32768 K=4096 N=14336"`` for a grouped GEMM's ``[E, T, K, N]``; other shapes as given."""
    if isinstance(shape, str) and "," in shape:
        shape = [int(v) for v in shape.split(",")]
    if isinstance(shape, (list, tuple)) and len(shape) == 4:
        shape = " ".join(f"{n}={v}" for n, v in zip("ETKN", shape, strict=True))
    elif isinstance(shape, (list, tuple)):
        shape = "x".join(map(str, shape))
    return " ".join(str(p) for p in (op, shape, *more) if p not in (None, ""))


def from_records(records: Iterable[dict[str, Any]], *, bench: str, precision: str = "bf16", impl: str = "distwgrad",
                 world: int = 1, device: Any = None, case_keys: tuple[str, ...] = (),
                 metrics: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows from a benchmark's own records (``{"op", "shape", "impl", <metric>: value, ...}``): one row per
    metric present; a record's ``precision`` or ``recipe`` (``fp8_<recipe>``) overrides ``precision``;
    ``case_keys`` join the case; every other key is kept as an extra field."""
    metrics = METRICS if metrics is None else metrics
    prov = provenance(device)
    out = []
    for rec in records:
        base = {"bench": bench, "case": case_name(rec.get("op", bench), rec.get("shape"),
                                                  *(f"{k}={rec[k]}" for k in case_keys if k in rec)),
                "impl": str(rec.get("impl", impl)),
                "precision": rec.get("precision") or (f"fp8_{rec['recipe']}" if rec.get("recipe") else precision),
                "world": world}
        extra = {k: v for k, v in rec.items()
                 if k not in metrics and k not in ("op", "shape", "impl", "recipe", "precision", "device", *case_keys)}
        for key, unit in metrics.items():
            v = rec.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append({**base, "metric": key, "value": float(v), "unit": unit, **prov, **extra})
    return out
