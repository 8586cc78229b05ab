"""Plain parameters at finalize ([Note: plain parameters at finalize] in ``distwgrad/wgrad/plain.py``), on gloo
ranks: which group each one averages over, the opt-out, the token scaling, a second finalize, and the refusal
when the group is ambiguous. The averages are checked against the mean of every rank's own gradient (fp32,
two or four ranks: the sums are exact in any order for the integers used here).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.nn import Linear
from distwgrad.testing.multiprocess import for_each_case, run_distributed


def _grads_of_every_rank(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _model(group=None) -> nn.Module:
    """A Linear on a ShardedWeight (its fresh bias beside it) and a plain scale after it."""
    torch.manual_seed(0)
    fc = Linear(4, 4, weight=ShardedWeight.from_full(torch.ones(4, 4), group=group))
    return nn.ModuleDict({"fc": fc, "norm": nn.LayerNorm(4)})


def _step(model: nn.Module, rank: int) -> None:
    x = torch.full((2, 4), float(rank + 1))  # integer-valued: sums and means are exact
    model["norm"](model["fc"](x)).sum().backward()


def _own_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if not isinstance(p, ShardedWeight)}


def _averaged(rank, world) -> None:
    """Default: every plain parameter averages over the weights' group; a second finalize changes nothing;
    ``reduce_plain_params=False`` leaves each rank its own gradient."""
    model, mine = _model(), _model()
    _step(model, rank)
    _step(mine, rank)
    own = _own_grads(mine)
    distwgrad.finalize_model_grads(model)
    for n, p in model.named_parameters():
        if isinstance(p, ShardedWeight):
            continue
        want = torch.stack(_grads_of_every_rank(own[n])).mean(0)
        assert torch.equal(p.grad, want), n
        kept = p.grad.clone()
        distwgrad.finalize_model_grads(model)
        assert torch.equal(p.grad, kept), f"{n}: a second finalize averaged again"
    distwgrad.finalize_model_grads(mine, reduce_plain_params=False)
    assert all(torch.equal(p.grad, own[n]) for n, p in mine.named_parameters() if n in own)


def _tokens(rank, world) -> None:
    """With ``num_tokens`` plain gradients are scaled as the weights are: sum over ranks / total tokens."""
    model, mine = _model(), _model()
    _step(model, rank)
    _step(mine, rank)
    own = _own_grads(mine)
    tokens = rank + 1
    distwgrad.finalize_model_grads(model, num_tokens=tokens)
    total = sum(range(1, world + 1))
    for n, p in model.named_parameters():
        if not isinstance(p, ShardedWeight):
            want = torch.stack(_grads_of_every_rank(own[n])).sum(0) / total
            torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=0.0)


def _subgroups(rank, world) -> None:
    """Weights sharded over a pair of ranks: a fresh bias beside one follows its pair; the LayerNorm follows
    the weights' group too (the pairs); ``dp_group`` overrides it."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine_pair = pairs[rank // 2]
    model, ref = _model(mine_pair), _model(mine_pair)
    _step(model, rank)
    _step(ref, rank)
    own = _own_grads(ref)
    distwgrad.finalize_model_grads(model)
    for n, p in model.named_parameters():
        if not isinstance(p, ShardedWeight):
            assert torch.equal(p.grad, torch.stack(_grads_of_every_rank(own[n], mine_pair)).mean(0)), n
    world_model = _model(mine_pair)
    _step(world_model, rank)
    distwgrad.finalize_model_grads(world_model, dp_group=dist.group.WORLD)
    want = torch.stack(_grads_of_every_rank(own["norm.weight"])).mean(0)
    assert torch.equal(world_model["norm"].weight.grad, want), "dp_group= averages the untagged ones over it"
    assert torch.equal(world_model["fc"].bias.grad, model["fc"].bias.grad), "a fresh bias follows its weight"


def _ambiguous(rank, world) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = nn.ModuleDict({"a": _model(pairs[rank // 2]), "b": _model()})
    for m in model.values():
        _step(m, rank)
    with pytest.raises(ValueError, match=r"plain parameters \['a\.norm\.weight', 'a\.norm\.bias', "
                                         r"'b\.norm\.weight', 'b\.norm\.bias'\]: the distributed weights average "
                                         r"over different ranks .*dp_group"):
        distwgrad.finalize_model_grads(model)
    distwgrad.finalize_model_grads(model, discard=True)


_CASES = {"averaged": _averaged, "tokens": _tokens}
_CASES_4 = {"subgroups": _subgroups, "ambiguous": _ambiguous}


def _one(case, rank, world):
    {**_CASES, **_CASES_4}[case](rank, world)


def _rank(rank, world, cases):
    for_each_case(cases, _one, rank, world)


@pytest.mark.distributed
def test_plain_parameters_average_over_their_group():
    run_distributed(_rank, 2, sorted(_CASES), timeout=120)


@pytest.mark.distributed
def test_an_ambiguous_group_is_refused_by_name():
    run_distributed(_rank, 4, sorted(_CASES_4), timeout=180)
