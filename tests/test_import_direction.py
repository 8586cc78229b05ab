"""Production never imports ``distwgrad.testing`` (STYLE rule 22): the oracle re-exports production's
references (``distwgrad.ops.reference``), never the other way round.

Walks every module of ``distwgrad/`` (but ``distwgrad/testing/``) and ``kernels/`` with ``ast`` and
fails on any import of ``distwgrad.testing``, at module level or inside a function, absolute or relative.
And the job starts without DCP: importing it pulls in neither ``torch.distributed.checkpoint`` nor
DTensor ([Note: DCP imported on use] in ``distwgrad/checkpoint.py``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it is installed as (pyproject's package-dir).
_PACKAGES = {"distwgrad": "distwgrad", "kernels": "distwgrad.kernels", "launch": "distwgrad.launch"}
_FORBIDDEN = "distwgrad.testing"


def _module_name(path: Path) -> tuple[str, bool]:
    """The dotted name a file is imported as, and whether it is a package's ``__init__``."""
    rel = path.relative_to(_ROOT)
    parts = [_PACKAGES[rel.parts[0]], *rel.parts[1:-1]]
    is_init = rel.name == "__init__.py"
    if not is_init:
        parts.append(rel.stem)
    return ".".join(parts), is_init


def _imported(tree: ast.AST, module: str, is_init: bool) -> list[tuple[int, str]]:
    """Every module name an import statement in ``tree`` names, relative imports resolved."""
    package = module if is_init else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return names


def _violations(folders=("distwgrad", "kernels")) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((_ROOT / folder).rglob("*.py")):
            module, is_init = _module_name(path)
            if module == _FORBIDDEN or module.startswith(_FORBIDDEN + "."):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for lineno, name in _imported(tree, module, is_init):
                if name == _FORBIDDEN or name.startswith(_FORBIDDEN + "."):
                    found.append(f"{path.relative_to(_ROOT)}:{lineno} imports {name}")
    return found


def test_production_never_imports_testing():
    assert _violations() == [], "production modules import distwgrad.testing:\n" + "\n".join(_violations())


def test_the_walk_sees_every_form_of_import(tmp_path):
    """The checker itself: absolute, from-import, relative and function-local imports are all caught."""
    sources = {
        "import distwgrad.testing.reference": True,
        "from distwgrad.testing import reference": True,
        "from distwgrad import testing": True,
        "from ..testing import reference": True,
        "def f():\n    from distwgrad.testing.multiprocess import run_distributed": True,
        "from distwgrad.ops import reference": False,
        "from . import reference": False,
    }
    for src, bad in sources.items():
        names = _imported(ast.parse(src), "distwgrad.ops.grouped_gemm", False)
        hit = any(n == _FORBIDDEN or n.startswith(_FORBIDDEN + ".") for _, n in names)
        assert hit == bad, src


def test_the_job_starts_without_dcp():
    """A fresh interpreter imports the job and the checkpoint module; DCP and DTensor stay unloaded."""
    probe = ("import sys, distwgrad.launch.train, distwgrad.checkpoint\n"
             "print([m for m in sys.modules if m.startswith(('torch.distributed.checkpoint', "
             "'torch.distributed.tensor'))])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
