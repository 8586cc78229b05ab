"""Mixed-precision distributed weights (``param_dtype``) against a plain-torch oracle; [Note: mixed precision].

The oracle keeps fp32 masters and casts them with ``w.to(torch.bfloat16)`` inside autograd, once per use
(a cast shared by two tied uses would sum their bf16 gradients in bf16; distwgrad sums every use in fp32,
as one cast per use does), computes each rank's gradients and combines them in the order the weights
reduce ([Note: contribution accounting]): per microbatch ``sum over ranks / world`` (PER_MICROBATCH), or
each rank's microbatches first, then over ranks (PER_STEP).

Tolerances. Every bf16 operation (the cast, the GEMMs, the rounding of each wgrad product) is the same
call on the same values in both, so it rounds identically: each rank's per-use gradient is bit-exact. What
is left is fp32: with 2 ranks a two-term sum is commutative and ``/2`` is exact, so everything is
bit-exact over three SGD steps. With 3 ranks gloo sums three terms in its own order and ``/3`` rounds, so
gradients allow 4 fp32 ulps at the gradient's magnitude; the oracle's masters are then re-synced from
the shards after each step, because an fp32 ulp in a master can flip its bf16 rounding and move the next
step by a bf16 ulp, which says nothing about the step under test.

Embedding ids are distinct within a microbatch: torch's bf16 embedding backward sums duplicate rows in
bf16, distwgrad sums them in fp32 (``test_embedding_sums_duplicate_rows_in_fp32`` pins that).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import distwgrad
from distwgrad import ReducePolicy, ReplicatedWeight, ShardedWeight, compute_dtype
from distwgrad.checkpoint import full_tensor
from distwgrad.fp8 import PerTensorScaling, fp8_autocast
from distwgrad.fp8.weights import materialize_quantized, quantize_weight
from distwgrad.nn import Embedding, GroupedLinear, Linear
from distwgrad.testing.multiprocess import for_each_case, run_distributed

BF16 = torch.bfloat16
K, N, E, V, D, B = 8, 7, 5, 11, 6, 8  # N=7 rows: 4+3 on 2 ranks, 3+3+1 on 3; E=5 experts: 3+2, 2+2+1
LR = 0.5
SPLITS = [[3, 0, 2, 1, 2], [1, 3, 0, 0, 4]]  # per microbatch index; a group with no tokens included


def _master(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


# --- the three models: ours and the oracle's forward on fp32 masters -------------------------------------

def _masters(case):
    if case["model"] == "linear":
        masters = {"w0": _master(N, K, seed=1), "b0": _master(N, seed=2), "w1": _master(N, N, seed=3),
                   "b1": _master(N, seed=4)}
        return masters if case["tied"] else {**masters, "w2": _master(N, N, seed=5)}
    if case["model"] == "embedding":
        return {"w": _master(V, D, seed=6)}
    if case["packed"]:
        return {"w": _master(E, N, N, seed=7), "b": _master(E, N, seed=8)}
    return {f"w{e}": _master(N, N, seed=10 + e) for e in range(E)}


def _wrap(name, t, case):
    kw = dict(reduce_policy=ReducePolicy(case["policy"]), async_reduce=case["async"], param_dtype=BF16)
    if name == "b1":  # one replicated weight among the sharded ones
        return ReplicatedWeight.from_full(t, **kw)
    return ShardedWeight.from_full(t, **kw)


def _build(case, masters):
    p = {k: _wrap(k, v, case) for k, v in masters.items()}
    kw = dict(delay_wgrad_compute=case["delay"], fuse_wgrad_accumulation=case["fuse"])
    if case["model"] == "linear":
        layers = [Linear(K, N, weight=p["w0"], bias=p["b0"], **kw), Linear(N, N, weight=p["w1"], bias=p["b1"], **kw),
                  Linear(N, N, weight=p["w1"] if case["tied"] else p["w2"], bias=False, **kw)]
        return torch.nn.ModuleList(layers), p
    if case["model"] == "embedding":
        emb = Embedding(V, D, weight=p["w"])
        head = Linear(D, V, weight=p["w"] if case["tied"] else _wrap("h", _master(V, D, seed=9), case), bias=False,
                      **kw)
        if not case["tied"]:
            p["h"] = head.weight
        return torch.nn.ModuleList([emb, head]), p
    gl = GroupedLinear(E, N, N, bias=case["packed"], params_dtype=BF16, single_grouped_weight=case["packed"], **kw)
    for name, w in p.items():
        setattr(gl, {"w": "weight", "b": "bias"}.get(name, name.replace("w", "weight")), w)
    return torch.nn.ModuleList([gl]), p


def _inputs(case, step, rank, m):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + m)
    if case["model"] == "embedding":
        return torch.randperm(V, generator=g)[:B]  # distinct ids: see the module docstring
    return torch.randn(B, K if case["model"] == "linear" else N, generator=g).to(BF16)


def _forward(case, mods, x, m):
    """Our model on one microbatch."""
    if case["model"] == "linear":
        def run(h):
            for layer in mods:
                h = layer(h)
            return h
        return checkpoint(run, x, use_reentrant=False) if case["ckpt"] else run(x)
    if case["model"] == "embedding":
        h = mods[0](x)
        assert h.dtype == BF16
        return mods[1](h)
    y = mods[0](x, SPLITS[m])
    return mods[0](y, SPLITS[m]) if case["tied"] else y


def _oracle_forward(case, P, x, m):
    """The same model in plain torch: each use casts its fp32 master with ``.to(bf16)`` inside autograd."""
    c = lambda t: t.to(BF16)  # noqa: E731
    if case["model"] == "linear":
        last = P["w1"] if case["tied"] else P["w2"]
        h = F.linear(x, c(P["w0"]), c(P["b0"]))
        return F.linear(F.linear(h, c(P["w1"]), c(P["b1"])), c(last))
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


def _loss(case, y, m):
    assert y.dtype == BF16, y.dtype
    if case["model"] == "embedding":
        return F.cross_entropy(y.float(), torch.arange(B) % V) / case["mbs"]
    return y.float().tanh().square().mean() / case["mbs"]


# --- one case: three steps of ours against the oracle --------------------------------------------------

def _fold(ts):
    out = ts[0]
    for t in ts[1:]:
        out = out + t
    return out


def _oracle_grads(case, P, step, world):
    per = [[torch.autograd.grad(_loss(case, _oracle_forward(case, P, _inputs(case, step, r, m), m), m),
                                list(P.values())) for m in range(case["mbs"])] for r in range(world)]
    total = []
    mbs = range(case["mbs"])
    for i in range(len(P)):
        if case["policy"] == "per_microbatch":  # each microbatch reduced over ranks, then summed
            total.append(_fold([_fold([per[r][m][i] for r in range(world)]) / world for m in mbs]))
        else:  # each rank's microbatches first, then one reduction
            total.append(_fold([_fold([per[r][m][i] for m in mbs]) for r in range(world)]) / world)
    return dict(zip(P, total))


def _rows(p):
    return slice(p.shard_offset, p.shard_offset + p.shape[0]) if isinstance(p, ShardedWeight) else slice(None)


def _close(ours, ref, exact):
    if exact:
        return torch.equal(ours, ref)
    return (ours - ref).abs().max() <= 4 * torch.finfo(torch.float32).eps * ref.abs().max()


def _parity_case(case, rank, world):
    masters = _masters(case)
    mods, ours = _build(case, masters)
    P = {k: torch.nn.Parameter(v.clone()) for k, v in masters.items()}
    if "h" in ours:
        P["h"] = torch.nn.Parameter(_master(V, D, seed=9))
    distinct = list({id(p): p for p in ours.values()}.values())
    opt = torch.optim.SGD(distinct, lr=LR)
    # PER_STEP folds a tied weight's uses across microbatches into one buffer ((a0 + b0) + a1) + b1, where
    # autograd gives the oracle (a0 + b0) + (a1 + b1): fp32 associativity, so the 3-rank tolerance applies.
    exact = world == 2 and not (case["tied"] and case["policy"] == "per_step" and case["mbs"] > 1)
    for step in range(3):
        if not exact:  # re-sync the oracle's masters (module docstring)
            with torch.no_grad():
                for k in P:
                    P[k].copy_(full_tensor(ours[k].detach(), ours[k]))
        ref = _oracle_grads(case, P, step, world)
        for m in range(case["mbs"]):
            _loss(case, _forward(case, mods, _inputs(case, step, rank, m), m), m).backward()
            if case["delay"]:
                distwgrad.drain_deferred_wgrads(mods)
        distwgrad.finalize_model_grads([mods])
        for k, p in ours.items():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32 and p.main_grad.dtype == torch.float32
            assert p.grad.shape == p.shape == p.main_grad.shape, (k, p.grad.shape, p.shape)
            assert _close(p.grad, ref[k][_rows(p)], exact), (k, step, (p.grad - ref[k][_rows(p)]).abs().max())
        before = {id(p): p.detach().clone() for p in distinct}
        opt.step()
        for p in distinct:  # the fp32 shard moved by exactly -lr * grad (no bf16 rounding of the master)
            assert torch.equal(p.detach(), before[id(p)].add(p.grad, alpha=-LR))
        opt.zero_grad()
        with torch.no_grad():
            for k in P:
                P[k].add_(ref[k], alpha=-LR)
    return True


def _bytes_case(case, rank, world):
    """The gather moves bf16 bytes, counted in bytes_gathered, and gathers exactly the bf16 cast."""
    full = _master(N, K, seed=0)
    w = ShardedWeight.from_full(full, param_dtype=BF16)
    w32 = ShardedWeight.from_full(full)
    (g,) = w.materialize_group_for_forward()
    (g32,) = w32.materialize_group_for_backward()
    assert g.dtype == BF16 and torch.equal(g, full.to(BF16)) and torch.equal(g32, full)
    assert w.bytes_gathered == world * max(w.shard_rows) * K * 2
    assert w.bytes_gathered <= 0.55 * w32.bytes_gathered
    assert w.dtype == torch.float32 and w.grad_buffer().dtype == torch.float32
    return True


def _fp8_case(case, rank, world):
    """Under an FP8 recipe the weight is quantized from the fp32 master: the same bytes as quantizing the
    full fp32 weight directly (one rounding, never bf16 then FP8); the GEMM output is the input's bf16."""
    full = _master(N, K, seed=0) * 37.0
    w = ShardedWeight.from_full(full, param_dtype=BF16)
    recipe = PerTensorScaling()
    (q,) = materialize_quantized(w, recipe, backward=False)
    (want,) = quantize_weight(full, recipe)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scale_inv, want.scale_inv)
    lin = Linear(K, N, weight=w, bias=False)
    with fp8_autocast(recipe):
        y = lin(_inputs(dict(model="linear"), 0, rank, 0))
    assert y.dtype == BF16
    y.float().square().sum().backward()
    distwgrad.finalize_model_grads([lin])
    assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape
    return True


