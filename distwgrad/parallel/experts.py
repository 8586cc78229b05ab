"""Expert parallelism: each rank of an ``ep`` group owns ``E / ep`` experts; tokens travel to their expert's
rank and back by all-to-all, and expert weights never leave their ranks (docs/experts.md).

[Note: expert-parallel dispatch]
Rows come sorted by expert, so each ep rank's rows are one contiguous run. ``dispatch`` exchanges the counts
on the device, reads the split sizes on the host (the layer's one sync: the all-to-all takes lists), sends
the runs, and gathers what arrives (source-major) expert-major for ``GroupedLinear``; ``combine`` undoes both.
Dropless: every row is sent. Rows arrive in source-rank order, the single-process model's order of addition.
An expert's wgrad sums ``ep`` ranks' contributions, so ``spread_over_experts`` divides by ``ep`` too.

[Note: the dispatch's backward hides behind the experts' wgrads]
In backward the model waits only for the dispatch's gradient, which the experts' deferred wgrads do not
need. So it issues its all-to-all asynchronously, runs ``overlap`` (the MoE layer's drain of those wgrads,
in ``drain_deferred_wgrads``'s order: the same bits), then waits; ``exposed_s`` is the wait left over.
"""

from __future__ import annotations

import collections
import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ExpertParallel", "Route"]


@dataclass(frozen=True)
class Route:
    """What ``combine`` needs of one ``dispatch``: the split sizes each way and the expert-major order."""

    sent: list[int]  # rows this rank sent to each ep rank
    received: list[int]  # rows this rank received from each ep rank
    order: torch.Tensor  # expert-major row i is received row order[i]


