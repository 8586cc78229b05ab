"""Capture in a pipeline schedule's order: TransformerEngine's ``_order`` and ``_num_layers_per_chunk``.

[Note: capture in schedule order]
``_order`` (Megatron-core's) lists chunk ids from 1: +c a forward of chunk c's next microbatch, -c its backward.
Each (chunk, microbatch, layer) is a forward pass with its own graphs and buffers; ``sample_args`` and the
returned functions are chunk-major, then microbatch, then layer (:meth:`OrderPlan.index`). Captures follow
``_order`` in one pool, so its memory is handed out as the schedule uses it; deferred wgrads are captured in
backward order, the order ``backward_dw()`` pops them. A forward replay refuses only while its own wgrad waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["OrderPlan", "plan_order"]


@dataclass(frozen=True)
class OrderPlan:
    """What ``plan_order`` derived: the chunks' layer counts and the captures in order."""

    microbatches: int
    layers: tuple[int, ...]  # per chunk
    captures: tuple[tuple[str, int], ...]  # ("fwd" | "bwd", forward-pass index), in capture order

    @property
    def prefix(self) -> tuple[int, ...]:
        out = [0]
        for n in self.layers:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def forward_passes(self) -> int:
        return sum(self.layers) * self.microbatches

    def index(self, chunk: int, microbatch: int, layer: int) -> int:
        """The forward pass of ``layer`` of ``chunk`` (from 0) for ``microbatch``: its sample and output slot."""
        return self.prefix[chunk] * self.microbatches + microbatch * self.layers[chunk] + layer

    def module_of(self, index: int) -> int:
        """Which of the modules forward pass ``index`` runs."""
        return [self.prefix[chunk] + layer for chunk, n in enumerate(self.layers)
                for _ in range(self.microbatches) for layer in range(n)][index]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def plan_order(order: Sequence[int], num_layers_per_chunk: int | Sequence[int] | None, modules: int,
               samples: int) -> OrderPlan:
    """Checks ``_order`` against the modules and samples and plans the captures; each error names the value."""
    if not isinstance(order, Sequence) or isinstance(order, str) or not order \
            or not all(_int(c) and c != 0 for c in order):
        raise ValueError(f"make_graphed_callables: _order must be a non-empty list of nonzero ints (chunk ids from "
                         f"1, negative for a backward), got {order!r}")
    chunks = max(abs(c) for c in order)
    if len(order) % (2 * chunks):
        raise ValueError(f"make_graphed_callables: _order has {len(order)} entries, not a multiple of 2 x {chunks} "
                         f"chunks (a forward and a backward of each chunk per microbatch)")
    microbatches = len(order) // (2 * chunks)
    for c in range(1, chunks + 1):
        seen = (order.count(c), order.count(-c))
        if seen != (microbatches, microbatches):
            raise ValueError(f"make_graphed_callables: _order has chunk {c} {seen[0]} times forward and {seen[1]} "
                             f"times backward; each chunk runs {microbatches} of each")
    if num_layers_per_chunk is None:
        if samples % (chunks * microbatches):
            raise ValueError(f"make_graphed_callables: {samples} sample_args for {chunks} chunks x {microbatches} "
                             f"microbatches; pass _num_layers_per_chunk")
        layers = (samples // (chunks * microbatches),) * chunks
    elif _int(num_layers_per_chunk):
        layers = (num_layers_per_chunk,) * chunks  # type: ignore[assignment]
    else:
        layers = tuple(num_layers_per_chunk)  # type: ignore[arg-type]
    if len(layers) != chunks or not all(_int(n) and n > 0 for n in layers):
        raise ValueError(f"make_graphed_callables: _num_layers_per_chunk must be an int > 0 or {chunks} of them "
                         f"(one per chunk), got {num_layers_per_chunk!r}")
    if modules != sum(layers):
        raise ValueError(f"make_graphed_callables: {modules} modules for chunks of {list(layers)} layers; pass "
                         f"{sum(layers)}, each chunk's layers in order")
    if samples != sum(layers) * microbatches:
        raise ValueError(f"make_graphed_callables: {samples} sample_args; _order needs one per forward pass, "
                         f"{sum(layers)} layers x {microbatches} microbatches = {sum(layers) * microbatches}")
    plan = OrderPlan(microbatches, layers, ())
    fwd, bwd, captures = [0] * chunks, [0] * chunks, []
    for c in order:
        chunk = abs(c) - 1
        if c > 0:
            captures += [("fwd", plan.index(chunk, fwd[chunk], layer)) for layer in range(layers[chunk])]
            fwd[chunk] += 1
        else:
            if bwd[chunk] >= fwd[chunk]:
                raise ValueError(f"make_graphed_callables: _order runs the backward of chunk {-c}'s microbatch "
                                 f"{bwd[chunk]} before its forward")
            captures += [("bwd", plan.index(chunk, bwd[chunk], layer)) for layer in reversed(range(layers[chunk]))]
            bwd[chunk] += 1
    return OrderPlan(microbatches, layers, tuple(captures))