_BODIES = {"parity": _parity_case, "bytes": _bytes_case, "fp8": _fp8_case}


def _rank(rank, world, cases):
    return for_each_case(cases, lambda c, r, w: _BODIES[c["kind"]](c, r, w), rank, world)


def _cases(world):
    base = dict(kind="parity", fuse=False, policy="per_microbatch", ckpt=False, packed=False)
    cases = [dict(kind="bytes"), dict(kind="fp8")]
    for delay, asy, tied, mbs in itertools.product([False, True], [False, True], [False, True], [1, 2]):
        policy = "per_step" if (asy and mbs == 2) else "per_microbatch"
        cases.append({**base, "model": "linear", "delay": delay, "async": asy, "tied": tied, "mbs": mbs,
                      "policy": policy, "fuse": delay and not tied, "ckpt": tied and not delay})
    for packed, delay, tied in itertools.product([False, True], [False, True], [False, True]):
        cases.append({**base, "model": "grouped", "packed": packed, "delay": delay, "async": delay, "tied": tied,
                      "mbs": 2, "policy": "per_step" if packed and not delay else "per_microbatch"})
    for tied, delay in itertools.product([False, True], [False, True]):
        cases.append({**base, "model": "embedding", "tied": tied, "delay": delay, "async": False, "mbs": 2})
    return cases if world == 2 else [c for c in cases if c["kind"] != "parity" or c["mbs"] == 2]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_mixed_precision_matches_the_bf16_oracle(world):
    cases = _cases(world)
    assert all(run_distributed(_rank, world, cases, timeout=300))


