"""Weights on a ``DeviceMesh`` (gloo, 4 ranks as a 2 x 2 (replicate, shard) mesh) against a plain-torch oracle.

[Note: device meshes] in ``weights/sharded.py``. The oracle keeps the full fp32 weights and runs plain
torch (``F.linear``, ``F.embedding``; with ``param_dtype`` each use casts its master with ``.to(bf16)``
inside autograd) on the whole global batch: every rank's slice, each slice's gradient on its own; the
sharded gradient is their mean over all 4 ranks, combined in the order the weights reduce. On the mesh
``[[0, 1], [2, 3]]`` a shard is reduce-scattered over its shard group (ranks 0+1, 2+3) and then
all-reduced across replicas, so the oracle sums ``((g0 + g1) + (g2 + g3)) / 4`` per microbatch
(PER_MICROBATCH) or each rank's microbatches first (PER_STEP).

Tolerances. Two-term fp32 sums are commutative and ``/4`` is exact, so a sharded weight's gradient is
bit-exact (each rank's per-use gradient is the same call on the same values in both; see
``tests/test_mixed_precision.py``). Two cases are not: a ``ReplicatedWeight`` on a 2-D mesh is one
all-reduce over the 4 ranks, and gloo sums four terms in its own order; and PER_STEP folds a tied
weight's uses across microbatches into one buffer ``((a0 + b0) + a1) + b1`` where autograd gives the
oracle ``(a0 + b0) + (a1 + b1)``. Those allow 4 fp32 ulps at the gradient's magnitude (the 3-rank
bound of ``tests/test_distributed_weights.py``). The oracle's masters are re-synced from the shards
before each step, so a last-ulp difference never compounds into the next step's bf16 rounding; each
step checks that the fp32 shard moved by exactly ``-lr * grad``.

Checkpoints: a 2 x 2 mesh saves (AdamW state included); 2 ranks (a 1-D group) load it and save again;
the 2 x 2 mesh loads that; a fresh 2-rank world and one process load the first one: the full weights
and optimizer state are bit-identical everywhere (DCP moves bytes).
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import distwgrad
from distwgrad import ReducePolicy, ReplicatedWeight, ShardedWeight
from distwgrad.checkpoint import full_tensor, load_checkpoint, save_checkpoint
from distwgrad.fp8 import PerTensorScaling, fp8_autocast
from distwgrad.fp8.weights import materialize_quantized, quantize_weight
from distwgrad.nn import Embedding, GroupedLinear, Linear
from distwgrad.testing import sweep
from distwgrad.testing.multiprocess import for_each_case, run_distributed

pytestmark = pytest.mark.distributed

BF16, F32 = torch.bfloat16, torch.float32
K, N, E, V, D, B = 8, 7, 3, 11, 6, 8  # N=7 rows: 4 + 3 per shard group; the head's 1 row: 1 + 0 (empty)
LR = 0.5
SPLITS = [[3, 0, 5], [1, 4, 3]]  # tokens per expert, per microbatch; an expert with no tokens included
ULPS = 4 * torch.finfo(torch.float32).eps


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _master(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


# --- the models: ours on the mesh and the oracle on full fp32 masters ------------------------------------

def _masters(case):
    if case["model"] == "linear":
        masters = {"w0": _master(N, K, seed=1), "b0": _master(N, seed=2), "w1": _master(N, N, seed=3),
                   "b1": _master(N, seed=4), "head": _master(1, N, seed=5)}
        return masters if case["tied"] else {**masters, "w2": _master(N, N, seed=6)}
    if case["model"] == "embedding":
        masters = {"w": _master(V, D, seed=7)}
        return masters if case["tied"] else {**masters, "h": _master(V, D, seed=8)}
    if case["packed"]:
        return {"w": _master(E, N, N, seed=9), "b": _master(E, N, seed=10)}
    return {f"w{e}": _master(N, N, seed=11 + e) for e in range(E)}


def _wrap(name, t, case, mesh):
    kw = dict(mesh=mesh, reduce_policy=ReducePolicy(case["policy"]), async_reduce=case["async"],
              param_dtype=case["dtype"] if case["dtype"] is BF16 else None)
    if name == "b0":  # one replicated weight: all-reduced over the whole mesh
        return ReplicatedWeight.from_full(t, **kw)
    return ShardedWeight.from_full(t, **kw)


def _build(case, masters, mesh):
    p = {k: _wrap(k, v, case, mesh) for k, v in masters.items()}
    kw = dict(delay_wgrad_compute=case["delay"])
    if case["model"] == "linear":
        last = p["w1"] if case["tied"] else p["w2"]
        return torch.nn.ModuleList([Linear(K, N, weight=p["w0"], bias=p["b0"], **kw),
                                    Linear(N, N, weight=p["w1"], bias=p["b1"], **kw),
                                    Linear(N, N, weight=last, bias=p["b1"] if case["tied"] else False, **kw),
                                    Linear(N, 1, weight=p["head"], bias=False, **kw)]), p
    if case["model"] == "embedding":
        head = Linear(D, V, weight=p["w"] if case["tied"] else p["h"], bias=False, **kw)
        return torch.nn.ModuleList([Embedding(V, D, weight=p["w"]), head]), p
    gl = GroupedLinear(E, N, N, bias=case["packed"], params_dtype=case["dtype"],
                       single_grouped_weight=case["packed"], **kw)
    for name, w in p.items():
        setattr(gl, {"w": "weight", "b": "bias"}.get(name, name.replace("w", "weight")), w)
    return torch.nn.ModuleList([gl]), p


def _inputs(case, step, rank, m):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + m)
    if case["model"] == "embedding":
        return torch.randperm(V, generator=g)[:B]  # distinct ids: tests/test_mixed_precision.py says why
    return torch.randn(B, K if case["model"] == "linear" else N, generator=g).to(case["dtype"])


def _forward(case, mods, x, m):
    if case["model"] == "linear":
        for layer in mods:
            x = layer(x)
        return x
    if case["model"] == "embedding":
        return mods[1](mods[0](x))
    y = mods[0](x, SPLITS[m])
    return mods[0](y, SPLITS[m]) if case["tied"] else y


def _oracle_forward(case, P, x, m):
    c = lambda t: t.to(case["dtype"])  # noqa: E731  (fp32: the master itself)
    if case["model"] == "linear":
        last = P["w1"] if case["tied"] else P["w2"]
        h = F.linear(F.linear(x, c(P["w0"]), c(P["b0"])), c(P["w1"]), c(P["b1"]))
        h = F.linear(h, c(last), c(P["b1"]) if case["tied"] else None)
        return F.linear(h, c(P["head"]))
    if case["model"] == "embedding":
        return F.linear(F.embedding(x, c(P["w"])), c(P["w"] if case["tied"] else P["h"]))

    def experts(h):
        out, start = [], 0
        for e, n in enumerate(SPLITS[m]):
            w = P["w"][e] if case["packed"] else P[f"w{e}"]
            out.append(F.linear(h[start:start + n], c(w), c(P["b"][e]) if case["packed"] else None))
            start += n
        return torch.cat(out)
    y = experts(x)
    return experts(y) if case["tied"] else y


def _loss(case, y):
    if case["model"] == "embedding":
        return F.cross_entropy(y.float(), torch.arange(B) % V) / case["mbs"]
    return y.float().tanh().square().mean() / case["mbs"]


def _fold(ts):
    out = ts[0]
    for t in ts[1:]:
        out = out + t
    return out


def _mesh_sum(ts):
    """The 2 x 2 mesh's order: reduce-scatter over shard groups {0, 1} and {2, 3}, then across replicas."""
    return (ts[0] + ts[1]) + (ts[2] + ts[3])


