"""One harness for multi-rank tests: spawned gloo ranks, a per-call timeout, rank failures in the parent.

A raising rank leaves its peers blocked in a collective, a hung one blocks CI, one dying in C code reports
nothing. So the parent polls every rank's pipe and sentinel; at the first failure or the timeout it kills the
rest and raises :class:`DistributedTestError` with each traceback and the unfinished ranks' Python stacks.
Each call rendezvouses in its own temporary directory (parallel calls never collide); ranks seed nothing.
CPU ranks fork from a server that imported torch once, but each imports the test module: sweep a grid of
cases inside one spawn (:func:`for_each_case`). docs/testing.md has the rest.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "for_each_case", "DistributedTestError", "CaseFailure"]

_DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_POLL_S = 0.05  # parent's wait granularity; never blocks longer than this on a pipe
_GRACE_S = 1.0  # after the first failure, how long peers get to report their own errors
_PG_SLACK_S = 30.0  # group timeout = timeout + slack, so the parent's deadline fires first
_STACK_WAIT_S = 1.0  # how long to wait for faulthandler stack dumps before killing
# What the CPU ranks' fork server imports once (the rest of what a test module imports, ranks import
# themselves). Importing does not start threads or touch CUDA, so forking after it is safe.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.functional",
                       "torch.utils.checkpoint", "pytest", "distwgrad", "distwgrad.models", "distwgrad.nn",
                       "distwgrad.fp8", "distwgrad.testing.multiprocess", "distwgrad.testing.sweep",
                       "distwgrad.testing.job_ranks", "matplotlib.pyplot"]  # the job's plot (job_ranks)
# Variables this process sets for itself, which no rank reads at start: pytest's, per test; and inductor's
# cache folder, which importing ``torch._dynamo.aot_compile`` (distwgrad.graphs does) writes to os.environ.
# A rank takes the caller's values of both with the rest of its environment.
_SET_IN_PROCESS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
_forkserver_env: dict[str, str] | None = None  # the environment the fork server started with


class DistributedTestError(RuntimeError):
    """A rank raised, died without reporting, or did not finish within the timeout."""


class CaseFailure(Exception):
    """One case of a :func:`for_each_case` sweep failed; ``case`` holds it, ``__cause__`` the error."""

    def __init__(self, message: str, case: Any = None) -> None:
        super().__init__(message)
        self.case = case


def for_each_case(cases: Iterable[Any], body: Callable[..., Any], *args: Any) -> list[Any]:
    """Runs ``body(case, *args)`` for each case, returning the results in order; a failure raises
    :class:`CaseFailure` (``"case {case!r}: {type}: {message}"``), chained from the original exception."""
    results = []
    for case in cases:
        try:
            results.append(body(case, *args))
        except Exception as exc:
            raise CaseFailure(f"case {case!r}: {type(exc).__name__}: {exc}", case) from exc
    return results


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    backend: str | None = None, device: str = "cpu", **kwargs: Any) -> list[Any]:
    """Runs ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; returns their results in rank order.

    ``fn`` (module-level), its arguments and its result (CPU tensors, plain values) must pickle; ``timeout``
    is seconds until every rank returns. Under torchrun ``fn`` runs in this process on the default group, the
    list holds only this rank's value, and ``timeout`` bounds only collectives.

    Raises:
        DistributedTestError: a rank raised, died without reporting, or had not finished in ``timeout``.
        ValueError / TypeError: bad ``world_size``, ``timeout`` or ``device``; ``fn`` or its arguments do not pickle.
    """
    if world_size < 1 or timeout <= 0 or device not in _DEFAULT_BACKEND:
        raise ValueError(f"need world_size >= 1, timeout > 0, device in {sorted(_DEFAULT_BACKEND)}; "
                         f"got world_size={world_size}, timeout={timeout}, device={device!r}")
    backend = backend or _DEFAULT_BACKEND[device]
    if all(k in os.environ for k in _TORCHRUN_ENV):
        return _run_under_torchrun(fn, world_size, args, kwargs, timeout, backend, device)
    if device == "cuda" and torch.cuda.device_count() < world_size:
        _skip(f"needs {world_size} CUDA devices, found {torch.cuda.device_count()}")
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"fn={fn!r} and its arguments must be picklable (define fn at module "
                        f"level): {exc}") from exc
    ctx = _context(device)
    with tempfile.TemporaryDirectory(prefix="distwgrad-rdzv-") as tmp:
        procs, readers = [], []
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                spec = (rank, world_size, f"file://{tmp}/store", backend, device, timeout,
                        os.path.join(tmp, f"stack-{rank}.txt"), writer, dict(os.environ), os.getcwd(),
                        fn, args, kwargs)
                # Not daemonic, so a rank may start its own workers; the finally below kills every rank.
                procs.append(ctx.Process(target=_child_main, args=spec))
                procs[-1].start()
                writer.close()  # the parent keeps only the read end, so a dead child reads as EOF
                readers.append(reader)
            return _collect(procs, readers, time.monotonic() + timeout, timeout, tmp)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            for r in readers:
                r.close()


def _context(device: str):
    """The fork server for CPU ranks; spawn for CUDA ranks and for a call whose environment differs from the
    server's (a variable read at process start, glibc's ``MALLOC_*`` say, only reaches a fresh interpreter)."""
    if device != "cpu" or not forkserver_serves(os.environ):
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def forkserver_serves(env: Mapping[str, str], applied: Iterable[str] = ()) -> bool:
    """Whether a rank whose environment is ``env`` may fork from the CPU ranks' fork server: it starts with
    this process's environment at the first call and serves the ranks whose environment is the same, but for
    ``applied`` (variables the rank sets up itself after the fork) and those in ``_SET_IN_PROCESS``."""
    global _forkserver_env
    if "forkserver" not in mp.get_all_start_methods():
        return False
    if _forkserver_env is None:
        _forkserver_env = dict(os.environ)  # the server starts with it at this call's first rank
        mp.get_context("forkserver").set_forkserver_preload(_FORKSERVER_PRELOAD)
    skip = {*_SET_IN_PROCESS, *applied}
    return {k: v for k, v in env.items() if k not in skip} == \
        {k: v for k, v in _forkserver_env.items() if k not in skip}


def _skip(reason: str) -> None:
    try:
        import pytest
    except ImportError:
        raise RuntimeError(f"cannot run this distributed test: {reason}") from None
    pytest.skip(reason)


def _run_under_torchrun(fn, world_size, args, kwargs, timeout, backend, device) -> list[Any]:
    env_world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if env_world_size != world_size:
        _skip(f"test needs world_size={world_size}, torchrun launched WORLD_SIZE={env_world_size}")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    results: list[Any] = [None] * world_size
    try:
        results[rank] = fn(rank, world_size, *args, **kwargs)
    except Exception as exc:
        raise DistributedTestError(f"rank {rank} failed:\n{traceback.format_exc()}") from exc
    return results


def _child_main(rank, world_size, init_method, backend, device, timeout, stack_path, writer, environ, cwd,
                fn, args, kwargs) -> None:
    # A forked rank inherits the fork server's environment and directory, not the caller's: take the
    # caller's (a test may have set a variable or changed directory for its ranks).
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ["OMP_NUM_THREADS"] = "1"  # for anything this rank launches
    torch.set_num_threads(1)
    stack_file = open(stack_path, "w")  # stays open: faulthandler writes to its fd on SIGUSR1
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout + _PG_SLACK_S))
        # Every rank finishes connecting before any runs ``fn``: a rank whose ``fn`` returns at once
        # would otherwise tear its connections down while a slower peer's gloo is still building its
        # mesh, and that peer would fail in init ("Connection closed by peer") instead of in ``fn``.
        dist.barrier()
        report = (True, fn(rank, world_size, *args, **kwargs))
    except BaseException:  # report everything, SystemExit and KeyboardInterrupt included
        report = (False, traceback.format_exc())
    try:
        payload = pickle.dumps(report)
    except Exception:
        payload = pickle.dumps((False, f"return value could not be pickled:\n{traceback.format_exc()}"))
    writer.send_bytes(payload)  # report before teardown, so the parent learns of a failure at once
    writer.close()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # best effort: peers may be gone already, and the parent has the report
        pass
    stack_file.close()


def _collect(procs, readers: list[Connection], deadline: float, timeout: float, tmp: str) -> list[Any]:
    results: list[Any] = [None] * len(procs)
    pending, failures = set(range(len(procs))), []
    while pending and time.monotonic() < deadline:
        wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=_POLL_S)
        for rank in sorted(pending):
            report = _try_receive(readers[rank], procs[rank])
            if report is None:
                continue
            pending.discard(rank)
            if report[0]:
                results[rank] = report[1]
            else:
                failures.append((rank, report[1]))
                deadline = min(deadline, time.monotonic() + _GRACE_S)
    if not pending and not failures:
        return results
    stacks = _dump_stacks(procs, sorted(pending), tmp)
    if failures:
        msg = (f"{len(failures)} of {len(procs)} ranks failed (in the order they reported; later "
               f"ones are often peers reacting to the first):\n")
        msg += "".join(f"--- rank {rank} ---\n{text}\n" for rank, text in failures)
        if pending:
            msg += f"ranks {sorted(pending)} had not finished and were killed; their stacks:\n"
    else:
        done = sorted(set(range(len(procs))) - pending)
        msg = (f"timed out after {timeout} s: ranks {sorted(pending)} had not finished (ranks {done} "
               f"returned); their Python stacks at the timeout:\n")
    msg += "".join(f"--- rank {rank} stack ---\n{stacks[rank]}\n" for rank in sorted(pending))
    raise DistributedTestError(msg)


def _try_receive(reader: Connection, proc) -> tuple[bool, Any] | None:
    """The rank's ``(ok, value_or_traceback)``, or ``None`` while it is still running."""
    alive = proc.is_alive()  # checked first: once it is dead, all it ever sent is in the pipe
    if reader.poll():
        try:
            return pickle.loads(reader.recv_bytes())
        except EOFError:
            alive = False
    if alive:
        return None
    proc.join(5.0)
    return False, f"process exited with code {proc.exitcode} without reporting a result\n"


def _dump_stacks(procs, ranks: list[int], tmp: str) -> dict[int, str]:
    """Asks each live rank in ``ranks`` for its Python stacks (faulthandler on SIGUSR1)."""
    paths = {r: os.path.join(tmp, f"stack-{r}.txt") for r in ranks}
    if hasattr(signal, "SIGUSR1"):
        for r in ranks:
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGUSR1)
        until = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < until and not all(_read(p) for p in paths.values()):
            time.sleep(_POLL_S)
    return {r: _read(p) or "(no stack: the rank was not running Python code yet)" for r, p in paths.items()}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
