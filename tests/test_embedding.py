"""``distwgrad.nn.Embedding``, alone and tied to ``Linear``, against ``torch.nn.Embedding`` + ``F.linear``.

Tolerances: bit-exact (``torch.equal``) wherever both sides add the same terms in the same order:
* a plain weight: our backward is the same ``index_add_`` as torch's dense CPU embedding backward, and
  autograd sums the tied uses the same way on both sides;
* a ``ShardedWeight`` with *distinct* token ids: each buffer row receives one lookup term on top of the
  lm_head's wgrad, so ``lm + emb`` is the reference's sum; over 2 ranks the reduction is
  ``(a + b) / 2``, exact in fp32 (see tests/test_distributed_weights.py).
With repeated ids the sharded path adds each row's lookup terms one by one onto the lm_head's wgrad in
the shared buffer, ``((lm + e1) + e2)``, while autograd sums them first, ``lm + (e1 + e2)``; that
comparison allows 4 fp32 ulps at the gradient's magnitude (the documented exception).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.nn import Embedding, Linear
from distwgrad.testing.multiprocess import for_each_case, run_distributed

V, D = 11, 6  # 11 rows: uneven shards on 2 ranks (6, 5)


def _ulps_close(got: torch.Tensor, want: torch.Tensor, ulps: int = 4) -> bool:
    bound = ulps * torch.finfo(want.dtype).eps * want.abs().max()
    return bool((got - want).abs().max() <= bound)


def _full_weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, D, generator=torch.Generator().manual_seed(seed))


def _tied(weight: torch.Tensor):
    emb = Embedding(V, D, weight=weight)
    head = Linear(D, V, bias=False, weight=emb.weight)
    return emb, head


def _tied_loss(emb, head, ids):
    return head(emb(ids).tanh()).square().mean()


def _reference_grad(full: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    ref = torch.nn.Embedding(V, D, _weight=full.clone())  # wraps the tensor in a Parameter of its own
    F.linear(ref(ids).tanh(), ref.weight).square().mean().backward()
    return ref.weight.grad


# --- single process ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_weight_matches_torch_embedding_bit_exact(dtype):
    """fp32: torch.nn.Embedding's gradient bit for bit. bf16: its fp32 gradient rounded once to bf16
    (our lookup sums in fp32; torch's bf16 CPU backward rounds along the way, so it is not the oracle)."""
    full = _full_weight()
    ids = torch.tensor([[1, 4, 4, 0], [10, 4, 2, 1]])
    ours = Embedding(V, D, weight=torch.nn.Parameter(full.clone().to(dtype)))
    ref = torch.nn.Embedding(V, D, _weight=full.clone())
    for step in range(2):  # the second backward adds onto .grad (None -> initialise, then add)
        y, y_ref = ours(ids), ref(ids)
        assert torch.equal(y, y_ref.to(dtype))
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        y.backward(dy)
        y_ref.backward(dy.float())
        assert ours.weight.grad.dtype == dtype
        if step == 0 or dtype == torch.float32:  # bf16 .grad then adds in bf16, as autograd does
            assert torch.equal(ours.weight.grad, ref.weight.grad.to(dtype))


def test_tied_plain_weight_matches_reference_bit_exact():
    full = _full_weight()
    ids = torch.tensor([[3, 3, 7, 0, 10], [1, 3, 2, 2, 9]])
    emb, head = _tied(torch.nn.Parameter(full.clone()))
    assert head.weight is emb.weight
    _tied_loss(emb, head, ids).backward()
    assert torch.equal(emb.weight.grad, _reference_grad(full, ids))


@pytest.mark.parametrize("repeated", [False, True])
def test_tied_sharded_weight_group_of_one(repeated):
    """No process group: a ShardedWeight over a group of one still does the full accounting."""
    full = _full_weight()
    ids = torch.tensor([[3, 3, 7, 0, 10], [1, 3, 2, 2, 9]]) if repeated else torch.tensor([[3, 5, 7, 0, 10]])
    w = ShardedWeight.from_full(full)
    emb, head = _tied(w)
    assert head.weight is emb.weight is w
    loss = _tied_loss(emb, head, ids)
    assert w.pending_contributions == 2  # one per use of the tied weight
    loss.backward()
    assert w.pending_contributions == 0
    assert distwgrad.finalize_model_grads([torch.nn.ModuleList([emb, head])]) == 1  # one weight, once
    want = _reference_grad(full, ids)
    assert w.main_grad.dtype == torch.float32
    if repeated:
        assert _ulps_close(w.grad, want)
    else:
        assert torch.equal(w.grad, want)


def test_no_contribution_without_grad():
    w = ShardedWeight.from_full(_full_weight())
    emb = Embedding(V, D, weight=w)
    with torch.no_grad():
        emb(torch.tensor([1, 2]))
    assert w.pending_contributions == 0
    w.requires_grad_(False)
    y = emb(torch.tensor([1, 2]))
    assert w.pending_contributions == 0 and not y.requires_grad
    frozen = Embedding(V, D, weight=torch.nn.Parameter(_full_weight(), requires_grad=False))
    x = torch.randn(2, D, requires_grad=True)
    (frozen(torch.tensor([1, 2])) * x).sum().backward()  # backward through a frozen lookup
    assert frozen.weight.grad is None and x.grad is not None


def test_fresh_weight_and_shape_of_output():
    torch.manual_seed(0)
    emb = Embedding(V, D, params_dtype=torch.float64)
    assert emb.weight.dtype == torch.float64 and tuple(emb.weight.shape) == (V, D)
    assert emb(torch.zeros(2, 3, 4, dtype=torch.int32)).shape == (2, 3, 4, D)


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match=r"num_embeddings must be a positive int, got 0"):
        Embedding(0, D)
    with pytest.raises(ValueError, match=r"weight has full shape \(11, 5\), expected \(11, 6\)"):
        Embedding(V, D, weight=torch.zeros(V, 5))
    with pytest.raises(TypeError, match=r"ids must be an int32/int64 tensor, got torch.float32"):
        Embedding(V, D)(torch.zeros(3))


