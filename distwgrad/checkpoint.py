"""Checkpoints of sharded models through ``torch.distributed.checkpoint`` (DCP), reshardable.

[Note: checkpoint layout]
``ShardedWeight`` keeps dim-0 shards in the ``torch.chunk`` layout, which is DTensor's ``Shard(0)``. So
each local shard is wrapped, without a copy, as ``DTensor.from_local(shard, mesh, [Shard(0)],
shape=full_shape, stride=contiguous stride)`` over a 1-D mesh of the weight's group, and DCP records
which rows each rank wrote. Loading on another world size asks DCP for this rank's rows of the same
global tensors, so a run saved on 2 ranks resumes on 1 or 3. A weight on a 2-D (replicate, shard) device
mesh ([Note: device meshes] in ``weights/sharded.py``) is wrapped on that mesh as ``[Replicate(),
Shard(0)]``: DCP writes each row block once (the replicas hold the same bytes) and records the same global
tensor, so a checkpoint saved on a 2 x 2 mesh loads on 1 rank, on 2 (1-D) or on a 2 x 2 mesh again, and
back. An expert-parallel weight (one ep rank's experts, sharded over its dp group: ``spread_over_experts``)
is wrapped on its ``(ep, dp)`` mesh as ``[Shard(0), Shard(0)]`` with the whole ``[E, ...]`` tensor's shape
(``global_shape``): the same global tensor as at ep 1, so a checkpoint moves between ep sizes. The state
dict holds:

* ``model.<name>``: one entry per *distinct* weight, so a tied weight is one entry (saved once, loaded
  once into the one object every user holds; identity survives);
* ``optim.<name>.<key>``: the optimizer state of that weight; shard-shaped tensors (AdamW's ``exp_avg``,
  ``exp_avg_sq``) are wrapped like the weight, scalars (``step``) are saved as they are;
* ``train.step`` and ``rng.*``: the step and the RNG state. Every rank seeds and draws identically
  (the data is a function of the step), so one copy of the RNG state serves all ranks.

Beside DCP's files, ``meta.json`` holds the model config, step and world size: the cheap check that a
checkpoint fits the model before DCP runs.

[Note: checkpoints of pipeline stages]
Names are the model's, whatever holds them: a pipeline stage's parameters carry the whole model's names
(``blocks.<i>.`` global, the tied embedding / lm_head weight as ``embedding.weight`` on both stages that hold a
copy), so the state dict is the same set of entries at any pp size. ``meta.json``'s ``params`` is the union of
every rank's names, checked against the union of the loading run's. The two copies of a weight tied across
stages are the same bytes (summed gradients, the same optimizer); both write their rows and DCP keeps one
writer per row block (its planner drops duplicate writes), and both read them back at a load.

[Note: atomic save]
All ranks write into ``step_N.tmp``; after DCP's own final barrier rank 0 writes ``meta.json``, renames
``step_N.tmp`` to ``step_N`` (one ``os.rename``, atomic on POSIX filesystems), and every rank waits on a
barrier. A save killed half-way leaves only a ``.tmp`` folder, which is never resumed from and is
cleared by the next save of that step; the previous ``step_M`` is untouched. A re-save of an existing
``step_N`` moves it to ``step_N.old`` just before the rename, so a kill between the two renames loses
that step (never resumed from) and keeps the older ones. ``keep_last=K`` prunes only after the rename,
so the newest complete checkpoint exists before any older one goes; a pruned folder is first renamed
out of the ``step_N`` pattern, so a kill mid-delete leaves nothing that looks complete.
``tests/test_train_faults.py`` kills a save at each of these points and resumes.

[Note: DCP imported on use]
``torch.distributed.checkpoint`` (and the DTensor ops it pulls in) takes about a second to import on a
CPU, more than a third of the job's start-up. Every process of a job imports this module (the fault
handling resolves checkpoint folders), most never save or load, so DCP and DTensor are imported by the
functions that use them.
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
    """Wraps tensors laid out like a weight: a DTensor for a ``ShardedWeight``, the tensor otherwise."""

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
    """The full tensor of ``local``, laid out like ``like``'s shard (a weight, its ``.grad``, its optimizer
    state); collective over ``like.group`` for a ``ShardedWeight``, the tensor itself otherwise. Goes
    through DTensor, so the weights' own traffic counters do not see it."""
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
    """Saves ``model`` (and ``optimizer``) at ``step`` into ``root/step_{step}``; returns that path.

    Collective over ``group`` (None: the default group): every rank calls it with the same arguments.
    ``meta`` (JSON-serialisable; put the model config under ``"model_config"``) is stored in
    ``meta.json`` and compared by :func:`load_checkpoint`. ``keep_last=K > 0`` then deletes all but the
    newest ``K`` complete ``step_M`` folders of ``root`` (and leftovers of older interrupted saves). See
    [Note: atomic save].
    """
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
    """Deletes all but the ``keep_last`` newest complete checkpoints of ``root``, and ``.tmp``/``.old``
    leftovers of steps before ``newest``. Each goes by a rename out of the ``step_N`` pattern first, so a
    kill mid-delete leaves a ``.deleting`` folder, which the next prune removes."""
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
    """A complete checkpoint folder: ``path`` itself, or the newest ``step_N`` inside it.

    A ``step_N`` folder exists only once its save completed ([Note: atomic save]), so the newest one is taken
    or refused: a damaged one (a data file deleted or cut short) is an error naming it and the previous
    complete checkpoint to resume from instead, never a silent fall back to an older step. An interrupted save
    (``step_N.tmp``) is no checkpoint and is passed over (:func:`interrupted_saves` names it).

    Raises:
        CheckpointError: nothing complete there, or the newest checkpoint is damaged; the message says what is
            missing.
    """
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
    """The interrupted saves (``step_N.tmp``) in a folder of checkpoints newer than its newest complete one:
    what resuming passes over."""
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
    """Every parameter name of the model over ``group``, with its full shape: the union of the ranks' own
    (collective). [Note: checkpoints of pipeline stages]: a rank holding a pipeline stage holds some of the
    names; a tied weight's copies on two stages carry one name, and must agree on its shape."""
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

    Collective over ``group``. ``path`` is a checkpoint folder or a folder of ``step_N`` checkpoints (the
    latest complete one is used). Every entry of ``expect`` must equal the same key of the saved
    ``meta.json`` (pass ``{"model_config": ...}``), and parameter names and full shapes must match; both
    are checked on every rank before DCP runs (the names gathered over ``group``: a pipeline stage holds some of
    them), so a mismatch fails everywhere with one message.

    Raises:
        CheckpointError: incomplete checkpoint, or one written for another model.
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
    """Copies what DCP loaded into the weights and the optimizer state (a no-op copy where DCP filled
    the model's own storage, which ``from_local`` shares), and tells each distributed weight its master was
    written, so nothing cached from the old values survives ([Note: weight lifecycle])."""
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