def _oracle_grads(case, P, step, world):
    per = [[torch.autograd.grad(_loss(case, _oracle_forward(case, P, _inputs(case, step, r, m), m)), list(P.values()))
            for m in range(case["mbs"])] for r in range(world)]
    out, mbs = {}, range(case["mbs"])
    for i, k in enumerate(P):
        if case["policy"] == "per_microbatch":
            out[k] = _fold([_mesh_sum([per[r][m][i] for r in range(world)]) / world for m in mbs])
        else:
            out[k] = _mesh_sum([_fold([per[r][m][i] for m in mbs]) for r in range(world)]) / world
    return out


def _rows(p):
    return slice(p.shard_offset, p.shard_offset + p.shape[0]) if isinstance(p, ShardedWeight) else slice(None)


def _parity_case(case, rank, world):
    mesh = _mesh()
    masters = _masters(case)
    mods, ours = _build(case, masters, mesh)
    P = {k: torch.nn.Parameter(v.clone()) for k, v in masters.items()}
    distinct = list({id(p): p for p in ours.values()}.values())
    opt = torch.optim.SGD(distinct, lr=LR)
    assert all(p.dp_size == 4 for p in distinct)
    if case["model"] == "linear":
        assert ours["head"].shape[0] == [1, 0, 1, 0][rank]  # the shard dim's second rank holds no rows
        assert ours["w1"].shard_rows == [4, 3] and mods[1].weight is ours["w1"]
        if case["tied"]:
            assert mods[2].weight is mods[1].weight
    fold_tied = case["tied"] and case["policy"] == "per_step" and case["mbs"] > 1
    for step in range(3):
        with torch.no_grad():  # re-sync the oracle's masters (module docstring)
            for k in P:
                P[k].copy_(full_tensor(ours[k].detach(), ours[k]))
        ref = _oracle_grads(case, P, step, world)
        for m in range(case["mbs"]):
            _loss(case, _forward(case, mods, _inputs(case, step, rank, m), m)).backward()
            if case["delay"]:
                distwgrad.drain_deferred_wgrads(mods)
        assert distwgrad.finalize_model_grads([mods]) == len(distinct)
        for k, p in ours.items():
            want, got = ref[k][_rows(p)], p.grad
            assert got.dtype == F32 and got.shape == p.shape == p.main_grad.shape, (k, got.shape, p.shape)
            if (isinstance(p, ReplicatedWeight) or fold_tied) and want.numel():
                assert (got - want).abs().max() <= ULPS * want.abs().max(), (k, step, (got - want).abs().max())
            else:
                assert torch.equal(got, want), (k, step, got - want)
        before = {id(p): p.detach().clone() for p in distinct}
        opt.step()
        for p in distinct:
            assert torch.equal(p.detach(), before[id(p)].add(p.grad, alpha=-LR))
        opt.zero_grad(set_to_none=step % 2 == 0)
    return True