# --- single process ------------------------------------------------------------------------------------

def test_one_rank_gathers_a_cast_copy_never_the_master():
    w = ShardedWeight.from_full(torch.randn(4, 3), param_dtype=BF16)
    (g,) = w.materialize_group_for_forward()
    assert g.dtype == BF16 and g.data_ptr() != w.data_ptr() and torch.equal(g, w.detach().to(BF16))
    assert w.param_dtype == BF16 and compute_dtype(w) == BF16 and w.dtype == torch.float32
    assert compute_dtype(torch.zeros(1, dtype=torch.float16)) == torch.float16
    assert ShardedWeight.from_full(torch.randn(4, 3)).param_dtype is None


def test_embedding_sums_duplicate_rows_in_fp32():
    w = ShardedWeight.from_full(torch.randn(5, 3), param_dtype=BF16)
    emb = Embedding(5, 3, weight=w)
    ids = torch.tensor([0, 0, 0, 1, 1, 2] * 50)
    dy = torch.randn(300, 3).to(BF16)
    y = emb(ids)
    assert y.dtype == BF16
    y.backward(dy)
    distwgrad.finalize_model_grads([emb])
    assert torch.equal(w.grad, torch.zeros(5, 3).index_add_(0, ids, dy.float()))


def test_bad_param_dtype_and_dtype_disagreements_raise_naming_the_values():
    t = torch.randn(4, 3)
    for bad in (torch.int32, torch.float8_e4m3fn, "bf16"):
        for make in (ShardedWeight.from_full, ShardedWeight.from_shard, ReplicatedWeight.from_full):
            with pytest.raises(TypeError, match=f"param_dtype must be None or one of .*got {bad!r}"):
                make(t, param_dtype=bad)
    with pytest.raises(ValueError, match="param_dtype=torch.float32 is wider than the weight's dtype torch.bfloat16"):
        ShardedWeight.from_full(t.to(BF16), param_dtype=torch.float32)
    w = ShardedWeight.from_full(torch.randn(4, 3), param_dtype=BF16)
    with pytest.raises(TypeError, match="input dtype torch.float32 does not match the weight dtype torch.bfloat16"):
        Linear(3, 4, weight=w, bias=False)(torch.randn(2, 3))
    with pytest.raises(TypeError, match=r"different dtypes \{'weight': 'torch.bfloat16', 'bias': 'torch.float32'\}"):
        Linear(3, 4, weight=w, bias=torch.zeros(4))
    assert Linear(3, 4, weight=w).bias.dtype == BF16  # a fresh bias takes the weight's compute dtype
    with pytest.raises(TypeError, match="built with params_dtype=torch.float32, but its weight computes in "
                                        "torch.bfloat16"):
        Linear(3, 4, weight=w, bias=False, params_dtype=torch.float32)
    with pytest.raises(TypeError, match="built with params_dtype=torch.float16, but its weight computes in "
                                        "torch.bfloat16"):
        Embedding(4, 3, weight=w, params_dtype=torch.float16)
    gl = GroupedLinear(2, 3, 4, bias=False, params_dtype=torch.float32)
    gl.weight0 = ShardedWeight.from_full(torch.randn(4, 3), param_dtype=BF16)
    with pytest.raises(TypeError, match="different dtypes"):
        gl(torch.randn(2, 3, dtype=BF16), [1, 1])
    gl.weight1 = ShardedWeight.from_full(torch.randn(4, 3), param_dtype=BF16)
    with pytest.raises(TypeError, match="built with params_dtype=torch.float32"):
        gl(torch.randn(2, 3, dtype=BF16), [1, 1])


