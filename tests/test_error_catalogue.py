"""Every user-facing raise site of distwgrad, its kernels and its job is catalogued in docs/errors.md.

What counts as a raise site: every ``raise X(...)`` (and ``raise X``) in ``distwgrad/``, ``kernels/`` and
``launch/`` whose ``X`` names an exception class: the built-in ``ValueError``, ``TypeError``,
``RuntimeError``, ``NotImplementedError``, ``FloatingPointError``, ``AttributeError`` ... and the package's
own (``CheckpointError``, ``DataError``, ``DeferredWgradError``, ``MissingContributionError``,
``UnfinalizedStepError``). Not raise
sites: ``assert`` (internal invariants), a bare ``raise`` and ``raise exc`` (re-raising a caught or saved
exception: its origin is catalogued), and ``AssertionError``.

How a site finds its row: a row of docs/errors.md names the file and the function (``path::Class.method``),
the exception's class name and the message pattern: the message's literal text with ``{}`` for each
interpolated value, whitespace collapsed; a trailing ``…`` matches any longer message. A site matches a row
when file, function and class agree and the site's message starts with the pattern. Line numbers play no
part, so code may move; a new raise, a renamed function or a reworded message fails here with the row to add.

Sites that are deliberately not user-facing are in ``ALLOWLIST`` below, each with its reason.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "docs" / "errors.md"
SCANNED = ("distwgrad", "kernels", "launch")

# (path prefix, function or "*", reason): raise sites that are not user-facing.
ALLOWLIST = [
    ("distwgrad/testing/", "*", "the test harness and the oracle: raised to test authors, not to the runtime's users"),
    ("distwgrad/integrations/__init__.py", "__getattr__", "the module __getattr__ protocol (lazy imports)"),
    ("distwgrad/parallel/__init__.py", "__getattr__", "the module __getattr__ protocol (lazy imports)"),
    ("distwgrad/weights/base.py", "DistributedParameter._gather", "abstract method: a subclass's contract"),
    ("distwgrad/weights/base.py", "DistributedParameter._reduce", "abstract method: a subclass's contract"),
    ("launch/faults.py", "catch_sigterm.handler", "SIGTERM unwinding the job: train.py catches it (exit code 3)"),
]

# Where a new site's row goes: (path prefix, ID prefix, section heading of docs/errors.md); first match wins.
AREAS = [
    ("distwgrad/weights/", "WGT", "Weights and accounting"),
    ("distwgrad/wgrad/accumulate.py", "WGT", "Weights and accounting"),
    ("distwgrad/wgrad/finalize.py", "WGT", "Weights and accounting"),
    ("distwgrad/wgrad/plain.py", "WGT", "Weights and accounting"),
    ("distwgrad/nn/", "MOD", "Modules"),
    ("distwgrad/wgrad/", "MOD", "Modules"),
    ("distwgrad/ops/grouped_gemm.py", "MOD", "Modules"),
    ("distwgrad/protocol.py", "PRO", "Protocol"),
    ("distwgrad/distributed_weight.py", "PRO", "Protocol"),
    ("distwgrad/integrations/", "INT", "Megatron integration"),
    ("distwgrad/fp8/", "FP8", "FP8"),
    ("distwgrad/ops/", "FP8", "FP8"),
    ("kernels/", "KRN", "Kernels' input checks"),
    ("distwgrad/graph", "GRA", "CUDA graphs"),  # graphs.py, graph_options.py, graph_order.py
    ("distwgrad/checkpoint.py", "CKP", "Checkpoints"),
    ("launch/", "JOB", "The training job: options, data, model and exit codes"),
    ("distwgrad/data.py", "JOB", "The training job: options, data, model and exit codes"),
    ("distwgrad/models/", "JOB", "The training job: options, data, model and exit codes"),
    ("distwgrad/parallel/", "PIP", "Pipeline parallelism"),
    ("distwgrad/", "GEN", "Other"),
]
MIN_TESTED = 60  # catalogued errors that name a test triggering them


@dataclass(frozen=True)
class Site:
    file: str
    line: int
    func: str
    exc: str
    message: str


@dataclass(frozen=True)
class Entry:
    id: str
    file: str
    func: str
    exc: str
    pattern: str
    test: str


def _template(node: ast.AST | None) -> str:
    """The message's literal text, ``{}`` for each interpolated value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _template(node.left) + _template(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return _template(node.left)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _template(node.func.value)
    return "{}"


