"""What ``parallelism.py`` and ``kernels.py`` share: ``SCRIPT KIND [options]`` runs the module of KIND."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script: str, kinds: Mapping[str, str], argv: list[str] | None = None):
    """Runs ``main(options)`` of the module ``kinds[KIND]`` for ``argv = [KIND, *options]``, its ``--help`` and
    errors naming ``SCRIPT KIND``; returns what it returns."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in kinds:
        got = f"got {argv[0]!r}" if argv else "got nothing"
        print(f"usage: {script} {{{','.join(kinds)}}} [options]  ({got}; '{script} KIND --help' lists a kind's "
              f"options)", file=sys.stderr)
        sys.exit(2)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    module = importlib.import_module(kinds[argv[0]])
    sys.argv[0] = f"{script} {argv[0]}"  # argparse's prog
    return module.main(argv[1:])