# --- checkpoints: the fp32 master is saved, and a bf16-compute run resumes bit-exactly -------------------

def _ckpt_model(seed):
    w0 = ShardedWeight.from_full(_master(N, K, seed=seed), param_dtype=BF16)
    w1 = ShardedWeight.from_full(_master(N, N, seed=seed + 1), param_dtype=BF16, async_reduce=True)
    b1 = ReplicatedWeight.from_full(_master(N, seed=seed + 2), param_dtype=BF16)
    return torch.nn.Sequential(Linear(K, N, weight=w0, bias=False), Linear(N, N, weight=w1, bias=b1),
                               Linear(N, N, weight=w1, bias=False, delay_wgrad_compute=True))


def _train(model, opt, steps, rank):
    for step in steps:
        for m in range(2):
            _loss(dict(model="linear", mbs=2), model(_inputs(dict(model="linear"), step, rank, m)), m).backward()
            distwgrad.drain_deferred_wgrads(model)
        distwgrad.finalize_model_grads([model])
        opt.step()
        opt.zero_grad()


def _checkpoint_rank(rank, world, root):
    import torch.distributed.checkpoint as dcp

    from distwgrad.checkpoint import load_checkpoint, save_checkpoint
    straight = _ckpt_model(seed=20)
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    _train(straight, opt, range(4), rank)
    first = _ckpt_model(seed=20)
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _train(first, opt, range(2), rank)
    path = save_checkpoint(root, 2, first, opt)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert {saved[f"model.{n}"].properties.dtype for n, _ in first.named_parameters()} == {torch.float32}
    resumed = _ckpt_model(seed=40)  # other values: everything must come from the checkpoint
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    _train(resumed, opt, range(1), rank)  # so the optimizer has state to overwrite
    assert load_checkpoint(path, resumed, opt) == 2
    assert resumed[1].weight is resumed[2].weight and resumed[1].weight.param_dtype == BF16
    _train(resumed, opt, range(2, 4), rank)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a.detach(), b.detach()), name
    return True


@pytest.mark.distributed
def test_bf16_compute_checkpoint_saves_fp32_masters_and_resumes_bit_exactly(tmp_path):
    assert all(run_distributed(_checkpoint_rank, 2, str(tmp_path), timeout=300))