def _squash(text: str) -> str:
    return " ".join(text.split())


class _Visitor(ast.NodeVisitor):
    def __init__(self, file: str):
        self.file, self.scope, self.sites = file, [], []

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Raise(self, node: ast.Raise):
        exc, message = node.exc, ""
        if isinstance(exc, ast.Call):
            name, message = ast.unparse(exc.func), _template(exc.args[0]) if exc.args else ""
        elif exc is not None and ast.unparse(exc).split(".")[-1][:1].isupper():
            name = ast.unparse(exc)  # ``raise NotImplementedError``
        else:
            name = None  # ``raise`` or ``raise exc``: a re-raise
        name = name and name.split(".")[-1]
        if name and name != "AssertionError":
            self.sites.append(Site(self.file, node.lineno, ".".join(self.scope), name, _squash(message)))
        self.generic_visit(node)


def scan(root: Path = ROOT) -> list[Site]:
    """Every raise site of the scanned folders, allowlisted ones included."""
    sites = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            visitor = _Visitor(path.relative_to(root).as_posix())
            visitor.visit(ast.parse(path.read_text(), filename=str(path)))
            sites += visitor.sites
    return sites


def allowed(site: Site) -> bool:
    return any(site.file.startswith(p) and f in ("*", site.func) for p, f, _ in ALLOWLIST)


_ROW = re.compile(r"^\|\s*([A-Z0-9]{3}-\d{3})\s*\|")


