"""FP8 weights: quantize before the gather, re-gather FP8 in backward, one amax all-reduce per step.

[Note: fp8 distributed weights]
* A ``ShardedWeight`` quantizes its own shard; the all-gather moves FP8 bytes (plus block scales). Per-tensor
  scaling uses the MAX of the shards' amaxes, kept for the step ([Note: weight lifecycle]): one all-reduce
  for all weights in :func:`sync_weight_amax`, else one per weight at first use, counted in ``amax_allreduces``.
* Blockwise scaling uses the FULL weight's block grid (one small MAX all-reduce joins blocks that straddle
  ranks), so the gathered FP8 weight is bit-identical to quantizing the full weight, uneven shards included.
  A packed ``[E, N, K]`` weight is sharded by experts: each expert quantizes whole on one rank.
* Backward re-gathers the FP8 weight (or re-quantizes a foreign weight's materialization), never the shard's
  bf16 values. A ``param_dtype`` weight ([Note: mixed precision]) is quantized from its fp32 master, not its cast.

[Note: fp8 weights kept across microbatches]
A call given TransformerEngine's ``is_first_microbatch`` (or, given none, inside ``fp8.microbatch(first=...)``,
read at run time so compiled code traces no flag) keeps the FP8 copies of a weight held whole here (one rank: no
gathered copy is kept) in its step cache ([Note: weight lifecycle]), one per layout (forward's, dgrad's); True
quantizes afresh in forward, backward and False reuse. The copies are the bits they save and die with the step,
so no step reads an earlier one whatever the flags; a byte an element per layout from the first microbatch on. Never
kept: weights sharded over ranks, plain tensors (no step), calls with no gradient (no step open), CUDA graph
capture ([Note: amax under capture]).

[Note: amax under capture]
The step's cached amax (or block grid) is host state a CUDA graph replay never sees: a graph reading it would
quantize every replay with the capture's amax, from a tensor the next refresh frees. So while the weight's
device captures, the amax is computed afresh in the graph (its all-reduce too), and the cache is untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from distwgrad.fp8 import graph_kept
from distwgrad.fp8.quantize import (
    Quantized,
    QuantizedExperts,
    _abs_max,
    _nonfinite_to_inf,
    compute_amax,
    compute_scale,
    quantize_blockwise,
    quantize_per_tensor,
)
from distwgrad.fp8.recipes.base import Recipe
from distwgrad.protocol import is_distributed_weight, materialize_weight_for_backward, materialize_weight_for_forward
from distwgrad.weights.base import DistributedParameter
from distwgrad.weights.lifecycle import write_token
from distwgrad.weights.sharded import ShardedWeight

if TYPE_CHECKING:
    from distwgrad.fp8.recipes.blockwise import BlockwiseScaling
    from distwgrad.fp8.recipes.per_tensor import PerTensorScaling

__all__ = ["quantize_weight", "materialize_quantized", "materialize_quantized_group", "sync_weight_amax",
           "global_amax", "global_block_scales", "gather_fp8"]

_AMAX = "fp8 amax"  # the cache key of a weight's per-tensor amax ([Note: weight lifecycle])
_KEPT = "fp8 weight"  # ... and of its kept FP8 copies ([Note: fp8 weights kept across microbatches])

T = TypeVar("T")


def _quantizers(w: torch.Tensor):
    """``(quantize_per_tensor, quantize_blockwise, contiguous)``: the Triton kernels where they run, else the torch
    reference; the same bits, so the choice moves speed only ([Note: fp8 gemm dispatch])."""
    from distwgrad.ops import grouped_gemm as gg  # late: distwgrad.ops imports this package
    if gg.kernels_available(w):
        from distwgrad.ops import quantize as kq
        return kq.quantize_per_tensor, kq.quantize_blockwise, True
    return quantize_per_tensor, quantize_blockwise, False


def quantize_weight(w: torch.Tensor, recipe: Recipe, *, amax: torch.Tensor | None = None) -> list[Quantized]:
    """A ``[N, K]`` weight (one entry) or packed ``[E, N, K]`` (one per expert), by ``recipe.quantize_weight``
    ([Note: fp8 recipe objects]). ``amax``: the whole weight's, for a recipe that scales by it."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an FP8 Recipe, got {recipe!r}")
    return recipe.quantize_weight(w, amax=amax, quantizers=_quantizers(w))


