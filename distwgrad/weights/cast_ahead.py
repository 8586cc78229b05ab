"""The cast of a group of one, one weight ahead on a side stream.

[Note: a cast one weight ahead]
With one data-parallel rank ([Note: a group of one] in ``weights/base.py``) a weight with a ``param_dtype``
materializes by casting its fp32 master ([Note: mixed precision]), once for forward and again for backward
(the protocol keeps no copy). Each cast is a pass over memory (6 bytes a parameter for bf16) that the
GEMM after it waits for, while the GEMMs and attention kernels between two casts are bound by the tensor
cores: a cast on a second stream runs beside them.

So the weights learn the order in which they materialize. A *pass* is the run of materializations between
two changes of direction (forward, backward); each weight keeps, for each direction and each of its uses
in a pass (a tied weight materializes twice in a forward), the weight that followed that use the last
time (``_cast_next``: weak references, so a model's order dies with it and two models stepped in turn keep
theirs). When a weight materializes, the weight that followed it is cast on a side stream of its device,
into a buffer allocated on the compute stream once the side stream has waited for the compute stream's
queued work (so the buffer's memory and the master's values are those the inline cast would see). When
that weight asks next, the compute stream waits for the cast's event and takes the copy; the copy is then
the caller's, as an inline cast's would be.

* The same values as the inline cast: the same conversion (``copy_`` into a ``param_dtype`` tensor is
  ``to``'s kernel), the same strides. The master's ``_version`` and data pointer are recorded at the launch
  and compared at the take: a master changed in between (an optimizer step, an assignment to ``.data``)
  drops the copy, and the weight casts inline.
* One copy ahead at most: the extra memory is one weight's ``param_dtype`` copy. A weight that asks out of
  order (another path through the model, a recomputation) drops the copy ahead and casts inline; the
  weight before it learns the new successor.
* A dropped copy is freed only after its cast: the compute stream waits for its event first (the
  caching allocator may hand the memory to the compute stream at once). Under a CUDA graph's capture that
  wait cannot be recorded, so such a copy is kept until the first call outside a capture, which waits for
  it with the host.
* Inline, as before, on a CPU (nothing runs beside the compute), while a CUDA graph captures (a stream
  forked inside a captured callable must join before its capture ends, and the next weight may belong to
  the next callable), under dynamo's tracing, and with ``enabled(False)``.

Measured on an H200: docs/benchmarks/LOG.md.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["applies", "enabled", "is_enabled", "materialize", "reset"]


class _Ahead:
    """A cast in flight or done on the side stream: whose, for which direction, of which master state."""

    __slots__ = ("weight", "backward", "version", "ptr", "copy", "event")

    def __init__(self, weight: torch.Tensor, backward: bool, copy: torch.Tensor, event: Any) -> None:
        self.weight = weakref.ref(weight)
        self.backward = backward
        self.version = weight._version
        self.ptr = weight.data_ptr()
        self.copy = copy
        self.event = event

    def matches(self, weight: torch.Tensor, backward: bool) -> bool:
        return (self.weight() is weight and self.backward == backward and self.version == weight._version
                and self.ptr == weight.data_ptr())


class _Casts:
    """The process's learned orders, its one copy ahead, the side streams (one per device)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enabled = True
        self.direction: bool | None = None  # the current pass's (backward?)
        self.prev: tuple[weakref.ref, tuple[bool, int]] | None = None  # the pass's last weight, and its use
        self.uses: dict[int, int] = {}  # id(weight) -> its materializations in the pass
        self.ahead: _Ahead | None = None
        self.kept: list[_Ahead] = []  # dropped under a capture, freed after their casts
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.launched = 0  # casts launched ahead, and taken: what the tests read
        self.taken = 0
        self.on_cpu = False  # the tests' mode: CPU weights too, each cast ahead done at once

    def _next(self, weight: torch.Tensor, backward: bool) -> torch.Tensor | None:
        """Records ``weight`` as the successor of the pass's previous use; the weight that followed this use of
        ``weight`` the last time, if any ([Note: a cast one weight ahead])."""
        if backward != self.direction:
            self.direction, self.prev, self.uses = backward, None, {}
        use = (backward, self.uses.get(id(weight), 0))
        self.uses[id(weight)] = use[1] + 1
        if self.prev is not None:
            before = self.prev[0]()
            if before is not None:
                nexts = before.__dict__.setdefault("_cast_next", {})
                known = nexts.get(self.prev[1])
                if known is None or known() is not weight:
                    nexts[self.prev[1]] = weakref.ref(weight)
        self.prev = (weakref.ref(weight), use)
        known = weight.__dict__.get("_cast_next", {}).get(use)
        return None if known is None else known()

    def _drop(self, ahead: _Ahead, capturing: bool) -> None:
        if ahead.event is None:  # cast already (the CPU's test mode)
            return
        if capturing:
            self.kept.append(ahead)
        else:
            torch.cuda.current_stream(ahead.copy.device).wait_event(ahead.event)

    def _release_kept(self) -> None:
        for ahead in self.kept:
            ahead.event.synchronize()
        self.kept.clear()

    def _launch(self, weight: torch.Tensor, backward: bool) -> None:
        device = weight.device
        if not weight.is_cuda:  # the CPU's test mode: the same bookkeeping, the cast at once
            self.ahead = _Ahead(weight, backward, weight.detach().to(weight.param_dtype), None)
            self.launched += 1
            return
        side = self.streams.get(device)
        if side is None:
            side = self.streams[device] = torch.cuda.Stream(device)
        master = weight.detach()
        copy = torch.empty_like(master, dtype=weight.param_dtype)  # on the compute stream
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            copy.copy_(master)
            event = torch.cuda.Event()
            event.record(side)
        self.ahead = _Ahead(weight, backward, copy, event)
        self.launched += 1

    def materialize(self, weight: torch.Tensor, backward: bool) -> torch.Tensor:
        capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
        with self.lock:
            if not capturing and self.kept:
                self._release_kept()
            nxt = self._next(weight, backward)
            ahead, self.ahead = self.ahead, None
            copy = None
            if ahead is not None:
                if ahead.matches(weight, backward) and not capturing:
                    if ahead.event is not None:
                        torch.cuda.current_stream(weight.device).wait_event(ahead.event)
                    copy = ahead.copy
                    self.taken += 1
                else:
                    self._drop(ahead, capturing)
            if copy is None:
                copy = weight._local_for_gather()
            if nxt is not None and self.enabled and not capturing and applies(nxt) and nxt.device == weight.device:
                self._launch(nxt, backward)
            return copy


