"""Test-wide options and fixtures.

``--full`` runs the whole of every sampled sweep (``distwgrad.testing.sweep``: the cases a sweep leaves
out of its fixed-seed sample, and tests marked ``full``, are skipped without it). CI runs the sample;
``qa/L2_gpu/session.sh`` runs ``--full``.

Every test (and every subprocess it starts) writes benchmark rows to a temporary results file
(``DISTWGRAD_RESULTS``), never to ``docs/benchmarks/results.jsonl``.

``kernel_tuning``: a test's kernel tuning overrides, through ``distwgrad.kernels.tuning`` (the one way to
override it; [Note: kernel tuning] in kernels/_tuning.py), open until the test ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from distwgrad.testing import sweep

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # ``qa.bench`` (the benchmark tools' tests import it)
    sys.path.insert(0, str(_ROOT))


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run every case of the sampled sweeps (tests marked `full`)")


def pytest_configure(config):
    if config.getoption("--full"):  # the interpreter cases' child processes read it too
        os.environ[sweep.FULL_ENV] = "1"


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="outside the sweep's sample: run with --full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _results_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("results") / "results.jsonl"
    old = os.environ.get("DISTWGRAD_RESULTS")
    os.environ["DISTWGRAD_RESULTS"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DISTWGRAD_RESULTS", None)
    else:
        os.environ["DISTWGRAD_RESULTS"] = old


@pytest.fixture
def kernel_tuning():
    """``kernel_tuning(*families, **overrides)`` enters ``distwgrad.kernels.tuning(*families, **overrides)``
    until the test ends; later calls nest inside earlier ones, and all are left at teardown, innermost
    first. Returns the ``KernelTuning`` in force."""
    from distwgrad.kernels import tuning
    with contextlib.ExitStack() as stack:
        yield lambda *families, **overrides: stack.enter_context(tuning(*families, **overrides))
