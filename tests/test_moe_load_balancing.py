"""The router's load-balancing loss ([Note: load balancing] in distwgrad/models/moe_gpt.py) against its
definition, in ``MoEGPT.loss`` of both builds, and in the direction it pushes the router."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distwgrad.models import MoEGPT, MoEGPTConfig
from distwgrad.models.moe_gpt import load_balancing_loss

TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_experts=4, top_k=2, d_ff=48)


def _definition(probs_TE: torch.Tensor, expert_TK: torch.Tensor) -> torch.Tensor:
    """Switch Transformer, eq. 4, with top-k assignments: E * sum_e (share of assignments to e) * (mean
    probability of e), term by term in fp64."""
    T, E = probs_TE.shape
    total = torch.zeros((), dtype=torch.float64)
    for e in range(E):
        f = (expert_TK == e).sum().double() / expert_TK.numel()
        total = total + f * probs_TE[:, e].double().mean()
    return E * total


@pytest.mark.parametrize("seed", range(3))
def test_matches_its_definition(seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(37, 6, generator=g).mul(3).softmax(-1)
    expert = probs.topk(2, dim=-1).indices
    counts = torch.bincount(expert.reshape(-1), minlength=6)
    # fp32 against fp64: 6 products and a mean of 37 terms each, relative error below 1e-6
    torch.testing.assert_close(load_balancing_loss(probs, counts, 2).double(), _definition(probs, expert),
                               rtol=1e-6, atol=0)


def test_uniform_is_one_and_collapsed_is_e():
    E, T = 4, 8
    uniform = torch.full((T, E), 1 / E)
    assert load_balancing_loss(uniform, torch.full((E,), T // E), 1).item() == pytest.approx(1, abs=1e-7)
    collapsed = F.one_hot(torch.zeros(T, dtype=torch.int64), E).float()
    assert load_balancing_loss(collapsed, torch.tensor([T, 0, 0, 0]), 1).item() == E


@pytest.mark.parametrize("sharded", [True, False])
def test_the_model_adds_each_layers_loss(sharded):
    """``MoEGPT.loss`` = cross-entropy + coef * the sum of every layer's loss over the tokens it routed; with
    coef 0 it is the cross-entropy alone, the same bits as before the option existed."""
    coef = 0.05
    tokens = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(0))
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    model = MoEGPT(MoEGPTConfig(**TINY, aux_loss_coef=coef), sharded=sharded)
    seen = []  # each router's logits, recomputed into the definition
    for block in model.blocks:
        block.moe.router.register_forward_hook(lambda m, i, out: seen.append(out.detach().float()))
    with torch.no_grad():
        got = model.loss(ids, targets)
        ce = F.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten())
    want = ce.double()
    for logits in seen[:TINY["n_layers"]]:
        probs = logits.softmax(-1)
        want = want + coef * _definition(probs, probs.topk(TINY["top_k"], dim=-1).indices)
    assert abs(got.item() - want.item()) < 1e-6  # fp32 sums of O(1) terms
    plain = MoEGPT(MoEGPTConfig(**TINY), sharded=sharded)
    with torch.no_grad():
        assert torch.equal(plain.loss(ids, targets), ce)
        assert all(b.moe.aux_loss is None for b in plain.blocks)


def test_its_gradient_spreads_the_routing():
    """Trained on the loss alone, a router that sends nearly every token to one expert spreads them: the loss
    falls and no expert keeps more than 60% of the tokens."""
    torch.manual_seed(0)
    E, D, T = 4, 16, 256
    u = F.normalize(torch.randn(D), dim=0)
    x = torch.randn(T, D) + 3 * u  # every token leans along u
    router = torch.nn.Linear(D, E, bias=False)
    with torch.no_grad():
        router.weight.mul_(0.1)
        router.weight[0] = u  # ... so expert 0 gets them (a logit of ~3 against ~0)
    opt = torch.optim.SGD(router.parameters(), lr=1.0)

    def step() -> tuple[float, float]:
        probs = router(x).softmax(-1)
        counts = torch.bincount(probs.topk(1, dim=-1).indices.reshape(-1), minlength=E)
        loss = load_balancing_loss(probs, counts, 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item(), counts.max().item() / T

    first = step()
    for _ in range(200):
        last = step()
    assert first[1] > 0.95 and last[1] < 0.6, (first, last)
    assert last[0] < first[0] - 1, (first, last)


def test_checkpoints_do_not_pin_the_coefficient(tmp_path):
    """The coefficient is a training choice, not part of the model: ``MoEGPTConfig.architecture()`` (what the
    job's checkpoints record and a resume must match) leaves it out, so a run saved without the loss resumes
    with it, and the weights load bit for bit."""
    from distwgrad.checkpoint import load_checkpoint, save_checkpoint

    saved, resumed = MoEGPTConfig(**TINY), MoEGPTConfig(**TINY, aux_loss_coef=0.01)
    assert "aux_loss_coef" not in saved.architecture() and saved.architecture() == resumed.architecture()
    model = MoEGPT(saved)
    path = save_checkpoint(str(tmp_path), 1, model, meta={"model_config": saved.architecture()})
    other = MoEGPT(resumed)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    assert load_checkpoint(path, other, expect={"model_config": resumed.architecture()}) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
