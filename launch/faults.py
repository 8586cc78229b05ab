"""The training job when a rank dies or hangs: every rank stops within a bound, one survivor names the
lost rank and the last complete checkpoint, and ``report.json`` records the interruption.

[Note: lost rank]
No watchdog of our own: every collective waits at most ``--timeout``. A dead rank's sockets close, so the
others' next collective fails at once and torchrun SIGTERMs them; a hung rank makes it time out. Each
survivor then calls :func:`lost_ranks`: it checks in on the job's store (torchrun's agent hosts it, so it
outlives any rank) and meets the others at a gloo ``monitored_barrier``, which names the ranks that did not
arrive; a dead rank breaks the barrier without a name, and its missing check-in names it. torchrun SIGKILLs a
hung rank only 30 s after SIGTERM, so survivors kill lost siblings themselves. docs/training.md, Faults.
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
           "publish_pid", "is_comm_failure", "monitor_groups", "lost_ranks", "end_siblings", "last_checkpoint",
           "reason", "wait_for_rank0"]

INTERRUPTED_EXIT = 3  # a rank was lost or a collective timed out (docs/training.md, exit codes)
_PROBE_MAX_S = 5.0  # survivors reach the probe within one collective of each other (docs/training.md, Faults)
_KEY = "distwgrad.train/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun restarts: fresh keys


class Terminated(Exception):
    """SIGTERM: torchrun tearing the job down after a rank ended, or a scheduler stopping it."""


def catch_sigterm() -> None:
    """The first SIGTERM raises :class:`Terminated`, unless a failed collective is being handled (it would
    replace that failure mid-``except``); later ones are ignored, so the report gets written."""
    def handler(signum: int, frame: Any) -> None:
        ignore_sigterm()
        if not _handling_comm_failure():
            raise Terminated(f"received {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


def _handling_comm_failure() -> bool:
    """Whether this thread is handling a failed collective, or an exception raised while handling one."""
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
    """Unless the environment chose: NCCL's watchdog tears a rank down on a failed or timed-out collective,
    and its heartbeat kills a rank whose watchdog is stuck past ``timeout + 60`` s."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(math.ceil(timeout) + 60))


def probe_seconds(timeout: float) -> float:
    """How long survivors wait for each other at the probe."""
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
    """A failed or timed-out collective, or SIGTERM: another rank's trouble, not a bug of this rank's own."""
    if isinstance(exc, (Terminated, dist.DistError)):
        return True
    wrapped = type(exc).__name__ == "CheckpointException"  # DCP's wrapper, its text every rank's failure
    return (wrapped or isinstance(exc, RuntimeError)) and bool(_COMM_TEXT.search(str(exc)))


# [Note: monitored barrier timeouts]
# gloo's ``monitored_barrier`` holds rank 0 to its ``timeout`` argument, but the other ranks to the group's
# own timeout, set when the group was made (torch 2.13: with a group of 2 s and an argument of 6 s, rank 1
# gave up on a late rank 0 after 2.01 s; with a group of 8 s it waited the 3 s). So each kind of wait has a
# gloo group whose timeout is that wait's: the probe's ``probe_seconds(timeout)``, and ``2 * timeout`` for
# the others while rank 0 works alone.

def monitor_groups(timeout: float, rank0_works: bool) -> tuple[Any, Any]:
    """The job's gloo groups for monitored barriers, each made with its wait's timeout ([Note: monitored
    barrier timeouts]): the probe's (:func:`probe_seconds`), and with ``rank0_works`` (``--check-parity``) the
    one where the others wait ``2 * timeout`` for rank 0's solo work, else None. Every rank makes them."""
    def group(seconds: float) -> Any:
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    return group(probe_seconds(timeout)), group(2 * timeout) if rank0_works else None


def lost_ranks(monitor: Any, seconds: float) -> list[int]:
    """The ranks that did not reach this probe within ``seconds`` ([Note: lost rank]); every survivor calls it.
    ``monitor``: the probe's group of :func:`monitor_groups`, which no failed collective has used."""
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
    """``rank``'s pid if it runs under this rank's torchrun agent, "gone" if it ended, else "other"."""
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
    """The checkpoint ``--resume`` would pick: this run's latest complete one, else the one it resumed from."""
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


def wait_for_rank0(group: Any, timeout: float) -> None:
    """After rank 0's solo work (``--check-parity``'s reference step) the others wait ``2 * timeout`` for it:
    its work may take one timeout, the collective another. ``group``: :func:`monitor_groups`' second."""
    if dist.get_world_size() > 1:
        seconds = timeout if dist.get_rank() == 0 else 2 * timeout
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=seconds))