def _parity_cases():
    base = dict(kind="parity", packed=False)
    cases = []
    for dtype, tied, delay, asy in itertools.product([F32, BF16], [False, True], [False, True], [False, True]):
        for mbs, policy in ((1, "per_microbatch"), (2, "per_microbatch"), (2, "per_step")):
            if (mbs, policy) == (1, "per_microbatch") and (delay or asy):
                continue
            cases.append({**base, "model": "linear", "dtype": dtype, "tied": tied, "delay": delay, "async": asy,
                          "mbs": mbs, "policy": policy})
    cases = sweep.sample(cases, 16)  # of the linear model's 36 (all with --full)
    for packed, tied, dtype in itertools.product([False, True], [False, True], [F32, BF16]):
        policy = "per_step" if packed and not tied else "per_microbatch"
        cases.append({**base, "model": "grouped", "packed": packed, "tied": tied, "dtype": dtype, "mbs": 2,
                      "delay": tied, "async": packed, "policy": policy})
    for tied, dtype in itertools.product([False, True], [F32, BF16]):
        cases.append({**base, "model": "embedding", "tied": tied, "dtype": dtype, "mbs": 2, "delay": tied,
                      "async": not tied, "policy": "per_microbatch"})
    return cases


# --- a 1-D mesh is its group; degenerate 2-D meshes -------------------------------------------------------

