"""The house's countable promises (docs/architecture.md, "The house's rules"): the benchmark scripts users
and CI run, production file sizes, the share of docstrings, and each ``[Note: ...]`` defined once and every
reference to one resolving.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = [p for d in ("distwgrad", "kernels", "launch") for p in sorted((ROOT / d).rglob("*.py"))]
MAX_BENCH_SCRIPTS = 6
MAX_LINES = 600
# Docstrings' share of production lines: at most 15% (torchtitan 12%, TransformerEngine 10%).
MAX_DOCSTRING_SHARE = 0.15
NOTE_DEFINITION = re.compile(r"\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*")  # a line of its own
NOTE_REFERENCE = re.compile(r"\[Note: ([^\]]+)\]")


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_qa_bench_holds_at_most_six_scripts():
    """What users and CI run: the whole step, the layer step, the kernels, the parallelism benchmarks, the
    loss curves and the report; everything else there is a module they import (``_name.py``, ``results.py``)."""
    scripts = sorted(p.name for p in (ROOT / "qa" / "bench").glob("*.py") if "__main__" in p.read_text())
    assert len(scripts) <= MAX_BENCH_SCRIPTS, scripts


def test_no_production_file_over_600_lines():
    long = {_rel(p): n for p in PRODUCTION if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def _docstring_lines(source: str) -> int:
    lines = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines += (first.end_lineno or first.lineno) - first.lineno + 1
    return lines


def test_docstring_share_does_not_grow():
    total = doc = 0
    for p in PRODUCTION:
        source = p.read_text()
        total += len(source.splitlines())
        doc += _docstring_lines(source)
    assert doc / total <= MAX_DOCSTRING_SHARE, f"docstrings are {doc / total:.3f} of {total} production lines"


def test_each_note_is_defined_once_and_every_reference_resolves():
    defined: dict[str, list[str]] = defaultdict(list)
    for p in PRODUCTION + sorted((ROOT / "qa").rglob("*.py")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if m := NOTE_DEFINITION.fullmatch(line):
                defined[m.group(1)].append(f"{_rel(p)}:{i}")
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice, twice
    tests = [p for p in sorted((ROOT / "tests").glob("*.py")) if p.name != Path(__file__).name]  # its regexes
    texts = PRODUCTION + sorted((ROOT / "qa").rglob("*.py")) + tests + sorted((ROOT / "docs").glob("*.md")) \
        + [ROOT / "README.md"]
    dangling = set()
    for p in texts:
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", p.read_text())  # a reference may wrap across comment lines
        dangling |= {(m.group(1), _rel(p)) for m in NOTE_REFERENCE.finditer(flat)
                     if m.group(1) not in defined and m.group(1) != "..."}
    assert not dangling, sorted(dangling)


def test_the_gpu_runner_names_every_step_and_its_scripts_exist():
    """``qa/L2_gpu/run.sh`` is the one GPU runner; a dry run prints each step's commands (nothing runs)."""
    import os
    import subprocess

    runner = ROOT / "qa" / "L2_gpu" / "run.sh"
    assert sorted(p.name for p in runner.parent.glob("*.sh")) == ["run.sh"]
    env = {**os.environ, "DRY_RUN": "1", "STEPS": "all", "OUT_DIR": "/nonexistent/out"}
    proc = subprocess.run(["bash", str(runner)], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) >= 30, lines
    scripts = {w for line in lines for w in line.split() if w.startswith("qa/") and w.endswith(".py")}
    assert scripts and all((ROOT / s).is_file() for s in scripts), sorted(scripts)
    bad = subprocess.run(["bash", str(runner)], env={**env, "STEPS": "nope"}, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert "unknown step nope" in bad.stderr


def test_the_gpu_runner_shards_the_gpu_test_files():
    """``TEST_SHARD=i/n`` splits the files with GPU tests into n disjoint parts that cover them all (a suite
    longer than one device call runs in several); a shard outside ``0 <= i < n`` exits 2, naming it."""
    import os
    import subprocess

    runner = ROOT / "qa" / "L2_gpu" / "run.sh"
    gpu_files = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text()}
    env = {**os.environ, "DRY_RUN": "1", "STEPS": "tests", "OUT_DIR": "/nonexistent/out"}
    parts = []
    for i in range(3):
        out = subprocess.run(["bash", str(runner)], env={**env, "TEST_SHARD": f"{i}/3"}, capture_output=True,
                             text=True, timeout=60, cwd=ROOT).stdout
        parts.append({w for w in out.split() if w.startswith("tests/")})
    assert all(parts) and not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2]), parts
    assert set().union(*parts) == gpu_files
    for shard in ("3/3", "1/0", "x"):
        bad = subprocess.run(["bash", str(runner)], env={**env, "TEST_SHARD": shard}, capture_output=True, text=True,
                             timeout=60, cwd=ROOT)
        assert bad.returncode == 2 and f"got {shard}" in bad.stderr, (shard, bad.stderr)
