"""``kernels/`` is a leaf the runtime calls: its modules import nothing of ``distwgrad`` but
``distwgrad.kernels`` itself (no recipes, no ``Quantized``, no ``ops``). The kernels take tensors, dtypes
and numbers and return tensors; ``distwgrad.ops`` and ``distwgrad.fp8`` wrap those in the runtime's types.

Walks every module of ``kernels/`` with ``ast`` (module level and inside functions, absolute and relative
imports, relative ones resolved against ``distwgrad.kernels``) and fails naming file:line; then imports
every kernel module in a fresh interpreter and checks that no runtime package was loaded on the way.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_direction import _imported, _module_name

_ROOT = Path(__file__).resolve().parents[1]
_SELF = "distwgrad.kernels"


def _runtime(name: str) -> bool:
    """Whether an imported module name is part of the runtime (``distwgrad`` outside ``distwgrad.kernels``)."""
    inside = lambda pkg: name == pkg or name.startswith(pkg + ".")  # noqa: E731
    return inside("distwgrad") and not inside(_SELF)


def _violations(source: str, module: str, is_init: bool) -> list[tuple[int, str]]:
    """(line, module) of each import statement that names a runtime module (the first name it imports)."""
    found: dict[int, str] = {}
    for lineno, name in _imported(ast.parse(source), module, is_init):
        if _runtime(name):
            found.setdefault(lineno, name)
    return sorted(found.items())


def _kernel_modules() -> list[tuple[Path, str, bool]]:
    return [(path, *_module_name(path)) for path in sorted((_ROOT / "kernels").rglob("*.py"))]


def test_kernels_import_nothing_of_the_runtime():
    found = [f"{path.relative_to(_ROOT)}:{lineno} imports {name}"
             for path, module, is_init in _kernel_modules()
             for lineno, name in _violations(path.read_text(), module, is_init)]
    assert found == [], "kernel modules import the runtime:\n" + "\n".join(found)


_TOP, _DEEP = "distwgrad.kernels.quantize", "distwgrad.kernels.gluon.tiles"


@pytest.mark.parametrize("src,module,bad", [
    ("import distwgrad.fp8.quantize", _TOP, True),
    ("from distwgrad.fp8.quantize import Quantized", _TOP, True),
    ("from distwgrad import ops", _TOP, True),
    ("import distwgrad", _TOP, True),
    ("from .. import fp8", _TOP, True),                 # distwgrad.kernels.quantize -> distwgrad.fp8
    ("from ..ops.grouped_gemm import to_device", _TOP, True),
    ("from ... import fp8", _DEEP, True),               # two packages up from distwgrad.kernels.gluon
    ("def f():\n    from distwgrad.ops.grouped_gemm import to_device", _TOP, True),
    ("class C:\n    def f(self):\n        import distwgrad.fp8.recipe", _TOP, True),
    ("from distwgrad.kernels import _tuning", _TOP, False),
    ("import distwgrad.kernels.quantize", _TOP, False),
    ("from . import _tuning", _TOP, False),
    ("from .quantize import _absmax", _TOP, False),
    ("from .. import quantize", _DEEP, False),          # distwgrad.kernels.gluon.tiles -> distwgrad.kernels
    ("import torch\nimport triton.language as tl", _TOP, False),
])
def test_the_walk_sees_every_form_of_import(src, module, bad):
    """The checker itself: absolute, from-import, relative past the package and function-local imports."""
    assert bool(_violations(src, module, False)) == bad


# The parent package's ``__init__`` imports the runtime (users' top-level names), and every import of
# ``distwgrad.kernels`` passes through it; the probe therefore registers ``distwgrad`` as a bare package
# (its real search path, its ``__init__`` not run), so that only the kernels' own imports load anything.
_PROBE = """
import importlib, importlib.util, json, sys, types
spec = importlib.util.find_spec("distwgrad")
parent = types.ModuleType("distwgrad")
parent.__path__, parent.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["distwgrad"] = parent
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("distwgrad."))))
"""


def test_importing_the_kernels_loads_no_runtime_module():
    """In a fresh interpreter every kernel module imports without ``distwgrad.fp8``, ``distwgrad.ops`` or
    any other runtime module entering ``sys.modules``."""
    pytest.importorskip("triton")
    names = [module for _, module, _ in _kernel_modules()]
    res = subprocess.run([sys.executable, "-c", _PROBE, *names], cwd=_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if _runtime(m)] == [], f"importing the kernel modules loaded runtime modules: {loaded}"
    assert "distwgrad.kernels.quantize" in loaded, loaded  # the probe did import the kernels