def _train(make, steps=2, async_reduce=False):
    """A tied three-layer model built with ``make(tensor, **kw)``; returns its weights after ``steps``."""
    w0, w1, b1 = (make(_master(N, K, seed=1)), make(_master(N, N, seed=2)), make(_master(N, seed=3)))
    model = torch.nn.Sequential(Linear(K, N, weight=w0, bias=False), Linear(N, N, weight=w1, bias=b1),
                                Linear(N, N, weight=w1, bias=b1))
    opt = torch.optim.SGD([w0, w1, b1], lr=LR)
    rank = dist.get_rank()
    for step in range(steps):
        for m in range(2):
            x = torch.randn(B, K, generator=torch.Generator().manual_seed(100 * step + 10 * rank + m))
            model(x).tanh().square().mean().backward()
        distwgrad.finalize_model_grads([model])
        grads = [p.grad.clone() for p in (w0, w1, b1)]
        opt.step()
        opt.zero_grad()
    weights = (w0, w1, b1)
    return grads, [p.detach().clone() for p in weights], [(p.bytes_gathered, p.bytes_reduced) for p in weights]


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1])), "gradients or weights differ"
    assert a[2] == b[2], (a[2], b[2])


def _one_d_case(case, rank, world):
    """A 1-D mesh, the whole world or a slice of the 2-D mesh, equals passing its group: bit-exact."""
    flat = init_device_mesh("cpu", (world,))
    for mesh in (flat, _mesh()["shard"]):
        for cls in (ShardedWeight, ReplicatedWeight):
            by_mesh = _train(lambda t, m=mesh, c=cls: c.from_full(t, mesh=m, async_reduce=case["async"]))
            by_group = _train(lambda t, m=mesh, c=cls: c.from_full(t, group=m.get_group(), async_reduce=case["async"]))
            _same(by_mesh, by_group)
    return True


def _degenerate_case(case, rank, world):
    """(4, 1): a shard group of one with 4 replicas still all-reduces ([Note: a group of one]), as a
    ReplicatedWeight over the world does (the same collective on the same values: bit-exact). (1, 4): one
    replica is the 1-D mesh of 4 ranks."""
    replicas = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    w = ShardedWeight.from_full(torch.zeros(3, 2), mesh=replicas)
    assert w.shape == (3, 2) and not w._solo and w.dp_size == world
    w.expect_contribution()
    w.grad_buffer().fill_(float(rank))
    assert w.grad_buffer() is not getattr(w, "main_grad", None)
    w.finalize_group_grads([w.grad_buffer()])
    assert torch.equal(w.main_grad, torch.full((3, 2), sum(range(world)) / world))
    assert w.bytes_reduced == 3 * 2 * 4
    _same(_train(lambda t: ShardedWeight.from_full(t, mesh=replicas, async_reduce=case["async"])),
          _train(lambda t: ReplicatedWeight.from_full(t, async_reduce=case["async"])))
    one = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    a = _train(lambda t: ShardedWeight.from_full(t, mesh=one))
    b = _train(lambda t: ShardedWeight.from_full(t, mesh=init_device_mesh("cpu", (world,))))
    assert all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))
    return True


# --- collectives, bytes, token scaling, FP8, errors ----------------------------------------------------------

def _bytes_case(case, rank, world):
    """Gathers stay in the shard group; the reduction counts the reduce-scatter's input and the all-reduce."""
    mesh = _mesh()
    w = ShardedWeight.from_full(_master(N, K, seed=0), mesh=mesh)
    assert w.group is mesh.get_group("shard") and w.replicate_group is mesh.get_group("replicate")
    twin = copy.deepcopy(w)  # groups and meshes are shared handles, not data
    assert twin.mesh is w.mesh and twin.replicate_group is w.replicate_group and twin.group is w.group
    assert torch.equal(w.materialize_group_for_forward()[0], _master(N, K, seed=0))
    assert w.bytes_gathered == 2 * 4 * K * 4  # two padded 4-row shards of fp32
    w.expect_contribution()
    w.finalize_group_grads([torch.ones(N, K)])
    assert w.bytes_reduced == 2 * 4 * K * 4 + 4 * K * 4  # reduce-scatter input + the padded shard all-reduced
    assert torch.equal(w.main_grad, torch.ones(w.shape))
    r = ReplicatedWeight.from_full(torch.zeros(5), mesh=mesh)
    assert dist.get_process_group_ranks(r.group) == [0, 1, 2, 3] and r.replicate_group is None
    return True