def _capturing(w: torch.Tensor) -> bool:
    """Whether ``w``'s device is capturing a CUDA graph, or a graph's kept copies are made: host caches are off
    ([Note: amax under capture], [Note: fp8 weights kept in CUDA graphs])."""
    return (w.is_cuda and torch.cuda.is_current_stream_capturing()) or graph_kept.is_fresh()


def global_amax(w: DistributedParameter) -> torch.Tensor:
    """The whole weight's amax (MAX over the shard group), kept for the step ([Note: weight lifecycle]);
    computed in the graph while capturing ([Note: amax under capture])."""
    def make() -> torch.Tensor:
        amax = compute_amax(w.detach()).reshape(1)
        if isinstance(w, ShardedWeight):
            w.all_reduce_max(amax)
        return amax.reshape(())
    made = graph_kept.amaxes()  # a graph's kept copies made together: [Note: fp8 weights kept in CUDA graphs]
    if made is not None:
        if id(w) not in made:
            made[id(w)] = make()
        return made[id(w)]
    return make() if _capturing(w) else w.cached(_AMAX, make)


def _local_amaxes(weights: list[ShardedWeight]) -> torch.Tensor:
    """``compute_amax`` of each weight's shard, stacked (one NaN -> +inf map for all)."""
    return _nonfinite_to_inf(torch.stack([_abs_max(p.detach()) for p in weights]))


def sync_weight_amax(model: nn.Module | Iterable[nn.Module]) -> int:
    """One MAX all-reduce of every sharded weight's local amax (per group); returns weights synced."""
    mods = [model] if isinstance(model, nn.Module) else list(model)
    seen: dict[int, ShardedWeight] = {}
    for m in mods:
        for p in m.parameters():
            if isinstance(p, ShardedWeight):
                seen.setdefault(id(p), p)
    by_group: dict[int, list[ShardedWeight]] = {}
    for p in seen.values():
        by_group.setdefault(id(p.group), []).append(p)  # weights of one group share one all-reduce
    for weights in by_group.values():
        local = _local_amaxes(weights)
        weights[0].all_reduce_max(local, count=False)  # the one explicit sync, not a fallback
        for p, a in zip(weights, local):
            p.pin_cache(_AMAX, a)  # for the step about to open: [Note: weight lifecycle]
    return len(seen)


def gather_fp8(data: torch.Tensor, w: ShardedWeight) -> torch.Tensor:
    return w.gather_rows(data.view(torch.uint8)).view(data.dtype)


def _sharded_experts(w: ShardedWeight, recipe: PerTensorScaling, *, backward: bool,
                     amax: torch.Tensor | None = None) -> QuantizedExperts:
    """A packed sharded weight's experts under per-tensor scaling as one ``QuantizedExperts``, quantized in one launch
    in the GEMM's layout (``backward``: dgrad's), then one FP8 all-gather: the bits of :func:`quantize_weight`."""
    from distwgrad.ops.quantize import quantize_packed_per_tensor  # late: distwgrad.ops imports this package

    local = w.detach()
    E_local, N, K = local.shape
    E = w.full_shape[0]
    amax = global_amax(w).reshape(1) if amax is None else amax[:1]
    size = len(w.shard_rows)
    if E_local:
        q = quantize_packed_per_tensor(local, recipe.fwd_dtype, amax, margin=recipe.margin, transpose=backward)
        if size == 1:
            return q
        stored = q.data.transpose(1, 2) if backward else q.data  # the contiguous storage
    else:
        stored = local.new_empty((0, K, N) if backward else (0, N, K), dtype=recipe.fwd_dtype)
    data = gather_fp8(stored.contiguous(), w)
    scale = compute_scale(amax, recipe.fwd_dtype, recipe.margin)
    scale_inv = (torch.ones_like(scale) / scale).expand(E).contiguous()  # the same fp32 division as the kernels
    return QuantizedExperts(data.transpose(1, 2) if backward else data, scale_inv, w.dtype,
                            amax.expand(E).contiguous())


