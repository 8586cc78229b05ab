"""Test-wide options and fixtures.

``--full`` runs the whole of every sampled sweep (``distwgrad.testing.sweep``: the cases a sweep leaves
out of its fixed-seed sample, and tests marked ``full``, are skipped without it). CI runs the sample;
``qa/L2_gpu/run.sh`` runs ``--full``.

Every test (and every subprocess it starts) writes benchmark rows to a temporary results file
(``DISTWGRAD_RESULTS``), never to ``docs/benchmarks/results.jsonl``.

Quiet exit: once a Gluon kernel has been compiled in a process (the sm_90a build tests, on a cold Triton
cache), Triton 3.9's bindings report ``nanobind: leaked 4 instances!`` and a list of types and functions
at interpreter exit: a reference leak in Triton's Gluon bindings, nothing a user can act on (Triton
drops the same report in its own compile workers by pointing stderr at /dev/null at exit). Here stderr
goes through a filter at exit that drops exactly that report's lines and passes everything else.

``kernel_tuning``: a test's kernel tuning overrides, through ``distwgrad.kernels.tuning`` (the one way to
override it; [Note: kernel tuning] in kernels/_tuning.py), open until the test ends.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
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
    atexit.register(_filter_nanobind_leak_report)  # runs before the bindings' own exit check


def pytest_collection_modifyitems(config, items):
    # Longest first: the multi-rank and interpreter tests take 5-70 s each on two cores, nearly all
    # others under a second, so with xdist's work stealing (qa/test.sh) no worker is left with a minute-long
    # test at the end while the other idles. Whole modules move, in their order, so that a module fixture
    # (the training job's shared run, say) is still set up once; the sort is stable, the same on every worker.
    # The job's modules (test_train_*: torchrun jobs, up to a minute a test) go before the other multi-rank
    # ones: one of them last in a worker's queue left that worker alone for its whole run at the end. Among
    # them, the modules of fewer tests go first: xdist hands the head of the list to one worker, which runs it
    # in order while the others steal from its end, so the job modules run one after another there. A module
    # of a few tests is mostly one long test (the parallelism and documented-command tests, one to two minutes
    # each), which no steal can split, and taken late it ran alone at the end of the run; a module of many
    # tests splits between workers.
    rank, size = {}, {}
    for item in items:
        r = 0 if "distributed" in item.keywords else 1 if "interpret" in item.keywords else 2
        if r == 0 and item.module.__name__.rpartition(".")[2].startswith("test_train_"):
            r = -1
        rank[item.module] = min(rank.get(item.module, 2), r)
        size[item.module] = size.get(item.module, 0) + 1
    items.sort(key=lambda item: (rank[item.module], size[item.module] if rank[item.module] < 0 else 0))
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="outside the sweep's sample: run with --full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


# Copies stdin to stderr except nanobind's leak report: the lines from "nanobind: leaked ..." to its
# "See https://nanobind..." line, none other.
_LEAK_FILTER = r"""
import sys
REPORT = (b"nanobind: leaked ", b" - leaked ", b" - ... skipped remainder", b"nanobind: this is likely caused by",
          b"See https://nanobind.readthedocs.io/")
out, in_report = sys.stderr.buffer, False
for line in sys.stdin.buffer:
    in_report = in_report or line.startswith(REPORT[0])
    if in_report and line.startswith(REPORT):
        in_report = not line.startswith(REPORT[-1])
        continue
    in_report = False
    out.write(line)
    out.flush()
"""
_leak_filter: list[subprocess.Popen] = []  # kept referenced: it outlives every object of this process


def _filter_nanobind_leak_report() -> None:
    """Points this process's stderr (fd 2) at the filter above for what the interpreter prints as it
    exits; only where Triton (whose bindings report the leak) was imported."""
    if "triton" not in sys.modules:
        return
    sys.stderr.flush()
    read, write = os.pipe()
    _leak_filter.append(subprocess.Popen([sys.executable, "-I", "-S", "-c", _LEAK_FILTER], stdin=read,
                                         stderr=2, start_new_session=True))  # ends at EOF: when we have exited
    os.close(read)
    os.dup2(write, 2)
    os.close(write)


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