def _token_scaling_case(case, rank, world):
    """num_tokens: the sum of per-token gradients over all 4 ranks over the 4 ranks' tokens, for both kinds."""
    mesh = _mesh()
    weights = [ShardedWeight.from_full(torch.zeros(4, 1), mesh=mesh),
               ReplicatedWeight.from_full(torch.zeros(2), mesh=mesh)]
    for w in weights:
        w.expect_contribution()
        w.grad_buffer().fill_(float(rank + 1))
        w.finalize_group_grads([w.grad_buffer()])
    distwgrad.finalize_model_grads([torch.nn.ParameterList(weights)], num_tokens=rank + 1)  # 10 tokens
    for w in weights:  # Megatron's (1 + 2 + 3 + 4) / 10, as the same fp32 operations: average, * ranks / tokens
        assert torch.equal(w.grad, torch.full_like(w.grad, 10 / 4).mul_(4 / 10)), w.grad
    return True


def _fp8_case(case, rank, world):
    """FP8 gathers and amaxes use the shard group: the same bytes as quantizing the full weight."""
    full = _master(N, K, seed=0) * 37.0
    w = ShardedWeight.from_full(full, mesh=_mesh(), param_dtype=BF16)
    recipe = PerTensorScaling()
    (q,) = materialize_quantized(w, recipe, backward=False)
    (want,) = quantize_weight(full, recipe)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scale_inv, want.scale_inv)
    assert w.bytes_gathered == 2 * 4 * K  # two padded 4-row FP8 shards: one byte each
    lin = Linear(K, N, weight=w, bias=False)
    with fp8_autocast(recipe):
        y = lin(_master(B, K, seed=rank).to(BF16))
    y.float().square().sum().backward()
    distwgrad.finalize_model_grads([lin])
    assert w.grad.dtype == F32 and w.grad.shape == w.shape
    return True


def _errors_case(case, rank, world):
    mesh = _mesh()
    with pytest.raises(ValueError, match=r"pass group or mesh, not both.*group=.*mesh="):
        ShardedWeight.from_full(torch.zeros(4, 2), group=dist.group.WORLD, mesh=mesh)
    with pytest.raises(ValueError, match=r"ReplicatedWeight.from_full: pass group or mesh, not both"):
        ReplicatedWeight.from_full(torch.zeros(4), group=dist.group.WORLD, mesh=mesh)
    with pytest.raises(ValueError, match=r"1-D \(shard\) or 2-D \(replicate, shard\), got a 3-D mesh"):
        ShardedWeight.from_shard(torch.zeros(1, 2), mesh=init_device_mesh("cpu", (1, 2, 2)))
    with pytest.raises(TypeError, match=r"mesh must be a torch.distributed.DeviceMesh, got ProcessGroup"):
        ShardedWeight.from_full(torch.zeros(4, 2), mesh=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"a 2-D mesh needs mesh_dim_names"):
        ReplicatedWeight.from_full(torch.zeros(4), mesh=init_device_mesh("cpu", (2, 2)))
    with pytest.raises(ValueError, match=r"replicas disagree on the shard"):
        ShardedWeight.from_shard(torch.zeros(2 + (rank >= 2), 3), mesh=mesh)
    return True


# --- checkpoints: 2 x 2 -> 2 -> 2 x 2, and 2 x 2 -> 1, 2, 4 ---------------------------------------------

def _ckpt_model(make_sharded, make_replicated):
    emb = Embedding(V, D, weight=make_sharded(_master(V, D, seed=1)))
    mid = Linear(D, 1, weight=make_sharded(_master(1, D, seed=2)), bias=make_replicated(_master(1, seed=3)))
    head = Linear(D, V, weight=emb.weight, bias=False)
    model = torch.nn.ModuleDict({"emb": emb, "mid": mid, "head": head})
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _ckpt_step(model, opt, seed):
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:B]
    h = model["emb"](ids)
    (model["head"](h).square().mean() + model["mid"](h).square().mean()).backward()
    distwgrad.finalize_model_grads([model])
    opt.step()
    opt.zero_grad()