# --- two ranks -----------------------------------------------------------------------------------------

def _rank_ids(case, rank):
    if case["repeated"]:
        g = torch.Generator().manual_seed(10 + rank)
        return torch.randint(0, V, (case["microbatches"], 2, 5), generator=g)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(10 + rank))
    return perm[: 2 * case["microbatches"]].reshape(case["microbatches"], 2, 1)  # distinct in each microbatch


def _sharded_case(case, rank, world):
    full = _full_weight()
    w = ShardedWeight.from_full(full)
    emb, head = _tied(w)
    assert head.weight is emb.weight is w
    ids = _rank_ids(case, rank)
    for mb in ids:
        (_tied_loss(emb, head, mb) / len(ids)).backward()
    assert distwgrad.finalize_model_grads([torch.nn.ModuleList([emb, head])]) == 1
    # Reference: per microbatch, the ranks' gradients averaged, then summed over microbatches (the
    # weight's PER_MICROBATCH reduction order).
    want = None
    for m in range(len(ids)):
        per_rank = [_reference_grad(full, _rank_ids(case, r)[m]) / len(ids) for r in range(world)]
        reduced = (per_rank[0] + per_rank[1]) / world
        want = reduced if want is None else want + reduced
    rows = want[w.shard_offset:w.shard_offset + w.shape[0]]
    assert tuple(w.shape) == ((6, D) if rank == 0 else (5, D))
    if case["repeated"]:
        assert _ulps_close(w.grad, rows), (w.grad - rows).abs().max()
    else:
        assert torch.equal(w.grad, rows), (w.grad - rows).abs().max()
    assert w.bytes_gathered > 0 and w.bytes_reduced > 0


def _sharded_rank(rank, world, cases):
    for_each_case(cases, _sharded_case, rank, world)


@pytest.mark.distributed
def test_tied_sharded_two_ranks_matches_reference():
    cases = [dict(repeated=r, microbatches=m) for r in (False, True) for m in (1, 2)]
    run_distributed(_sharded_rank, 2, cases, timeout=120)