def _cells(row: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", row.strip())[1:-1]
    return [c.strip().replace("\\|", "|") for c in cells]


def _code(cell: str) -> str:
    return cell[1:-1] if cell.startswith("`") and cell.endswith("`") else cell


def parse(text: str) -> list[Entry]:
    """The catalogue's rows: | ID | `file::function` | type | `pattern` | cause | fix | test |."""
    entries = []
    for row in text.splitlines():
        if not _ROW.match(row):
            continue
        cells = _cells(row)
        assert len(cells) == 7, f"docs/errors.md: a row needs 7 cells, got {len(cells)}: {row}"
        file, _, func = _code(cells[1]).partition("::")
        entries.append(Entry(cells[0], file, func, _code(cells[2]), _squash(_code(cells[3])).removesuffix("…"),
                             cells[6]))
    return entries


def matches(entry: Entry, site: Site) -> bool:
    return (entry.file, entry.func, entry.exc) == (site.file, site.func, site.exc) and \
        site.message.startswith(entry.pattern.rstrip())


def _area(file: str) -> tuple[str, str]:
    return next((a, s) for p, a, s in AREAS if file.startswith(p))


def _next_id(prefix: str, taken: set[str]) -> str:
    n = 1 + max([int(i[4:]) for i in taken if i.startswith(prefix + "-")], default=0)
    return f"{prefix}-{n:03d}"


def suggest_row(site: Site, taken: set[str]) -> str:
    """The row a developer pastes into docs/errors.md for a new site."""
    prefix, section = _area(site.file)
    new_id = _next_id(prefix, taken)
    taken.add(new_id)
    pattern = site.message.replace("|", "\\|")
    return (f"  {site.file}:{site.line} raises {site.exc} in {site.func or '<module>'}; add to the "
            f"'{section}' table of docs/errors.md (fill in cause, fix and the test that triggers it):\n"
            f"  | {new_id} | `{site.file}::{site.func}` | `{site.exc}` | `{pattern}` | CAUSE | FIX | "
            f"tests/test_errors_<area>.py::test_<name> |")


def missing(sites: list[Site], entries: list[Entry]) -> list[str]:
    taken, out = {e.id for e in entries}, []
    for site in sites:
        if allowed(site) or any(matches(e, site) for e in entries):
            continue
        near = [e.id for e in entries if (e.file, e.func, e.exc) == (site.file, site.func, site.exc)]
        hint = f"  (rows {near} have this file, function and type: if the message was reworded, update " \
               f"that row's pattern)\n" if near else ""
        out.append(hint + suggest_row(site, taken))
    return out


def test_every_raise_site_is_catalogued():
    problems = missing(scan(), parse(CATALOGUE.read_text()))
    assert not problems, (f"{len(problems)} raise site(s) are not in docs/errors.md. Add a row for each (or, "
                          "if it is not user-facing, an ALLOWLIST entry with a reason in "
                          "tests/test_error_catalogue.py):\n" + "\n".join(problems))


def test_every_row_matches_a_raise_site():
    sites = [s for s in scan() if not allowed(s)]
    stale = [f"{e.id} ({e.file}::{e.func}, {e.exc}, {e.pattern!r})" for e in parse(CATALOGUE.read_text())
             if not any(matches(e, s) for s in sites)]
    assert not stale, "docs/errors.md rows that match no raise site (removed, renamed or reworded: update " \
                      "or delete them): " + "; ".join(stale)


def test_ids_are_unique():
    ids = [e.id for e in parse(CATALOGUE.read_text())]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    assert not dupes, f"docs/errors.md: IDs used twice: {dupes}"


_TEST_REF = re.compile(r"(tests/test_\w+\.py)::(\w+)(?:\[([^\]]+)\])?")


def test_every_named_test_exists():
    """A row's test column names tests that exist; a ``[ID]`` case appears in that file's cases."""
    entries, bad, tested = parse(CATALOGUE.read_text()), [], 0
    for e in entries:
        refs = _TEST_REF.findall(e.test)
        tested += bool(refs)
        for path, name, case in refs:
            file = ROOT / path
            src = file.read_text() if file.exists() else ""
            defined = {n.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)} if src else set()
            if name not in defined or (case and f'"{case}"' not in src):
                bad.append(f"{e.id}: {path}::{name}" + (f"[{case}]" if case else ""))
    assert not bad, f"docs/errors.md names tests that do not exist: {bad}"
    assert tested >= MIN_TESTED, f"only {tested} catalogued errors name a test; want >= {MIN_TESTED}"
    said = re.search(r"(\d+) errors, (\d+)\s+of them with a test", CATALOGUE.read_text())
    assert said and (int(said[1]), int(said[2])) == (len(entries), tested), \
        f"docs/errors.md's opening says {said and said.groups()}; the table has {len(entries)} errors, {tested} tested"


def test_a_new_raise_site_fails_with_the_row_to_add(tmp_path):
    """The scan's own negative control: an uncatalogued raise is reported with a row ready to paste."""
    (tmp_path / "distwgrad").mkdir()
    (tmp_path / "distwgrad" / "weights").mkdir()
    (tmp_path / "distwgrad" / "weights" / "new.py").write_text(
        "def f(x):\n    if x < 0:\n        raise ValueError(f'x must be >= 0, got {x}')\n    raise\n")
    sites = scan(tmp_path)
    assert [(s.func, s.exc, s.message) for s in sites] == [("f", "ValueError", "x must be >= 0, got {}")]
    entry = Entry("WGT-001", "distwgrad/weights/new.py", "f", "ValueError", "x must be >= 0", "")
    assert missing(sites, [entry]) == []
    (report,) = missing(sites, [])
    assert "'Weights and accounting' table" in report and "| WGT-001 | `distwgrad/weights/new.py::f` |" in report
    (reworded,) = missing(sites, [Entry("WGT-007", "distwgrad/weights/new.py", "f", "ValueError", "x < 0", "")])
    assert "rows ['WGT-007']" in reworded and "| WGT-008 |" in reworded