def applies(weight: torch.Tensor) -> bool:
    """Whether ``weight`` materializes through here: a CUDA group of one, not coalesced, that casts to a
    narrower ``param_dtype`` (on a CPU only in the tests' mode, ``_CASTS.on_cpu``), outside dynamo's tracing
    (a traced call is the inline cast, as before)."""
    return ((weight.is_cuda or _CASTS.on_cpu) and getattr(weight, "_solo", False)
            and getattr(weight, "param_dtype", None) not in (None, weight.dtype)
            and getattr(weight, "_bucket", None) is None and not torch.compiler.is_compiling())


_CASTS = _Casts()


def materialize(weight: torch.Tensor, backward: bool) -> torch.Tensor:
    """The ``param_dtype`` copy of ``weight`` (a CUDA group of one that casts): the one cast ahead for it, else
    a cast now; casts the weight expected next on the side stream ([Note: a cast one weight ahead])."""
    return _CASTS.materialize(weight, backward)


def enabled(flag: bool) -> None:
    """Turns the casts ahead on (the default) or off; off, every weight casts when it materializes."""
    if not isinstance(flag, bool):
        raise TypeError(f"cast_ahead.enabled takes a bool, got {flag!r}")
    with _CASTS.lock:
        _CASTS.enabled = flag


def is_enabled() -> bool:
    return _CASTS.enabled


def reset() -> None:
    """Drops the copy ahead (waiting for its cast) and ends the pass; the weights keep their successors."""
    with _CASTS.lock:
        if _CASTS.ahead is not None and _CASTS.ahead.event is not None:
            _CASTS.ahead.event.synchronize()
        _CASTS.ahead = None
        _CASTS._release_kept()
        _CASTS.direction, _CASTS.prev, _CASTS.uses = None, None, {}
