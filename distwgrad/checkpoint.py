"""Checkpoints of sharded models through ``torch.distributed.checkpoint`` (DCP), reshardable.

[Note: checkpoint layout]
Each local shard is wrapped, without a copy, as a DTensor of the whole tensor: ``[Shard(0)]`` over the
weight's group (``torch.chunk`` is DTensor's layout), ``[Replicate(), Shard(0)]`` on a 2-D mesh ([Note:
device meshes] in ``weights/sharded.py``), ``[Shard(0), Shard(0)]`` on an expert-parallel ``(ep, dp)`` mesh.
Each is the same global tensor, so DCP reshards to any world size, mesh or ep size. Entries: ``model.<name>``
once per distinct weight (a tied weight stays one object), ``optim.<name>.<key>`` (shard-shaped state
wrapped like the weight), ``train.step``, ``rng.*`` (every rank draws identically: one copy serves all).
``meta.json`` (config, step, world size, parameter shapes) is the cheap fit check before DCP runs.

[Note: checkpoints of pipeline stages]
A stage's parameters carry the whole model's names (a weight tied across stages is ``embedding.weight`` on
both), so the entries are the same at any pp size and ``meta.json``'s ``params`` is the union over ranks.
Both copies of a tied weight write the same rows (DCP keeps one writer) and read them back.

[Note: atomic save]
Ranks write ``step_N.tmp``; after DCP's final barrier rank 0 writes ``meta.json`` and renames the folder to
``step_N`` (atomic on POSIX); a re-saved step moves to ``step_N.old`` just before. ``keep_last`` prunes only
after the rename, renaming each folder out of the ``step_N`` pattern before deleting it. So a killed save
never leaves an incomplete ``step_N`` (``tests/test_train_faults.py`` kills one at each point).

[Note: DCP imported on use]
DCP and DTensor take about a second to import and most processes never save or load: imported where used.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

from distwgrad.weights import DistributedParameter, ShardedWeight, _comm

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "interrupted_saves",
           "checkpoint_dir", "full_tensor"]

META_FILE = "meta.json"
_DCP_META = ".metadata"
_FORMAT = "distwgrad.checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or written for a different model."""


def checkpoint_dir(root: str | os.PathLike, step: int) -> str:
    """``root/step_{step}``: where :func:`save_checkpoint` puts the checkpoint of ``step``."""
    return os.path.join(os.fspath(root), f"step_{step}")


# --- state dict ------------------------------------------------------------------------------------------

