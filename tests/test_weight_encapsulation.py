"""No module outside ``distwgrad/weights/`` reads or writes a weight's private state ([Note: weight lifecycle]).

A weight's step lives in its lifecycle (``w._life``) and the few private members of its classes; everything
else (graphs, fp8, checkpoints, the integrations, the job, the benchmarks) goes through public methods.
The private names are read off the classes and off built weights, so a new private field is covered the day
it appears; the walk flags an attribute access ``x._name`` on anything but ``self``/``cls`` and the name as a
string (``getattr(w, "_life")``, ``w.__dict__["_bucket"]``), in every production and qa module outside
``distwgrad/weights/`` (and the test oracle, ``distwgrad/testing/``, which may look inside).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from distwgrad.weights import DistributedParameter, ReplicatedWeight, ShardedWeight

_ROOT = Path(__file__).resolve().parents[1]
_FOLDERS = ("distwgrad", "kernels", "launch", "qa")
_INSIDE = (("distwgrad", "weights"), ("distwgrad", "testing"))


def _private_names() -> set[str]:
    names: set[str] = set()
    for cls in (DistributedParameter, ShardedWeight, ReplicatedWeight):
        names |= set(vars(cls))
    for w in (ShardedWeight.from_full(torch.zeros(2, 2)), ReplicatedWeight.from_full(torch.zeros(2))):
        names |= set(vars(w))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _violations(tree: ast.AST, private: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            found.append((node.lineno, repr(node.value)))
    return found


def test_private_names_cover_the_lifecycle():
    private = _private_names()
    assert {"_life", "_bucket", "_unit", "_gather", "_reduce"} <= private, sorted(private)


def test_no_module_outside_weights_touches_private_weight_state():
    private = _private_names()
    found = []
    for folder in _FOLDERS:
        for path in sorted((_ROOT / folder).rglob("*.py")):
            rel = path.relative_to(_ROOT)
            if rel.parts[:2] in _INSIDE:
                continue
            found += [f"{rel}:{line} {what}" for line, what in _violations(ast.parse(path.read_text()), private)]
    assert not found, "private weight state used outside distwgrad/weights/:\n" + "\n".join(found)


def test_the_walk_sees_every_form_of_access():
    """The checker itself: attribute reads and writes, getattr/setattr strings and ``__dict__`` keys are caught;
    ``self._life`` inside a class and public names are not."""
    private = _private_names()
    sources = {
        "w._life.buffer = None": True,
        "n = p._life.expected": True,
        "getattr(w, '_bucket', None)": True,
        "w.__dict__['_unit']": True,
        "x = w._gather()": True,
        "self._life = 1": False,
        "w.state, w.pending_contributions, w.label": False,
        "w.finish_step()": False,
    }
    for src, bad in sources.items():
        assert bool(_violations(ast.parse(src), private)) == bad, src
