"""Units: the weights of one module gathered in one all-gather and reduced in one reduce-scatter.

``distwgrad.coalesce(model)`` makes each block a *unit*, as FSDP2's ``fully_shard`` does.

[Note: coalesced units]
* Units: by default each member of every ``nn.ModuleList`` directly under the model; the model is the root
  unit and takes every weight no single unit owns, so a tied weight reduces once, after its last use.
* Buckets: a unit's multi-rank ``ShardedWeight``s with one ``_key``; anything else keeps its own collectives.
* Gather: the first pass notes which members a unit's forward and backward ask for; from then on each bucket
  gathers them in ONE all-gather of a flat staging buffer. Forward copies live until the unit's forward
  returns, never saved for backward; a backward copy is handed out once, and at most two units' are alive.
* Prefetch: when a unit gathers, the next unit's gather (learned, or ``set_modules_to_*_prefetch``) is
  launched asynchronously; the first unit of a pass carries the next one's in its own collective.
* Passes: a pass (the outermost unit's forward) starts with no copy and, returning or raising, drops its
  unused prefetches: no copy outlives its pass, whatever wrote the weights (a fused optimizer, ``.data``), and
  one whose member's token moved is dropped too ([Note: weight lifecycle]).
* Reduce: a bucket reduces once no member owes a contribution, in one fp32 reduce-scatter. A complete member
  used again first (a deferred wgrad not drained) makes the bucket reduce its complete members then, so each
  buffer reduces at the contents it would have alone: bit-identical gradients (a few ulps where gloo sums
  more than two ranks in another order). One entry of the in-flight bound ([Note: contribution accounting]);
  all-reduced across a 2-D mesh's replicas ([Note: device meshes]).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from distwgrad.weights import _accounting, _comm
from distwgrad.weights.base import DistributedParameter
from distwgrad.weights.sharded import ShardedWeight

__all__ = ["coalesce", "Unit", "Units"]


def _key(w: ShardedWeight) -> tuple:
    return (id(w.group), id(w.replicate_group), w.dtype, w.param_dtype, w.device, w.reduce_policy)


def _coalescable(w: Any) -> bool:
    return isinstance(w, ShardedWeight) and not w._solo and w.requires_grad


class _Layout:
    """Where each member sits in a bucket's flat per-rank block: offsets in elements."""

    def __init__(self, members: Sequence[ShardedWeight]) -> None:
        self.members = list(members)
        self.row_numel = [math.prod(w.shape[1:]) for w in self.members]
        self.lengths = [w._padded_rows * n for w, n in zip(self.members, self.row_numel)]
        self.offsets = [sum(self.lengths[:i]) for i in range(len(self.members))]
        self.per_rank = sum(self.lengths)
        self.size = _comm.group_size(self.members[0].group)

    def slot(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Member ``i``'s block in a rank-major ``[size * per_rank]`` buffer, as ``[size, padded_rows, ...]``."""
        w = self.members[i]
        view = flat.view(self.size, self.per_rank)[:, self.offsets[i]:self.offsets[i] + self.lengths[i]]
        return view.view(self.size, w._padded_rows, *w.shape[1:])


class _Gather:
    """One all-gather in flight: the staging buffer it reads, the flat buffer it writes, the copy-out."""

    def __init__(self, layout: _Layout, work: Any, gathered: torch.Tensor, staging: torch.Tensor) -> None:
        self.layout, self._work = layout, work
        self._gathered: torch.Tensor | None = gathered
        self._staging: torch.Tensor | None = staging  # the collective reads it until the wait
        self.full: dict[int, torch.Tensor] = {}

    def wait(self) -> None:
        """Waits for the all-gather (once); a gather is only ever dropped after this."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._staging = None

    def ready(self) -> dict[int, torch.Tensor]:
        """Waits, then copies every member out of the flat buffer into its full tensor (once) and frees it."""
        self.wait()
        if self._gathered is not None:
            for i, w in enumerate(self.layout.members):
                block = self.layout.slot(self._gathered, i)
                if len(set(w.shard_rows)) == 1:
                    self.full[id(w)] = block.reshape(w.full_shape)
                else:
                    self.full[id(w)] = torch.cat([block[r, :rows] for r, rows in enumerate(w.shard_rows)])
            self._gathered = None
        return self.full


class _Copies:
    """One bucket's share of a gather: its members' full tensors and the token each was gathered at."""

    def __init__(self, gather: _Gather, members: Sequence[ShardedWeight]) -> None:
        self.gather, self.members = gather, list(members)
        self.tokens = {id(w): w.copy_token() for w in self.members}
        self.taken: set[int] = set()

    def has(self, w: ShardedWeight) -> bool:
        return id(w) in self.tokens

    def fresh(self, w: ShardedWeight) -> bool:
        """The member's token is unchanged since the gather ([Note: weight lifecycle])."""
        return self.tokens.get(id(w)) == w.copy_token()

    def all_fresh(self) -> bool:
        return all(self.fresh(w) for w in self.members)

    def wait(self) -> None:
        self.gather.wait()

    def ready(self) -> dict[int, torch.Tensor]:
        return self.gather.ready()


def _launch_gather(parts: Sequence[Sequence[ShardedWeight]], units: Units) -> list[_Copies]:
    """ONE all-gather of every part's members (same-key buckets); one :class:`_Copies` per part."""
    members = [w for part in parts for w in part]
    layout = _Layout(members)
    locals_ = [w._padded(w._local_for_gather()).reshape(-1) for w in members]
    staging = torch.cat(locals_) if len(locals_) > 1 else locals_[0]
    gathered = staging.new_empty(layout.size * layout.per_rank)
    work = _comm.all_gather_into(gathered, staging, members[0].group, async_op=True)
    for w, n in zip(members, layout.lengths):
        w.bytes_gathered += layout.size * n * staging.element_size()
    units.collectives += 1
    gather = _Gather(layout, work, gathered, staging)
    return [_Copies(gather, part) for part in parts]


class _BucketLaunch:
    """One coalesced reduction in flight; shares point at it, never back, so no cycle keeps its result alive."""

    def __init__(self, launched: _accounting.Launched, members: list[DistributedParameter]) -> None:
        self._launched = launched
        self._members = members
        self._landed: set[int] = set()
        self._flat: torch.Tensor | None = None

    def flat(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = self._launched()
        return self._flat

    def member_landed(self, member: DistributedParameter) -> None:
        self._landed.add(id(member))
        if len(self._landed) == len(self._members):
            _accounting.forget(self)
            self._flat, self._members = None, []

    def _land_oldest(self) -> None:
        """Lands every member's share still in flight (each is its member's oldest); the last forgets this."""
        for w in list(self._members):
            if id(w) not in self._landed:
                w._life.land_oldest(w)


class _Share:
    """A member's part of a coalesced reduction: called, it waits (once for all) and gives its slice."""

    __slots__ = ("launch", "member", "start", "numel", "shape")

    def __init__(self, launch: _BucketLaunch, member: DistributedParameter, start: int) -> None:
        self.launch, self.member, self.start = launch, member, start
        self.numel, self.shape = member.numel(), member.shape

    def __call__(self) -> torch.Tensor:
        out = self.launch.flat()[self.start:self.start + self.numel].view(self.shape)
        self.launch.member_landed(self.member)
        return out


class _Bucket:
    """The coalescable members of one unit that share a key (``_key``)."""

    def __init__(self, unit: Unit, members: list[ShardedWeight], key: tuple) -> None:
        self.unit, self.key = unit, key
        self.members = members
        self.forward_set: list[ShardedWeight] | None = None
        self.backward_set: list[ShardedWeight] | None = None
        self.learning_backward = False  # until the unit's first backward is over
        self._fwd_asked: list[ShardedWeight] = []

    # --- reduce --------------------------------------------------------------------------------------
    def maybe_reduce(self) -> None:
        """PER_MICROBATCH: reduce once no member has a contribution outstanding."""
        if all(w.pending_contributions == 0 for w in self.members):
            self.flush()

    def flush(self) -> None:
        """Reduces every complete member in one reduce-scatter; members still owing keep their buffers."""
        ready = [w for w in self.members if w._life.complete_unreduced()]
        if not ready:
            return
        first = ready[0]
        size, total = _comm.group_size(first.group), first.dp_size
        asynchronous = first.async_reduce
        if asynchronous:
            _accounting.admit()
        layout = _Layout(ready)
        uneven = any(len(set(w.shard_rows)) > 1 for w in ready)
        staging = (torch.zeros if uneven else torch.empty)(size * layout.per_rank, dtype=torch.float32,
                                                          device=first.device)
        for i, w in enumerate(ready):
            buffer = w._life.take_buffer()
            slot = layout.slot(staging, i)
            if len(set(w.shard_rows)) == 1:
                slot.copy_(buffer.view(size, w._padded_rows, *w.shape[1:]))
            else:
                for r, part in enumerate(buffer.split(w.shard_rows)):
                    slot[r, :part.shape[0]].copy_(part)
            del buffer
            w.bytes_reduced += size * layout.lengths[i] * 4
            if w.replicate_group is not None:
                w.bytes_reduced += layout.lengths[i] * 4
        out = staging.new_empty(layout.per_rank)
        work = _comm.reduce_scatter_sum(out, staging, first.group, async_op=asynchronous)
        self.unit.units.collectives += 1
        if first.replicate_group is None:
            launched = _accounting.Launched(work, lambda: out.div_(size), keep=staging)
        else:
            def across_replicas() -> torch.Tensor:  # after the reduce-scatter landed: [Note: device meshes]
                _comm.all_reduce_sum(out, first.replicate_group)
                self.unit.units.collectives += 1
                return out.div_(total)
            launched = _accounting.Launched(work, across_replicas, keep=staging, collective_at_wait=True)
        del staging
        launch = _BucketLaunch(launched, list(ready))
        for i, w in enumerate(ready):
            w._life.add_inflight(_Share(launch, w, layout.offsets[i]))
        if asynchronous:
            _accounting.launched(launch, launch._land_oldest, launched)
        else:
            for w in ready:
                w._life.land_oldest(w)

    # --- gather --------------------------------------------------------------------------------------
    def forward_members(self) -> list[ShardedWeight]:
        return self.forward_set or []

    def backward_set_or_empty(self) -> list[ShardedWeight]:
        return self.backward_set or []

    def backward_members(self, asking: ShardedWeight | None = None) -> list[ShardedWeight]:
        """The backward set's members that still owe a contribution (and ``asking``)."""
        return [w for w in self.backward_set_or_empty() if w is asking or w.pending_contributions > 0]


class Unit:
    """One unit of :func:`coalesce`: a module whose weights gather and reduce together."""

    def __init__(self, units: Units, module: nn.Module, name: str, weights: list[DistributedParameter]) -> None:
        self.units, self.module, self.name = units, module, name
        self.weights = weights
        by_key: dict[tuple, list[ShardedWeight]] = {}
        for w in weights:
            if _coalescable(w):
                by_key.setdefault(_key(w), []).append(w)  # type: ignore[arg-type]
        self.buckets = [_Bucket(self, ws, key) for key, ws in by_key.items()]
        for b in self.buckets:
            for w in b.members:
                w._bucket = b
        self._forward: dict[int, _Copies] = {}  # bucket id -> the copies of the running forward
        self._backward: dict[int, _Copies] = {}  # bucket id -> backward copies not handed out yet
        self._prefetched_fwd: dict[int, _Copies] = {}
        self._prefetched_bwd: dict[int, _Copies] = {}
        self.in_forward = 0
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None

    def __repr__(self) -> str:
        return f"Unit({self.name or '<root>'}: {len(self.weights)} weights, {len(self.buckets)} buckets)"

    # --- explicit prefetch order (FSDP2's set_modules_to_*_prefetch) ---------------------------------
    def set_modules_to_forward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """The units whose gathers start when this unit's forward starts (replaces the learned order)."""
        self.forward_prefetch = [self.units.unit_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """The units whose backward gathers start when this unit's backward gathers (replaces the learned order)."""
        self.backward_prefetch = [self.units.unit_of(m, "set_modules_to_backward_prefetch") for m in modules]

    # --- forward ---------------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:  # recomputation inside backward: gather on demand
            return
        self.in_forward += 1
        if self.in_forward > 1:
            return
        self.units._saw_forward(self)
        if self.units._pass_owner is None:
            self.units._begin_pass(self)
        _release(self._backward)  # leftovers of an earlier backward are never reused
        for b in self.buckets:
            b._fwd_asked = []
            b.learning_backward = False
            pre = self._prefetched_fwd.pop(id(b), None)
            if pre is not None and pre.all_fresh() and _same(pre.members, b.forward_set):
                self._forward[id(b)] = pre
            else:
                if pre is not None:
                    pre.wait()
                copies = self._gather_with_next(b, b.forward_members(), self.units.next_forward(self), True)
                if copies is not None:
                    self._forward[id(b)] = copies
        for nxt in self.units.next_forward(self):
            nxt._prefetch_forward()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1 or self.in_forward == 0:
            return
        self.in_forward -= 1
        if self.in_forward:
            return
        _release(self._forward)
        for b in self.buckets:
            if b._fwd_asked:
                b.forward_set = _ordered(b.members, (b.forward_set or []) + b._fwd_asked)
        self.units._end_pass(self)

    def _prefetch_forward(self) -> None:
        for b in self.buckets:
            if b.forward_set and id(b) not in self._prefetched_fwd:
                (self._prefetched_fwd[id(b)],) = _launch_gather([b.forward_set], self.units)

    def forward_copy(self, w: ShardedWeight) -> torch.Tensor:
        b = w._bucket
        b._fwd_asked.append(w)
        copies = self._forward.get(id(b)) if self.in_forward else None
        if copies is not None and copies.has(w) and copies.fresh(w):
            return copies.ready()[id(w)]
        return w._gather()

    # --- backward --------------------------------------------------------------------------------------
    def backward_copy(self, w: ShardedWeight) -> torch.Tensor:
        b = w._bucket
        self.units._saw_backward(self)
        if b.backward_set is None or not any(m is w for m in b.backward_set):
            learning = b.backward_set is None
            b.backward_set = _ordered(b.members, b.backward_set_or_empty() + [w])
            if learning:  # the first backward: each member gathers on its own while the set is noted
                b.learning_backward = True
        if b.learning_backward:
            return w._gather()
        copies = self._backward.get(id(b))
        if copies is not None and copies.has(w) and id(w) in copies.taken:
            return w._gather()  # asked twice in one backward (a use repeated inside the unit)
        if copies is None or not copies.has(w) or not copies.fresh(w):
            copies = self._prefetched_bwd.pop(id(b), None)
            if copies is None or not copies.has(w) or not copies.all_fresh():
                if copies is not None:
                    copies.wait()
                copies = self._gather_with_next(b, b.backward_members(w), self.units.next_backward(self), False)
                assert copies is not None  # w itself is a member
            if id(b) in self._backward:
                self._backward.pop(id(b)).wait()
            self._backward[id(b)] = copies
            self.units._backward_live(self)
            for nxt in self.units.next_backward(self):
                nxt._prefetch_backward()
        copies.taken.add(id(w))
        full = copies.ready()[id(w)]
        if len(copies.taken) == len(copies.members):
            del self._backward[id(b)]
        return full

    def _gather_with_next(self, b: _Bucket, mine: list[ShardedWeight], nexts: list[Unit],
                          forward: bool) -> _Copies | None:
        """Gathers ``mine`` and, in the same collective, each next unit's same-key bucket not prefetched yet."""
        if not mine:
            return None
        parts, owners = [mine], []
        for nxt in nexts:
            nb = next((x for x in nxt.buckets if x.key == b.key), None)
            store = nxt._prefetched_fwd if forward else nxt._prefetched_bwd
            if nb is None or id(nb) in store or (not forward and id(nb) in nxt._backward):
                continue
            theirs = nb.forward_members() if forward else nb.backward_members()
            if theirs:
                parts.append(theirs)
                owners.append((nxt, store, nb))
        copies = _launch_gather(parts, self.units)
        for (nxt, store, nb), share in zip(owners, copies[1:]):
            store[id(nb)] = share
            if not forward:
                self.units._backward_live(nxt)
        return copies[0]

    def _prefetch_backward(self) -> None:
        for b in self.buckets:
            if b.backward_set and id(b) not in self._prefetched_bwd and id(b) not in self._backward:
                members = b.backward_members()
                if members:
                    (self._prefetched_bwd[id(b)],) = _launch_gather([members], self.units)
        self.units._backward_live(self)

    def drop(self) -> None:
        """Drops every copy (forward, backward, prefetched), waiting for gathers still in flight."""
        for d in (self._prefetched_fwd, self._prefetched_bwd, self._backward):
            _release(d)


def _release(sets: dict[int, _Copies]) -> None:
    """Drops gathered sets, each after its all-gather completed (the collective writes into it)."""
    for copies in sets.values():
        copies.wait()
    sets.clear()


def _same(a: Sequence[Any], b: Sequence[Any] | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _ordered(members: Sequence[Any], chosen: Iterable[Any]) -> list[Any]:
    ids = {id(w) for w in chosen}
    return [w for w in members if id(w) in ids]


class Units(list):
    """The units of one :func:`coalesce` call, root last; ``collectives`` counts coalesced collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives = 0
        self._fwd_order: list[Unit] = []
        self._bwd_order: list[Unit] = []
        self._bwd_live: list[Unit] = []
        self._learning_fwd = True
        self._learning_bwd = True
        self._pass_owner: Unit | None = None  # the unit whose forward runs the current pass

    def unit_of(self, module: nn.Module, who: str) -> Unit:
        for u in self:
            if u.module is module:
                return u
        raise ValueError(f"{who}: {type(module).__name__} is not a unit of this coalesce() call; units are "
                         f"{[u.name or '<root>' for u in self]}")

    def _saw_forward(self, unit: Unit) -> None:
        """The first forward's order; a unit seen again opens the next pass and ends the learning."""
        if self._learning_bwd and self._bwd_order:
            self._learning_bwd = False  # a forward after a backward: that backward's order is complete
        if self._learning_fwd:
            if unit in self._fwd_order:
                self._learning_fwd = False
            else:
                self._fwd_order.append(unit)

    def _saw_backward(self, unit: Unit) -> None:
        if self._learning_bwd and unit not in self._bwd_order:
            self._bwd_order.append(unit)

    def next_forward(self, unit: Unit) -> list[Unit]:
        return _after(unit, unit.forward_prefetch, self._fwd_order, self._learning_fwd)

    def next_backward(self, unit: Unit) -> list[Unit]:
        return _after(unit, unit.backward_prefetch, self._bwd_order, self._learning_bwd)

    def _backward_live(self, unit: Unit) -> None:
        """At most the current and the next unit keep backward copies."""
        if unit in self._bwd_live:
            self._bwd_live.remove(unit)
        self._bwd_live.append(unit)
        while len(self._bwd_live) > 2:
            self._bwd_live.pop(0).drop()

    def _begin_pass(self, unit: Unit) -> None:
        """A forward pass starts (the outermost unit's forward): nothing gathered before it is used in it."""
        self._pass_owner = unit
        self.end_step()

    def _end_pass(self, unit: Unit) -> None:
        """The pass's outermost forward returned or raised: the prefetches it left unused are waited for, dropped."""
        if self._pass_owner is unit:
            self._pass_owner = None
            for u in self:
                _release(u._prefetched_fwd)

    def end_step(self) -> None:
        for u in self:
            u.drop()
        self._bwd_live = []


def _after(unit: Unit, explicit: list[Unit] | None, order: list[Unit], learning: bool) -> list[Unit]:
    """The units to prefetch after ``unit``: the explicit list if set, else the next one of a learned order."""
    if explicit is not None:
        return explicit
    if learning or unit not in order:
        return []
    i = order.index(unit)
    return order[i + 1:i + 2]


def _block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            out += [(f"{name}.{i}", m) for i, m in enumerate(child)]
    return out


def coalesce(model: nn.Module, units: Sequence[nn.Module] | None = None) -> Units:
    """Makes ``model``'s blocks units whose sharded weights gather and reduce in one collective each.

    ``units``: the unit modules (default: each member of every ``nn.ModuleList`` directly under ``model``);
    ``model`` is the root unit, last ([Note: coalesced units]). Call once, before the first step; raises
    ``ValueError`` for a unit outside ``model`` or a weight already in a unit."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"coalesce needs an nn.Module, got {type(model).__name__}")
    named = dict((id(m), n) for n, m in model.named_modules())
    if units is None:
        chosen = _block_modules(model)
    else:
        chosen = []
        for m in units:
            if not isinstance(m, nn.Module) or id(m) not in named:
                raise ValueError(f"coalesce: units must be submodules of the model; got {type(m).__name__}"
                                 f"{'' if isinstance(m, nn.Module) else ' (not a module)'}")
            if m is model:
                raise ValueError("coalesce: the model itself is always the root unit; list only its submodules")
            chosen.append((named[id(m)], m))
        if len({id(m) for _, m in chosen}) != len(chosen):
            raise ValueError(f"coalesce: a module is listed twice in units: {[n for n, _ in chosen]}")
    owners: dict[int, list[int]] = {}
    weights: dict[int, DistributedParameter] = {}
    for i, (_, m) in enumerate(chosen):
        for p in m.parameters():
            if isinstance(p, DistributedParameter):
                weights[id(p)] = p
                if i not in owners.setdefault(id(p), []):
                    owners[id(p)].append(i)
    for p in model.parameters():
        if isinstance(p, DistributedParameter):
            weights[id(p)] = p
            if getattr(p, "_unit", None) is not None:
                raise ValueError(f"coalesce: {p._name()} already belongs to a unit (coalesce was called on this "
                                 f"model, or on a model sharing its weights, before)")
    result = Units()
    per_unit: list[list[DistributedParameter]] = [[] for _ in chosen]
    root: list[DistributedParameter] = []
    for pid, p in weights.items():
        homes = owners.get(pid, [])
        (per_unit[homes[0]] if len(homes) == 1 else root).append(p)
    for (name, m), ws in zip(chosen, per_unit):
        result.append(Unit(result, m, name, ws))
    result.append(Unit(result, model, "", root))
    for u in result:
        for w in u.weights:
            w._unit = u
        u.module.register_forward_pre_hook(u._pre_forward)
        u.module.register_forward_hook(u._post_forward, always_call=True)
    return result
