"""A job's ranks as torchrun would start them, forked from the CPU ranks' fork server
([Note: forked job ranks]): :func:`run_job`."""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time

from distwgrad.testing.multiprocess import forkserver_serves

__all__ = ["run_job"]

# [Note: forked job ranks]
# Each rank torchrun starts is a fresh interpreter that imports torch, ``torch._dynamo`` (the optimizers'
# ``step`` imports it) and matplotlib (the report's plot) before it trains, and torchrun's agent imports torch
# too. For a small job on CPU that start-up is most of the run: a 6-step 2-rank job took 10.5-12.2 s under
# torchrun and 3.3 s forked, to the same losses, on the 2-core CI machine. ``run_job`` runs ``python -m MODULE
# ARGS`` (or a script) on each rank as a fork of the server ``run_distributed`` uses, which has imported those
# modules once, and returns what ``subprocess.run`` would.
#
# The job sees what it sees under torchrun: a process per rank, the caller's environment and directory,
# RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (rank 0 hosts the store), and
# ``sys.argv`` as ``-m`` sets it. It does not exercise torchrun's agent: its exit code when a rank fails (1;
# here the first failed rank's own), its teardown of the others (here they get ``_GRACE_S`` to finish, then
# SIGKILL) and its signal handling. The tests of those launch torchrun (``test_train_faults.py``, the
# documented commands, a bad argument under torchrun), and so does the shared run of ``test_train_job_runs.py``,
# so both paths stay covered. Where the server cannot serve (no ``os.fork``, or a rank environment that
# differs from the one it started with beyond what a rank sets up itself: ``multiprocess.forkserver_serves``),
# each rank is a fresh interpreter, as under torchrun: slower, the same result.

_GRACE_S = 10.0  # after a rank fails, how long the others get to exit on their own before SIGKILL
_POLL_S = 0.05
# What a forked rank sets up itself (``_rank_main``), so these may differ from the fork server's environment.
_APPLIED = ("PYTHONPATH", "OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_job(target: str, args: list[str], nproc: int | None = 2, env: dict[str, str] | None = None,
            cwd: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC -m TARGET ARGS`` (``nproc=None``: ``python -m TARGET ARGS``;
    a ``target`` ending in ``.py`` is a script). Returns the ranks' stdout and stderr, each in rank order, and
    0 when every rank exited 0, else the exit code of the first rank to fail (128 + N for signal N).

    Raises:
        subprocess.TimeoutExpired: the ranks had not all exited after ``timeout`` seconds (they are killed).
        ValueError: ``nproc`` is not None or a positive int, or ``timeout`` is not positive.
    """
    # ``env`` is added to this process's environment for the ranks; ``cwd`` (default: this process's) is their
    # directory. A variable in ``env`` beyond ``_APPLIED`` that the fork server's environment lacks or holds
    # otherwise may be read at start (glibc's MALLOC_*, TRITON_INTERPRET), so such ranks are fresh interpreters.
    if nproc is not None and (not isinstance(nproc, int) or nproc < 1):
        raise ValueError(f"nproc must be None or a positive int, got {nproc!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    entry = [target] if target.endswith(".py") else ["-m", target]
    cmd = [sys.executable, *entry, *args]
    if nproc is not None:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    environ = dict(os.environ, **(env or {}))
    cwd = cwd or os.getcwd()
    forked = forkserver_serves(environ, _APPLIED)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="distwgrad-job-") as tmp:
        ranks: list = []
        try:
            for rank in range(nproc or 1):
                rank_env = dict(environ)
                if nproc is not None:
                    rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                    LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                                    ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                out, err = (os.path.join(tmp, f"{rank}.{ext}") for ext in ("out", "err"))
                if forked:
                    # Not daemonic, so a rank may start processes of its own; the finally below kills every rank.
                    proc = mp.get_context("forkserver").Process(target=_rank_main,
                                                                args=(target, list(args), rank_env, cwd, out, err))
                    proc.start()
                    ranks.append(_Forked(proc))
                else:
                    with open(out, "w") as o, open(err, "w") as e:
                        ranks.append(subprocess.Popen([sys.executable, *entry, *args], env=rank_env, cwd=cwd,
                                                      stdout=o, stderr=e))
            finished, code = _wait(ranks, time.monotonic() + timeout)
        finally:
            for r in ranks:
                if r.poll() is None:
                    r.kill()
                r.wait()
        stdout, stderr = ("".join(_read(os.path.join(tmp, f"{r}.{ext}")) for r in range(len(ranks)))
                          for ext in ("out", "err"))
    if not finished:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


class _Forked:  # a forked rank, with subprocess.Popen's poll, kill and wait

    def __init__(self, proc) -> None:
        self.proc = proc

    def poll(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def wait(self) -> None:
        self.proc.join()


def _wait(ranks, deadline: float) -> tuple[bool, int]:
    # Waits for every rank; after the first failure the rest get ``_GRACE_S``, then SIGKILL. Returns whether all
    # exited by the deadline, and the exit code of the first rank seen to fail (0: none failed).
    while time.monotonic() < deadline:
        codes = [r.poll() for r in ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            end = min(deadline, time.monotonic() + _GRACE_S)
            while any(r.poll() is None for r in ranks) and time.monotonic() < end:
                time.sleep(_POLL_S)
            for r in ranks:
                if r.poll() is None:
                    r.kill()
            return True, _shell_code(failed[0])
        if None not in codes:
            return True, 0
        time.sleep(_POLL_S)
    return all(r.poll() is not None for r in ranks), 0


def _shell_code(exitcode: int) -> int:
    return exitcode if exitcode > 0 else 128 - exitcode  # killed by signal N: 128 + N, as a shell reports it


def _rank_main(target: str, args: list[str], environ: dict[str, str], cwd: str, out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):  # the rank's own stdout and stderr, C-level writes included
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # A forked rank inherits the fork server's environment, directory and import path: take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:0] = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if "OMP_NUM_THREADS" in environ:  # read when a fresh interpreter loads torch; the server loaded it already
        import torch
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    sys.argv = [target, *args]
    # SystemExit (the job's exit code) and exceptions (printed, exit 1) end the process as multiprocessing's
    # bootstrap handles them, after it flushes stdout and stderr.
    if target.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as ``python TARGET`` puts it first
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:  # a rank killed before it opened its file
        return ""
