"""Expert parallelism: each rank of an ``ep`` group owns ``E / ep`` experts; tokens travel to their expert's
rank and back by all-to-all, and expert weights never leave their ranks.

[Note: expert-parallel dispatch]
A MoE layer sorts its token-to-expert assignments by expert (``m_splits_E`` rows each, experts in order), so
the rows bound for ep rank ``p`` (experts ``p * L .. (p + 1) * L - 1``, ``L = E / ep``) are one contiguous
run. ``dispatch`` exchanges the per-expert counts (one small all-to-all, on the device), reads the split
sizes on the host (the layer's one synchronization: the all-to-all takes them as lists), and sends each run
to its rank with torch's differentiable all-to-all (``all_to_all_single_autograd``). What arrives is grouped
by source rank, then by local expert; one gather puts it expert-major (each local expert's rows contiguous,
sources in rank order), the layout ``GroupedLinear`` takes. ``combine`` undoes both: the inverse permutation, then the
all-to-all back. Backward runs the same exchanges reversed (torch's autograd of the collective). Dropless:
every row is sent, whatever the counts, and an expert that gets no row has an empty group (a zero wgrad).

The gradient's average. Every rank of the ep group sends tokens to a rank's experts, so the experts' wgrad on
that rank sums contributions from ``ep`` ranks' losses; the weight reduces over its own data-parallel group
(dividing by its ``dp_size``), and ``DistributedParameter.spread_over_experts(mesh)`` divides by ``ep`` as well:
the average over the ``ep * dp`` ranks, as every other weight averages over all of them. (A power-of-two
``ep`` divides exactly; otherwise one more rounding than the oracle's one division.)

Order of additions. An expert's rows arrive from the sources in rank order, so its wgrad sums rank 0's rows,
then rank 1's: the order the single-process model sums them in when its batch is the ranks' batches
concatenated, up to the GEMM's own blocking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

__all__ = ["ExpertParallel", "Route"]


@dataclass(frozen=True)
class Route:
    """What ``combine`` needs of one ``dispatch``: the split sizes each way and the expert-major order."""

    sent: list[int]  # rows this rank sent to each ep rank
    received: list[int]  # rows this rank received from each ep rank
    order: torch.Tensor  # expert-major row i is received row order[i]


class ExpertParallel:
    """``n_experts`` experts partitioned over ``group`` (the ep dimension of a ``DeviceMesh``, or any process
    group): rank ``r`` of the group owns experts ``r * L .. (r + 1) * L - 1``, ``L = n_experts / ep``."""

    def __init__(self, n_experts: int, group: Any) -> None:
        if not isinstance(n_experts, int) or isinstance(n_experts, bool) or n_experts < 1:
            raise ValueError(f"ExpertParallel: n_experts must be a positive int, got {n_experts!r}")
        if group is None:
            raise ValueError("ExpertParallel: group is None; pass the ep group (mesh.get_group('ep'))")
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % self.size:
            raise ValueError(f"ExpertParallel: n_experts={n_experts} does not divide over ep={self.size} ranks")
        self.n_experts, self.local = n_experts, n_experts // self.size

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

    def dispatch(self, x_AD: torch.Tensor, m_splits_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Route]:
        """Sends each row of ``x_AD`` (sorted by expert, ``m_splits_E`` rows each) to its expert's rank.
        Returns this rank's rows expert-major, its local experts' row counts ``[L]``, and the route back."""
        if m_splits_E.shape != (self.n_experts,):
            raise ValueError(f"ExpertParallel.dispatch: m_splits_E must have shape ({self.n_experts},), got "
                             f"{tuple(m_splits_E.shape)}")
        P, L = self.size, self.local
        counts_PL = m_splits_E.to(torch.int64).reshape(P, L).contiguous()
        got_PL = torch.empty_like(counts_PL)
        dist.all_to_all_single(got_PL, counts_PL, group=self.group)  # per-expert counts, on the device
        sizes = torch.stack([counts_PL.sum(1), got_PL.sum(1)]).tolist()  # the layer's one host sync
        sent, received = sizes[0], sizes[1]
        if sum(sent) != x_AD.shape[0]:
            raise ValueError(f"ExpertParallel.dispatch: m_splits_E sums to {sum(sent)} but x has "
                             f"{x_AD.shape[0]} rows")
        x_recv = wait_tensor(all_to_all_single_autograd(x_AD.contiguous(), received, sent, self.group))
        order = _expert_major(got_PL, sum(received))
        return x_recv[order], got_PL.sum(0), Route(sent, received, order)

    def combine(self, y_local: torch.Tensor, route: Route) -> torch.Tensor:
        """``dispatch`` reversed: ``y_local`` (expert-major, as dispatched) back to the sending ranks, in the
        order their rows were sent."""
        y_recv = torch.empty_like(y_local).index_copy(0, route.order, y_local)
        return wait_tensor(all_to_all_single_autograd(y_recv, route.sent, route.received, self.group))


def _expert_major(got_PL: torch.Tensor, total: int) -> torch.Tensor:
    """The gather that turns rows grouped (source rank, local expert) into (local expert, source rank)."""
    starts_PL = (got_PL.flatten().cumsum(0) - got_PL.flatten()).reshape(got_PL.shape)
    lengths = got_PL.t().flatten()  # blocks in expert-major order
    begin = starts_PL.t().flatten()
    dest = lengths.cumsum(0) - lengths  # where each block starts in the expert-major layout
    return torch.repeat_interleave(begin - dest, lengths, output_size=total) + torch.arange(
        total, device=got_PL.device)