def _full_state(model, opt):
    """Every full weight and optimizer-state tensor by name (collective for sharded weights)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full_tensor(p.detach(), p)
        for key, value in sorted(opt.state[p].items()):
            out[f"{name}.{key}"] = full_tensor(value, p) if value.dim() else value.clone()
    return out


def _check_loaded(model, state, path, group=None):
    mod, opt = model
    load_checkpoint(path, mod, opt, group=group)
    assert mod["head"].weight is mod["emb"].weight  # still tied: one object
    got = _full_state(mod, opt)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state), \
        [k for k in state if not torch.equal(got.get(k, torch.empty(0)), state[k])]


def _ckpt_case(case, rank, world):
    root = case["root"]
    mesh = _mesh()
    on_mesh = lambda t: ShardedWeight.from_full(t, mesh=mesh)  # noqa: E731
    model, opt = _ckpt_model(on_mesh, lambda t: ReplicatedWeight.from_full(t, mesh=mesh))
    assert model["emb"].weight.shard_rows == [6, 5]
    for step in range(2):
        _ckpt_step(model, opt, seed=step)
    saved = _full_state(model, opt)
    save_checkpoint(os.path.join(root, "mesh"), 2, model, opt)
    fresh = _ckpt_model(on_mesh, lambda t: ReplicatedWeight.from_full(t, mesh=mesh))
    _check_loaded(fresh, saved, os.path.join(root, "mesh"))  # 2 x 2 -> 2 x 2
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 load on it as a 2-rank world
    resaved = None
    if rank < 2:
        two = _ckpt_model(lambda t: ShardedWeight.from_full(t, group=pair),
                          lambda t: ReplicatedWeight.from_full(t, group=pair))
        _check_loaded(two, saved, os.path.join(root, "mesh"), group=pair)  # 2 x 2 -> 2
        _ckpt_step(*two, seed=7)
        resaved = _full_state(*two)
        save_checkpoint(os.path.join(root, "pair"), 3, *two, group=pair)
    resaved = [resaved]
    dist.broadcast_object_list(resaved, src=0)
    back = _ckpt_model(on_mesh, lambda t: ReplicatedWeight.from_full(t, mesh=mesh))
    _check_loaded(back, resaved[0], os.path.join(root, "pair"))  # 2 -> 2 x 2
    return saved


def _ckpt_load_rank(rank, world, path, saved):
    _check_loaded(_ckpt_model(ShardedWeight.from_full, ReplicatedWeight.from_full), saved, path)
    return True


_BODIES = {"parity": _parity_case, "one_d": _one_d_case, "degenerate": _degenerate_case, "bytes": _bytes_case,
           "tokens": _token_scaling_case, "fp8": _fp8_case, "errors": _errors_case, "ckpt": _ckpt_case}


def _rank(rank, world, cases):
    return for_each_case(cases, lambda c, r, w: _BODIES[c["kind"]](c, r, w), rank, world)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One 4-rank spawn for the whole file: every case, then the checkpoint chain."""
    root = str(tmp_path_factory.mktemp("mesh-ckpt"))
    cases = _parity_cases() + [dict(kind="one_d", **{"async": a}) for a in (False, True)]
    cases += [dict(kind="degenerate", **{"async": True}), dict(kind="bytes"), dict(kind="tokens"), dict(kind="fp8"),
              dict(kind="errors"), dict(kind="ckpt", root=root)]
    results = run_distributed(_rank, 4, cases, timeout=600)
    return cases, results, root


def test_two_by_two_mesh_matches_the_oracle(four_ranks):
    cases, results, _ = four_ranks
    assert len(cases) >= 28 and all(r[:-1] == [True] * (len(cases) - 1) for r in results)


def test_checkpoint_reshards_from_a_two_by_two_mesh(four_ranks):
    """2 x 2 -> 2 x 2 and 2 x 2 -> 2 -> 2 x 2 ran in the spawn; here 2 x 2 -> a fresh 2-rank world and
    -> one process without a process group."""
    _, results, root = four_ranks
    saved = results[0][-1]
    assert all(all(torch.equal(r[-1][k], saved[k]) for k in saved) for r in results)  # replicas agree
    path = os.path.join(root, "mesh")
    assert run_distributed(_ckpt_load_rank, 2, path, saved, timeout=300) == [True, True]
    assert _ckpt_load_rank(0, 1, path, saved)
