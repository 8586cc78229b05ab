"""The training job when a rank dies or hangs: every rank stops within a bound, one survivor names the
lost rank and the last complete checkpoint, and ``report.json`` records the interruption.

[Note: lost rank]
Nothing here watches the job; torch's own limits end it. Every collective of the job's process group
waits at most ``--timeout`` seconds (``init_process_group(timeout=...)``; on NCCL the watchdog enforces
it, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` defaulted by
:func:`nccl_env`). A rank whose process ends closes its sockets: the others' next gloo collective fails at
once, and torchrun, seeing the process gone, sends the rest SIGTERM (:func:`catch_sigterm` turns it into
:class:`Terminated`). A rank that hangs (SIGSTOP, a deadlock) makes the others' collective time out after
``--timeout``. Either way each survivor calls :func:`lost_ranks`: it checks in on the job's store
(torchrun's agent hosts it, so it outlives any rank) and meets the others at ``dist.monitored_barrier`` on
a gloo side group, which names the ranks that did not arrive within :func:`probe_seconds`; a dead rank
breaks that barrier at once without a name, and the missing check-ins name it. The lowest surviving rank
prints one line and writes ``report.json``; every survivor exits with :data:`INTERRUPTED_EXIT`.

A hung process cannot end itself, and torchrun SIGKILLs it only 30 s after SIGTERM (the grace its
``_stop_workers`` gives, whatever ``--shutdown-timeout`` says). So a survivor SIGKILLs a lost rank that is
its sibling under the same torchrun agent (the pid each rank publishes in the store at start), as
torchrun would, and the job ends within the bound documented in docs/training.md (Faults).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import signal
import sys
import time
from typing import Any

import torch.distributed as dist

from distwgrad.checkpoint import CheckpointError, resolve_checkpoint

__all__ = ["INTERRUPTED_EXIT", "Terminated", "catch_sigterm", "ignore_sigterm", "nccl_env", "probe_seconds",
           "publish_pid", "is_comm_failure", "lost_ranks", "end_siblings", "last_checkpoint", "reason",
           "wait_for_rank0"]

INTERRUPTED_EXIT = 3  # a rank was lost or a collective timed out (docs/training.md, exit codes)
_PROBE_MAX_S = 5.0  # survivors reach the probe within one collective of each other (docs/training.md, Faults)
_KEY = "distwgrad.train/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun restarts: fresh keys


class Terminated(Exception):
    """SIGTERM: torchrun tearing the job down after a rank ended, or a scheduler stopping it."""


def catch_sigterm() -> None:
    """The first SIGTERM raises :class:`Terminated` in the main thread; later ones are ignored, so the
    report gets written (torchrun SIGKILLs after its grace anyway).

    A SIGTERM that lands while the main thread already handles a failed collective (torchrun's teardown
    after the failure that collective saw: the survivor is on its way to the report) raises nothing: raised
    there, it would replace the failure inside its own ``except`` clause, before the report's path ignores
    SIGTERM, and the rank would end with a traceback instead of the one line."""
    def handler(signum: int, frame: Any) -> None:
        ignore_sigterm()
        if not _handling_comm_failure():
            raise Terminated(f"received {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


def _handling_comm_failure() -> bool:
    """Whether this thread is handling (in an ``except`` or ``finally`` block, or one nested in it) an
    exception that is, or was raised while handling, a failed collective (:func:`is_comm_failure`)."""
    exc, seen = sys.exc_info()[1], set()
    while exc is not None and id(exc) not in seen:
        if is_comm_failure(exc):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False


def ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def nccl_env(timeout: float) -> None:
    """NCCL's own enforcement of the timeout, unless the environment already chose: the watchdog tears a
    rank down when a collective times out or fails (3, torch's default, set so it is never off), and its
    heartbeat monitor kills a rank whose watchdog is itself stuck for longer than the timeout plus 60 s."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(math.ceil(timeout) + 60))


def probe_seconds(timeout: float) -> float:
    """How long survivors wait for each other at the probe: ``min(--timeout, 5 s)``."""
    return min(timeout, _PROBE_MAX_S)


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def publish_pid() -> None:
    """Records ``<agent pid> <pid>`` of this rank, for :func:`end_siblings`."""
    store = _store()
    if store is not None:
        store.set(f"{_KEY}/pid/{dist.get_rank()}", f"{os.getppid()} {os.getpid()}")


# gloo's and NCCL's words for a failed or timed-out transfer ("Timed out waiting 10000ms for recv",
# "Application timeout caused pair closure", "Connection closed by peer", ...)
_COMM_TEXT = re.compile(r"gloo|nccl|timed out|timeout|connection (closed|reset)|broken pipe|pair closure", re.I)


def is_comm_failure(exc: BaseException) -> bool:
    """A collective that failed or timed out, or SIGTERM: another rank's trouble, not a bug of this one
    (that one raises as it is, so its traceback shows and torchrun names it)."""
    if isinstance(exc, (Terminated, dist.DistError)):
        return True
    wrapped = type(exc).__name__ == "CheckpointException"  # DCP's wrapper, its text every rank's failure
    return (wrapped or isinstance(exc, RuntimeError)) and bool(_COMM_TEXT.search(str(exc)))


def lost_ranks(monitor: Any, seconds: float) -> list[int]:
    """The ranks that did not reach this probe within ``seconds`` ([Note: lost rank]); every survivor
    calls it. ``monitor``: a gloo group of all ranks that no failed collective has used."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return []
    store, deadline = _store(), time.monotonic() + seconds
    alive = [f"{_KEY}/alive/{r}" for r in range(world)]
    if store is not None:
        store.set(alive[rank], "1")
    named: set[int] = set()
    try:
        dist.monitored_barrier(monitor, timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
        return []
    except RuntimeError as exc:  # rank 0 hears of every rank, the others of rank 0 only
        text = str(exc)
        if m := re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text):
            named = {int(r) for r in m.group(1).split(",")}
        elif rank != 0 and "from rank 0" in text:
            named = {0}
    if store is not None:  # a sibling whose process is gone will not check in: no need to wait for it
        missing = [r for r in range(world) if not store.check([alive[r]])]
        while time.monotonic() < deadline and any(_sibling(store, r) != "gone" for r in missing):
            time.sleep(0.05)
            missing = [r for r in missing if not store.check([alive[r]])]
        named |= set(missing)
    return sorted(named - {rank})


def _sibling(store: Any, rank: int) -> str | int:
    """``rank``'s pid if it runs under this rank's torchrun agent, "gone" if it did and has ended, else
    "other" (another host or agent, or unknown)."""
    try:
        agent, pid = map(int, store.get(f"{_KEY}/pid/{rank}").decode().split())
    except (RuntimeError, ValueError):
        return "other"
    if agent != os.getppid():
        return "other"
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    return "gone" if fields[0] in "ZX" or int(fields[1]) != agent else pid


def end_siblings(ranks: list[int]) -> None:
    """SIGKILLs each of ``ranks`` that runs under this rank's torchrun agent ([Note: lost rank])."""
    store = _store()
    for r in ranks if store is not None else []:
        pid = _sibling(store, r)
        if isinstance(pid, int):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def last_checkpoint(out: str, resume: str | None) -> str | None:
    """The checkpoint ``--resume`` would pick: the latest complete one of this run, else the one it
    resumed from; None if there is none."""
    for root in (os.path.join(out, "checkpoints"), resume):
        if root:
            try:
                return resolve_checkpoint(root)
            except CheckpointError:
                continue
    return None


def reason(exc: BaseException) -> str:
    """The first sentence of an error, without gloo's ``[file:line]`` prefix."""
    text = re.sub(r"^\[[^\]]*\]:?\s*", "", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    text = text.split(". ")[0]
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def wait_for_rank0(monitor: Any, timeout: float) -> None:
    """After work rank 0 does alone (the ``--check-parity`` reference step): the other ranks wait for it at
    a monitored barrier for twice ``timeout`` (its work may take one timeout, the collective another);
    rank 0 arrives last and waits ``timeout`` for them."""
    if dist.get_world_size() > 1:
        seconds = timeout if dist.get_rank() == 0 else 2 * timeout
        dist.monitored_barrier(monitor, timeout=datetime.timedelta(seconds=seconds))