def global_block_scales(w: ShardedWeight, recipe: BlockwiseScaling) -> torch.Tensor:
    """The full weight's block scale grid from per-rank partial amaxes and one MAX all-reduce; kept for the
    step, fresh under capture ([Note: amax under capture])."""
    def make() -> torch.Tensor:
        (bm, bn), (N, K) = recipe.weight_block, w.full_shape
        gm, gn = -(-N // bm), -(-K // bn)
        local = w.detach().float().abs()
        local = torch.where(torch.isnan(local), math.inf, local)  # NaN poisons its block (compute_amax)
        per_row = F.pad(local, (0, gn * bn - K)).view(local.shape[0], gn, bn).amax(dim=2)
        grid = torch.zeros(gm, gn, dtype=torch.float32, device=local.device)
        block_of_row = (torch.arange(local.shape[0], device=local.device) + w.shard_offset) // bm
        grid.index_reduce_(0, block_of_row, per_row, "amax")
        w.all_reduce_max(grid)
        return compute_scale(grid, recipe.dtype, power_of_two=recipe.power_of_two)
    key = ("fp8 block scales", recipe.weight_block, recipe.dtype, recipe.power_of_two)
    return make() if _capturing(w) else w.cached(key, make)


def _held_whole_param(w: torch.Tensor) -> bool:
    """A distwgrad weight held whole on this rank (no gathered copy is ever kept)."""
    return isinstance(w, DistributedParameter) and not (isinstance(w, ShardedWeight) and len(w.shard_rows) > 1)


def _whole_here(w: torch.Tensor) -> bool:
    """A distwgrad weight held whole on this rank, outside a capture: its FP8 copies may be kept."""
    return _held_whole_param(w) and not _capturing(w)


def _kept(weights: list[torch.Tensor], keep: bool | None, key: tuple, make: Callable[[], T]) -> T:
    # while a graph that keeps copies records or captures: its copy ([Note: fp8 weights kept in CUDA graphs])
    """``make()``, or the copy kept for the step: [Note: fp8 weights kept across microbatches]."""
    graph = graph_kept.current()
    if graph is not None and weights and all(_held_whole_param(w) for w in weights):
        return graph.kept(weights, key, make)
    if keep is None or not weights or not all(_whole_here(w) for w in weights):
        return make()
    # several weights' copy is kept by the first, the others' write tokens in its key: a boundary of any misses
    others = tuple(write_token(w) for w in weights[1:])
    return weights[0].cached((_KEPT, *key, others), make, refresh=keep)


def in_backward(keep: bool | None) -> bool | None:
    """A call's ``keep`` for its backward: True reuses what its forward's step kept (the weights cannot change)."""
    return None if keep is None else False


def materialize_quantized(weight: torch.Tensor, recipe: Recipe, *, backward: bool,
                          keep: bool | None = None) -> list[Quantized]:
    """The full weight in FP8 for a GEMM: one ``Quantized`` per ``[N, K]`` matrix (per expert if packed); a foreign
    DistributedWeight is materialized through the protocol, then quantized ([Note: fp8 distributed weights]).
    ``keep``: a module call's ``is_first_microbatch`` ([Note: fp8 weights kept across microbatches])."""
    return _kept([weight], keep, ("matrices", recipe, backward),
                 lambda: _materialize_quantized(weight, recipe, backward=backward))


def _materialize_quantized(weight: torch.Tensor, recipe: Recipe, *, backward: bool) -> list[Quantized]:
    if isinstance(weight, ShardedWeight):
        return recipe.quantize_sharded(weight)
    if isinstance(weight, DistributedParameter):
        return quantize_weight(weight.detach(), recipe, amax=global_amax(weight)
                               if recipe.family == "per_tensor" else None)
    if is_distributed_weight(weight):
        fn = materialize_weight_for_backward if backward else materialize_weight_for_forward
        return quantize_weight(fn([weight])[0], recipe)
    return quantize_weight(weight.detach(), recipe)


def _plain(weight: torch.Tensor) -> bool:
    """A local weight that no protocol materializes (not distwgrad's, not a foreign DistributedWeight)."""
    return not isinstance(weight, DistributedParameter) and not is_distributed_weight(weight)


def _held_whole(w: torch.Tensor) -> bool:
    """Whether ``w`` is held whole here (plain, or a ShardedWeight of one rank), contiguous, on the kernels,
    and not under torch.compile tracing (the group kernels read the weights' addresses)."""
    from distwgrad.ops import grouped_gemm as gg  # late: distwgrad.ops imports this package
    whole = _plain(w) or (isinstance(w, ShardedWeight) and len(w.shard_rows) == 1)
    return whole and w.is_contiguous() and gg.kernels_available(w) and not torch.compiler.is_compiling()


def _whole_experts(w: torch.Tensor, recipe: BlockwiseScaling) -> bool:
    """Whether ``w`` (a matrix or packed ``[E, N, K]``, N a multiple of the block side) is held whole here
    (``_held_whole``): then one launch quantizes it blockwise into its GEMM's layout."""
    return w.dim() in (2, 3) and w.shape[-2] % recipe.weight_block[0] == 0 and _held_whole(w)


def materialize_quantized_group(weights: list[torch.Tensor], recipe: Recipe, *, backward: bool,
                                stacked: bool = False, amax: torch.Tensor | None = None,
                                keep: bool | None = None) -> list[Quantized] | QuantizedExperts:
    """:func:`_materialize_quantized_group`, or its copy kept for the step (``keep``: [Note: fp8 weights kept
    across microbatches])."""
    if graph_kept.current() is not None:  # a graph's copy is re-made when this call's amax is stale
        amax = None
    return _kept(weights, keep, ("group", recipe, backward, stacked), lambda: _materialize_quantized_group(
        weights, recipe, backward=backward, stacked=stacked, amax=amax))


def _materialize_quantized_group(weights: list[torch.Tensor], recipe: Recipe, *, backward: bool,
                                 stacked: bool = False, amax: torch.Tensor | None = None
                                 ) -> list[Quantized] | QuantizedExperts:
    """:func:`materialize_quantized` of each weight, concatenated; the fast paths below give the same bits.
    Plain weights under per-tensor scaling on the kernels are quantized together into one buffer in the reading
    GEMM's layout (``backward``: dgrad's; [Note: a group of weights in two launches]), not under torch.compile
    (the launch reads addresses). ``stacked``: those, a packed sharded weight and one weight held whole here come
    as one ``QuantizedExperts`` (a Linear's dgrad then reads its weight in place), the rest as a list. ``amax``:
    an earlier call's on the unchanged weights (the caller checks ``write_token``s), so backward skips that pass."""
    from distwgrad.ops import grouped_gemm as gg  # late: distwgrad.ops imports this package
    pt, bw = cast("PerTensorScaling", recipe), cast("BlockwiseScaling", recipe)  # as its family says
    if (stacked and recipe.family == "per_tensor" and len(weights) == 1 and isinstance(weights[0], ShardedWeight)
            and weights[0].dim() == 3 and gg.kernels_available(weights[0]) and not torch.compiler.is_compiling()):
        return _sharded_experts(weights[0], pt, backward=backward, amax=amax)
    if stacked and recipe.family == "blockwise" and len(weights) == 1 and _whole_experts(weights[0], bw):
        from distwgrad.ops.quantize import quantize_experts_blockwise
        local = weights[0].detach()
        return quantize_experts_blockwise(local if local.dim() == 3 else local[None], bw, transpose=backward)
    if (stacked and recipe.family == "per_tensor" and len(weights) == 1 and isinstance(weights[0], ShardedWeight)
            and weights[0].dim() == 2 and _held_whole(weights[0])):  # a matrix as one expert, from itself
        from distwgrad.ops.quantize import quantize_packed_per_tensor
        w = weights[0]
        return quantize_packed_per_tensor(w.detach()[None], pt.fwd_dtype,
                                          global_amax(w).reshape(1) if amax is None else amax[:1],
                                          margin=pt.margin, transpose=backward)
    if (recipe.family == "per_tensor" and weights and all(_plain(w) for w in weights)
            and gg.kernels_available(weights[0]) and not torch.compiler.is_compiling()):
        if all(w.dim() == 2 for w in weights):  # one matrix per weight (the kernels read only their addresses)
            mats, owner = weights, None
        else:  # a packed parameter's experts share its one amax, as quantize_weight gives them
            mats = [m for w in weights for m in ([w] if w.dim() == 2 else w.unbind(0))]
            owner = [i for i, w in enumerate(weights) for _ in range(1 if w.dim() == 2 else w.shape[0])]
        from distwgrad.ops.quantize import quantize_weights_alike  # (None unless one shape, dtype, device)
        experts = quantize_weights_alike(mats, pt.fwd_dtype, margin=pt.margin, transpose=backward,
                                         shared=owner, amax=amax)
        if experts is not None:
            return experts if stacked else experts.unbind()
    return [q for w in weights for q in _materialize_quantized(w, recipe, backward=backward)]