class ExpertParallel:
    """``n_experts`` experts partitioned over ``group`` (e.g. ``mesh.get_group("ep")``): rank ``r`` owns experts
    ``r * L .. (r + 1) * L - 1``, ``L = n_experts / ep``."""

    def __init__(self, n_experts: int, group: Any, *, overlap_wgrads: bool = True) -> None:
        """``overlap_wgrads=False`` waits for the dispatch's gradient before the experts' wgrads run
        ([Note: the dispatch's backward hides behind the experts' wgrads])."""
        if not isinstance(n_experts, int) or isinstance(n_experts, bool) or n_experts < 1:
            raise ValueError(f"ExpertParallel: n_experts must be a positive int, got {n_experts!r}")
        if group is None:
            raise ValueError("ExpertParallel: group is None; pass the ep group (mesh.get_group('ep'))")
        self._group_ref = weakref.ref(group)  # held weakly, as a weight's ([Note: groups held weakly])
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % self.size:
            raise ValueError(f"ExpertParallel: n_experts={n_experts} does not divide over ep={self.size} ranks")
        self.n_experts, self.local = n_experts, n_experts // self.size
        self.overlap_wgrads = overlap_wgrads
        self.bytes_sent = 0  # this rank's all-to-all payload and counts, forward and backward, since creation
        self._timer = _Timer()

    @property
    def exposed_s(self) -> float:
        """Seconds this rank waited on its exchanges, after overlapped work (on CUDA, reading it synchronizes)."""
        return self._timer.total()

    @property
    def group(self) -> Any:
        group = self._group_ref()
        if group is None:
            raise RuntimeError("ExpertParallel: its ep group was destroyed (destroy_process_group()); the layer "
                               "cannot exchange tokens any more")
        return group

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.local

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a packed ``[E, ...]`` tensor (a view)."""
        if full.shape[0] != self.n_experts:
            raise ValueError(f"ExpertParallel.local_slice: a packed expert tensor has {self.n_experts} rows, got "
                             f"shape {tuple(full.shape)}")
        return full[self.first_expert:self.first_expert + self.local]

    def dispatch(self, x_AD: torch.Tensor, m_splits_E: torch.Tensor,
                 overlap: Callable[[], Any] | None = None) -> tuple[torch.Tensor, torch.Tensor, Route]:
        """Sends each row of ``x_AD`` (sorted by expert, ``m_splits_E`` rows each) to its expert's rank; returns
        this rank's rows expert-major, its experts' row counts ``[L]`` and the route back. ``overlap()`` runs in
        backward while the gradient travels (when ``overlap_wgrads``)."""
        if m_splits_E.shape != (self.n_experts,):
            raise ValueError(f"ExpertParallel.dispatch: m_splits_E must have shape ({self.n_experts},), got "
                             f"{tuple(m_splits_E.shape)}")
        if overlap is not None and not callable(overlap):
            raise TypeError(f"ExpertParallel.dispatch: overlap must be callable or None, got {overlap!r}")
        P, L = self.size, self.local
        counts_PL = m_splits_E.to(torch.int64).reshape(P, L).contiguous()
        got_PL = torch.empty_like(counts_PL)
        with self._timer.on(got_PL.device):
            dist.all_to_all_single(got_PL, counts_PL, group=self.group)  # per-expert counts, on the device
            sizes = torch.stack([counts_PL.sum(1), got_PL.sum(1)]).tolist()  # the layer's one host sync
        self.bytes_sent += counts_PL.numel() * counts_PL.element_size()
        sent, received = sizes[0], sizes[1]
        if sum(sent) != x_AD.shape[0]:
            raise ValueError(f"ExpertParallel.dispatch: m_splits_E sums to {sum(sent)} but x has "
                             f"{x_AD.shape[0]} rows")
        x_recv = _Exchange.apply(x_AD, self, received, sent, overlap if self.overlap_wgrads else None)
        order = _expert_major(got_PL, sum(received))
        return x_recv[order], got_PL.sum(0), Route(sent, received, order)

    def combine(self, y_local: torch.Tensor, route: Route) -> torch.Tensor:
        """``dispatch`` reversed: expert-major ``y_local`` back to the senders, in the order the rows were sent."""
        y_recv = torch.empty_like(y_local).index_copy(0, route.order, y_local)
        return _Exchange.apply(y_recv, self, route.sent, route.received, None)

    def _exchange(self, x: torch.Tensor, out_rows: list[int], in_rows: list[int],
                  overlap: Callable[[], Any] | None) -> torch.Tensor:
        """Sends ``in_rows[p]`` rows of ``x`` to rank ``p``, gets ``out_rows[p]``; ``overlap()`` runs as they travel."""
        x = x.contiguous()
        out = x.new_empty((sum(out_rows), *x.shape[1:]))
        self.bytes_sent += x.numel() * x.element_size()
        if overlap is None:
            with self._timer.on(x.device):
                dist.all_to_all_single(out, x, out_rows, in_rows, group=self.group)
            return out
        work = dist.all_to_all_single(out, x, out_rows, in_rows, group=self.group, async_op=True)
        overlap()
        with self._timer.on(x.device):
            work.wait()
        return out


def _expert_major(got_PL: torch.Tensor, total: int) -> torch.Tensor:
    """The gather that turns rows grouped (source rank, local expert) into (local expert, source rank)."""
    starts_PL = (got_PL.flatten().cumsum(0) - got_PL.flatten()).reshape(got_PL.shape)
    lengths = got_PL.t().flatten()  # blocks in expert-major order
    begin = starts_PL.t().flatten()
    dest = lengths.cumsum(0) - lengths  # where each block starts in the expert-major layout
    return torch.repeat_interleave(begin - dest, lengths, output_size=total) + torch.arange(
        total, device=got_PL.device)


class _Exchange(torch.autograd.Function):
    """The differentiable all-to-all: backward sends the gradients the other way, running ``overlap`` meanwhile."""

    @staticmethod
    def forward(ctx, x, ep: ExpertParallel, out_rows: list[int], in_rows: list[int],
                overlap: Callable[[], Any] | None):
        ctx.ep, ctx.out_rows, ctx.in_rows, ctx.overlap = ep, out_rows, in_rows, overlap
        return ep._exchange(x, out_rows, in_rows, None)

    @staticmethod
    def backward(ctx, grad):
        return ctx.ep._exchange(grad, ctx.in_rows, ctx.out_rows, ctx.overlap), None, None, None, None


class _Timer:
    """Sums the time inside ``with timer.on(device):`` blocks; on CUDA by event pairs, resolved when ``total()``
    reads them (a sync) and, once over ``_PENDING``, as they complete, so a long run holds a bounded number."""

    _PENDING = 256

    def __init__(self) -> None:
        self.seconds = 0.0
        self._events: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event]] = collections.deque()

    @contextlib.contextmanager
    def on(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
            while len(self._events) > self._PENDING and self._events[0][1].query():
                a, b = self._events.popleft()
                self.seconds += a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0

    def total(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self.seconds