def _params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Distinct parameters by first name: a tied weight appears once ([Note: checkpoint layout])."""
    return list(model.named_parameters())  # remove_duplicate=True keeps the first name of each object


def _contiguous_stride(shape: Iterable[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(list(shape)):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


class _Wrapper:
    """Lays tensors out like a weight's shard: a DTensor for a ``ShardedWeight``, the tensor otherwise."""

    def __init__(self, group: Any, device_type: str) -> None:
        self.group, self.device_type = group, device_type
        self._mesh: DeviceMesh | None = None

    def mesh(self, group: Any) -> DeviceMesh:
        if group is not self.group or self._mesh is None:
            self.group, self._mesh = group, DeviceMesh.from_group(group, self.device_type)
        assert self._mesh is not None
        return self._mesh

    def __call__(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if not isinstance(like, ShardedWeight) or like.group is None:
            return t
        if tuple(t.shape) != tuple(like.shape):
            raise ValueError(f"a tensor of shape {tuple(t.shape)} cannot be laid out like a shard of shape "
                             f"{tuple(like.shape)}")
        from torch.distributed.tensor import DTensor, Replicate, Shard  # [Note: DCP imported on use]

        placements: list[Placement] = [Shard(0)]
        mesh = self.mesh(like.group)
        if like.replicate_group is not None:  # a 2-D (replicate, shard) mesh: [Note: checkpoint layout]
            mesh, placements = like.mesh, [Replicate(), Shard(0)]
        if like.expert_mesh is not None:  # an ep rank's experts, sharded over its dp group
            mesh, placements = like.expert_mesh, [Shard(0), Shard(0)]
        return DTensor.from_local(t, mesh, placements, run_check=False,
                                  shape=like.global_shape, stride=_contiguous_stride(like.global_shape))


def full_tensor(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The full tensor of ``local`` laid out like ``like``'s shard (collective for a ``ShardedWeight``)."""
    from torch.distributed.tensor import DTensor  # [Note: DCP imported on use]

    wrapped = _Wrapper(getattr(like, "group", None), local.device.type)(local, like)
    return wrapped.full_tensor() if isinstance(wrapped, DTensor) else local


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, wrap: _Wrapper,
                step: int) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, p in _params(model):
        state[f"model.{name}"] = wrap(p.detach(), p)
        for key, value in (optimizer.state.get(p, {}) if optimizer is not None else {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[f"optim.{name}.{key}"] = wrap(value, p)
            else:
                state[f"optim.{name}.{key}"] = value
    state["train.step"] = torch.tensor(step, dtype=torch.int64)
    state["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng.cuda"] = torch.cuda.get_rng_state()
    return state


# --- save ------------------------------------------------------------------------------------------------

def save_checkpoint(root: str | os.PathLike, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, group: Any = None,
                    meta: dict[str, Any] | None = None, keep_last: int = 0) -> str:
    """Saves ``model`` (and ``optimizer``) at ``step`` into ``root/step_{step}``; returns that path. Collective
    over ``group``. ``meta`` (JSON; the model config under ``"model_config"``) goes to ``meta.json`` for
    :func:`load_checkpoint`; ``keep_last=K > 0`` keeps the newest ``K`` checkpoints ([Note: atomic save])."""
    if not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"keep_last={keep_last!r} must be an int >= 0 (0: keep every checkpoint)")
    group = _comm.resolve_group(group)
    rank = _comm.group_rank(group)
    final = checkpoint_dir(root, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an interrupted save of this step
        os.makedirs(tmp)
    _barrier(group)
    state = _state_dict(model, optimizer, _Wrapper(group, _device_type(model)), step)
    import torch.distributed.checkpoint as dcp  # [Note: DCP imported on use]

    with _single_process_quiet(group):
        dcp.save(state, checkpoint_id=tmp, process_group=group, no_dist=group is None)
    params = _all_params(model, group)  # collective: every rank's names ([Note: checkpoints of pipeline stages])
    if rank == 0:
        record = {"format": _FORMAT, "step": step, "world_size": _comm.group_size(group), "params": params,
                  **(meta or {})}
        _write_json(os.path.join(tmp, META_FILE), record)
        _replace_dir(tmp, final)
        if keep_last:
            _prune(os.fspath(root), step, keep_last)
    _barrier(group)
    return final


def _prune(root: str, newest: int, keep_last: int) -> None:
    """Deletes all but the ``keep_last`` newest complete checkpoints and older leftovers ([Note: atomic save])."""
    complete = []
    for d in os.listdir(root):
        m = re.match(r"^step_(\d+)(\.tmp|\.old|\.deleting)?$", d)
        if not m or int(m.group(1)) > newest:
            continue
        if m.group(2) == ".deleting":  # a prune killed part-way
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
            continue
        if m.group(2):
            if int(m.group(1)) < newest:
                _delete(os.path.join(root, d))
            continue
        try:
            _check_complete(os.path.join(root, d))
            complete.append((int(m.group(1)), d))
        except CheckpointError:
            _delete(os.path.join(root, d))  # not complete: never resumed from, nothing to keep
    for _, d in sorted(complete)[:-keep_last]:
        _delete(os.path.join(root, d))


def _delete(path: str) -> None:
    doomed = path + ".deleting"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(tmp: str, final: str) -> None:
    """``tmp`` becomes ``final``; an older ``final`` (a re-save of the same step) is moved away first."""
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    dir_fd = os.open(os.path.dirname(os.path.abspath(final)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself is durable
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def _single_process_quiet(group: Any) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is what we asked for."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _barrier(group: Any) -> None:
    if group is not None:
        dist.barrier(group=group)


def _device_type(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return "cpu" if p is None else p.device.type


# --- find and check --------------------------------------------------------------------------------------

def resolve_checkpoint(path: str | os.PathLike) -> str:
    """A complete checkpoint folder: ``path`` itself or the newest ``step_N`` in it. ``CheckpointError`` if
    none, or if the newest is damaged (naming the previous complete one: never a silent fall back)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist or is not a folder")
    if os.path.exists(os.path.join(path, META_FILE)) or os.path.exists(os.path.join(path, _DCP_META)):
        _check_complete(path)
        return path
    steps = _steps(path)
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {path!r} (expected DCP files and {META_FILE}, or "
                              f"complete step_N folders; found {sorted(os.listdir(path))})")
    newest = os.path.join(path, steps[-1][1])
    try:
        _check_complete(newest)
    except CheckpointError as exc:
        older = next((os.path.join(path, d) for _, d in reversed(steps[:-1]) if _complete(os.path.join(path, d))),
                     None)
        instead = (f"; to resume from the previous complete checkpoint instead, pass --resume {older}" if older
                   else "; no older complete checkpoint is there")
        raise CheckpointError(f"the newest checkpoint in {path!r} is damaged: {exc}{instead}") from exc
    return newest


def interrupted_saves(path: str | os.PathLike) -> list[str]:
    """Interrupted saves (``step_N.tmp``) newer than the newest complete checkpoint: what resuming skips."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return []
    newest = max((n for n, _ in _steps(path)), default=-1)
    tmp = re.compile(r"^step_(\d+)\.tmp$")
    return sorted(os.path.join(path, d) for d in os.listdir(path) if (m := tmp.match(d)) and int(m.group(1)) > newest)


def _steps(path: str) -> list[tuple[int, str]]:
    return sorted((int(m.group(1)), d) for d in os.listdir(path) if (m := _STEP_DIR.match(d)))


def _complete(path: str) -> bool:
    try:
        _check_complete(path)
    except CheckpointError:
        return False
    return True


def _check_complete(path: str) -> None:
    """Every file the checkpoint needs is there and long enough (no collective, no tensor read)."""
    missing = [f for f in (META_FILE, _DCP_META) if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise CheckpointError(f"checkpoint {path!r} is incomplete: missing {missing} (an interrupted save "
                              f"leaves step_N.tmp, never resumed from)")
    import torch.distributed.checkpoint as dcp  # [Note: DCP imported on use]

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path!r}: unreadable {_DCP_META}: {exc}") from exc
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    short = {f: n for f, n in needed.items()
             if not os.path.exists(os.path.join(path, f)) or os.path.getsize(os.path.join(path, f)) < n}
    if short:
        raise CheckpointError(f"checkpoint {path!r} is incomplete: data files missing or truncated: "
                              f"{sorted(short)}")


def _read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint {path!r}: {META_FILE} has format {meta.get('format')!r}, "
                              f"expected {_FORMAT!r}")
    return meta


def _all_params(model: nn.Module, group: Any) -> dict[str, list[int]]:
    """Every parameter's full shape by name, the union over ``group``'s ranks (collective); a weight tied
    across pipeline stages must agree ([Note: checkpoints of pipeline stages])."""
    out: dict[str, list[int]] = {}
    for names in _comm.all_gather_objects({n: list(getattr(p, "global_shape", p.shape)) for n, p in _params(model)},
                                          group):
        for name, shape in names.items():
            if out.setdefault(name, shape) != shape:
                raise CheckpointError(f"parameter {name!r} has full shape {shape} on one rank and {out[name]} on "
                                      f"another")
    return dict(sorted(out.items()))


def _check_fits(path: str, meta: dict[str, Any], model: nn.Module, expect: dict[str, Any], group: Any) -> None:
    for key, want in expect.items():
        got = meta.get(key)
        if got != want:
            if isinstance(got, dict) and isinstance(want, dict):
                diff = {k: (got.get(k), want.get(k)) for k in sorted(set(got) | set(want))
                        if got.get(k) != want.get(k)}
                detail = f"differing fields (checkpoint, this run): {diff}"
            else:
                detail = f"checkpoint has {got!r}, this run {want!r}"
            raise CheckpointError(f"checkpoint {path!r} was written for another model: {key}: {detail}")
    ours = _all_params(model, group)
    theirs = meta.get("params", {})
    if ours != theirs:
        diff = {k: (theirs.get(k), ours.get(k)) for k in sorted(set(ours) | set(theirs))
                if ours.get(k) != theirs.get(k)}
        raise CheckpointError(f"checkpoint {path!r} was written for another model: parameter full shapes "
                              f"(checkpoint, this model): {diff}")


# --- load ------------------------------------------------------------------------------------------------

def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, group: Any = None, expect: dict[str, Any] | None = None) -> int:
    """Loads a checkpoint into ``model`` (and ``optimizer``), resharding to this world size; returns its step.

    Collective over ``group``. ``path``: a checkpoint, or a folder of ``step_N`` (the newest). ``expect``
    entries (e.g. ``{"model_config": ...}``) must equal ``meta.json``'s and parameter full shapes must match,
    checked on every rank before DCP runs; otherwise ``CheckpointError``, as for an incomplete checkpoint.
    """
    path = resolve_checkpoint(path)
    meta = _read_meta(path)
    group = _comm.resolve_group(group)
    _check_fits(path, meta, model, expect or {}, group)
    import torch.distributed.checkpoint as dcp  # [Note: DCP imported on use]

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    wrap = _Wrapper(group, _device_type(model))
    state = _load_targets(model, optimizer, wrap, saved)
    with _single_process_quiet(group):
        dcp.load(state, checkpoint_id=path, process_group=group, no_dist=group is None)
    _copy_back(model, optimizer, state)
    torch.set_rng_state(state["rng.cpu"])
    if "rng.cuda" in state:
        torch.cuda.set_rng_state(state["rng.cuda"])
    step = int(state["train.step"])
    if step != meta["step"]:
        raise CheckpointError(f"checkpoint {path!r}: {META_FILE} says step {meta['step']}, the data step {step}")
    return step


def _load_targets(model: nn.Module, optimizer: torch.optim.Optimizer | None, wrap: _Wrapper,
                  saved: dict[str, Any]) -> dict[str, Any]:
    """Tensors for DCP to fill in place: this rank's shards (of the model's own storage) and state."""
    state: dict[str, Any] = {}
    for name, p in _params(model):
        state[f"model.{name}"] = wrap(p.detach(), p)
        if optimizer is None:
            continue
        prefix = f"optim.{name}."
        current = optimizer.state.get(p, {})
        for key in sorted(k[len(prefix):] for k in saved if k.startswith(prefix)):
            md = saved[prefix + key]
            if not hasattr(md, "size"):  # a non-tensor value: DCP replaces the placeholder
                target = None
            elif key in current:
                target = current[key]
            elif tuple(getattr(md, "size", ())) == tuple(getattr(p, "global_shape", p.shape)):
                target = torch.zeros_like(p.detach(), dtype=md.properties.dtype)
            else:  # a scalar such as AdamW's step, which torch keeps on the CPU
                target = torch.zeros(md.size, dtype=md.properties.dtype)
            state[prefix + key] = wrap(target, p) if isinstance(target, torch.Tensor) and target.dim() else target
    state["train.step"] = torch.zeros((), dtype=torch.int64)
    state["rng.cpu"] = torch.get_rng_state()
    if "rng.cuda" in saved and torch.cuda.is_available():
        state["rng.cuda"] = torch.cuda.get_rng_state()
    return state


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor  # [Note: DCP imported on use]

    return t.to_local() if isinstance(t, DTensor) else t


def _copy_back(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Copies what DCP loaded into the weights and optimizer state, and tells each distributed weight its
    master was written, so nothing cached survives ([Note: weight lifecycle])."""
    with torch.no_grad():
        for name, p in _params(model):
            loaded = _local(state[f"model.{name}"])
            if loaded.data_ptr() != p.data_ptr() or loaded.numel() == 0:
                p.copy_(loaded)
            if isinstance(p, DistributedParameter):
                p.master_written("load_checkpoint")
            if optimizer is None:
                continue
            prefix = f"optim.{name}."
            entries = {k[len(prefix):]: _local(v) for k, v in state.items() if k.startswith(prefix)}
            if entries:
                optimizer.state[p] = entries
