"""TransformerEngine's dispatcher contract, through ``distwgrad.distributed_weight`` (TE's module name).

What TE's public tests pin: one weight or a list in, always a list out; plain tensors pass through as
the same objects; a group's leader is called once; a one-member group exchanges bare tensors
([Note: one-member groups exchange bare tensors]); a non-Tensor implementer is a ``TypeError``;
``weight_grad_buffers`` / ``weight_grad_dtype`` (TE PR #3397). Then a TE-style implementer, written here
and not a distwgrad class, used in Linear, packed GroupedLinear and LayerNormMLP.
"""

from __future__ import annotations

import pytest
import torch

from distwgrad import ShardedWeight
from distwgrad.distributed_weight import (
    DistributedWeight,
    finalize_weight_grads,
    is_distributed_weight,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
    weight_grad_buffers,
    weight_grad_dtype,
)
from distwgrad.nn import GroupedLinear, LayerNormMLP, Linear


class GroupFake(torch.Tensor):
    """Acts for a group of ``size`` and marks its results; bare tensors for a group of one."""

    is_distributed_weight = True

    def __new__(cls, size=1, marker=-1.0):
        t = torch.zeros(1).as_subclass(cls)
        t.size_, t.marker, t.calls = size, marker, []
        return t

    def _out(self, base):
        out = [torch.full((2, 2), base + i) for i in range(self.size_)]
        return out if self.size_ > 1 else out[0]

    def materialize_group_for_forward(self):
        self.calls.append("fwd")
        return self._out(0.0)

    def materialize_group_for_backward(self):
        self.calls.append("bwd")
        return self._out(10.0)

    def finalize_group_grads(self, wgrads):
        self.calls.append(("finalize", type(wgrads).__name__))
        out = [w + 100 for w in (wgrads if isinstance(wgrads, list) else [wgrads])]
        return out if self.size_ > 1 else out[0]

    def grad_buffer(self):
        return torch.full((2, 2), self.marker)


class NotATensor:
    is_distributed_weight = True


def test_non_tensor_implementer_is_a_type_error():
    with pytest.raises(TypeError, match="DistributedWeight must be a torch.Tensor subclass"):
        is_distributed_weight(NotATensor())
    assert is_distributed_weight(GroupFake()) and isinstance(GroupFake(), DistributedWeight)
    assert not is_distributed_weight(torch.nn.Parameter(torch.zeros(2)))


@pytest.mark.parametrize("size", [1, 3])
def test_one_weight_or_a_list_always_a_list_and_the_leader_called_once(size):
    for fn, base in ((materialize_weight_for_forward, 0.0), (materialize_weight_for_backward, 10.0)):
        lead = GroupFake(size)
        bare = fn(lead)
        listed = fn([lead] + [torch.zeros(2, 2)] * (size - 1))
        for out in (bare, listed):
            assert isinstance(out, list) and [t[0, 0].item() for t in out] == [base + i for i in range(size)]
        assert len(lead.calls) == 2  # once per dispatch, for the whole group
    plain = [torch.nn.Parameter(torch.randn(2)) for _ in range(3)]
    assert all(a is b for a, b in zip(materialize_weight_for_forward(plain), plain))
    assert materialize_weight_for_backward(plain[0])[0] is plain[0]


@pytest.mark.parametrize("size", [1, 2])
def test_finalize_hands_a_one_member_group_a_bare_tensor(size):
    lead = GroupFake(size)
    out = finalize_weight_grads(lead, [torch.zeros(2, 2) for _ in range(size)])
    assert lead.calls == [("finalize", "Tensor" if size == 1 else "list")]
    assert len(out) == size and all(torch.equal(t, torch.full((2, 2), 100.0)) for t in out)
    g = [torch.ones(2)]
    assert finalize_weight_grads(torch.nn.Parameter(torch.zeros(2)), g)[0] is g[0]


def test_own_weights_accept_a_bare_wgrad():
    w = ShardedWeight.from_full(torch.ones(4, 2))  # one rank, no process group: the whole weight
    w.expect_contribution(2)
    assert w.finalize_group_grads(w.grad_buffer().add_(1)) is None  # bare, as the dispatchers pass it
    assert finalize_weight_grads(w, [w.grad_buffer().add_(2)]) == [None]
    assert w.pending_contributions == 0 and torch.equal(w.main_grad, torch.full((4, 2), 3.0))


@pytest.mark.parametrize("size", [1, 2])
def test_weight_grad_buffers_are_each_members_own(size):
    group = [GroupFake(size, marker=float(i)) for i in range(size)]
    assert [b[0, 0].item() for b in weight_grad_buffers(group, (2, 2), torch.bfloat16, "cpu")] == list(
        map(float, range(size)))
    with pytest.raises(RuntimeError, match="^wgrad GEMM needs"):
        weight_grad_buffers(group, (4, 5), torch.bfloat16, "cpu")
    plain = weight_grad_buffers([torch.nn.Parameter(torch.zeros(2))] * 3, (4, 5), torch.bfloat16, "cpu")
    assert len(plain) == 3 and all(b.shape == (4, 5) and b.dtype is torch.bfloat16 for b in plain)


def test_weight_grad_dtype():
    w = GroupFake()
    assert weight_grad_dtype(w, torch.bfloat16) == torch.bfloat16  # no main_grad yet
    w.main_grad = torch.zeros(2, 2)
    assert weight_grad_dtype(w, torch.bfloat16) == weight_grad_dtype([w], torch.bfloat16) == torch.float32
    plain = torch.nn.Parameter(torch.zeros(2))
    plain.main_grad = torch.zeros(2)
    assert weight_grad_dtype(plain, torch.bfloat16) == torch.bfloat16  # a plain weight keeps the compute dtype


class TEStyleWeight(torch.nn.Parameter):
    """A TE-style implementer (Megatron's GTP shape): bare tensors in and out, an fp32 ``main_grad``, a
    full-size ``grad_buffer()`` in ``main_grad``'s dtype. Here the 'gather' is the local full copy."""

    is_distributed_weight = True

    def materialize_group_for_forward(self):
        self.log.append("fwd")
        return self.detach()

    def materialize_group_for_backward(self):
        self.log.append("bwd")
        return self.detach()

    def grad_buffer(self):
        if self.buffer is None:
            self.buffer = torch.zeros(self.buffer_shape, dtype=self.main_grad.dtype)
        return self.buffer

    def finalize_group_grads(self, wgrads):
        assert isinstance(wgrads, torch.Tensor), "a bare tensor"
        # TE's contract: grad_buffer() is the fused path's scratch; unfused, a fresh allocation
        assert (wgrads is self.buffer) == self.fused, (self.fused, self.buffer is None)
        self.log.append(("finalize", wgrads.dtype))
        self.main_grad.add_(wgrads)  # the 'reduction', in fp32
        self.buffer = None
        return self.main_grad.to(self.dtype)  # bare: one more contribution to .grad


def _te_style(t, *, buffer_dtype=torch.float32, buffer_shape=None, fused=False):
    w = TEStyleWeight(t.detach().clone())
    w.log, w.buffer, w.buffer_shape = [], None, tuple(t.shape) if buffer_shape is None else buffer_shape
    w.fused = fused
    w.main_grad = torch.zeros(t.shape, dtype=buffer_dtype)
    return w


def _check_te_style(w, want_fp32):
    assert w.log == ["fwd", "bwd", ("finalize", torch.float32)] or w.log == ["fwd", ("finalize", torch.float32)]
    assert torch.equal(w.main_grad, want_fp32)  # the wgrad and its reduction stayed fp32
    assert torch.equal(w.grad, want_fp32.to(w.dtype))


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_te_style_implementer_in_linear(delay, fuse):
    torch.manual_seed(0)
    w = torch.randn(6, 5, dtype=torch.bfloat16)
    lin = Linear(5, 6, bias=False, weight=_te_style(w, fused=fuse), delay_wgrad_compute=delay,
                 fuse_wgrad_accumulation=fuse)
    x = torch.randn(7, 5, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    lin.backward_dw()
    assert torch.equal(y, x.detach() @ w.t())
    # An fp32 buffer and reduction (on CPU the product is rounded once to bf16, as nn.Linear's backward is).
    _check_te_style(lin.weight, (dy.t() @ x.detach()).float())


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_te_style_implementer_in_packed_grouped_linear(delay, fuse):
    torch.manual_seed(0)
    g = GroupedLinear(2, 5, 6, bias=False, single_grouped_weight=True, params_dtype=torch.bfloat16,
                      delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
    w = g.weight.detach().clone()
    g.weight = _te_style(w, fused=fuse)
    x = torch.randn(7, 5, dtype=torch.bfloat16, requires_grad=True)
    y = g(x, [3, 4])
    dy = torch.randn_like(y)
    y.backward(dy)
    g.backward_dw()
    want = torch.stack([dy[s].float().t() @ x.detach()[s].float() for s in (slice(0, 3), slice(3, 7))])
    bound = 4 * torch.finfo(torch.bfloat16).eps * want.abs().max()  # the bf16 product's rounding at most
    assert (g.weight.main_grad - want).abs().max() <= bound
    assert g.weight.log[-1] == ("finalize", torch.float32) and g.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_te_style_implementer_in_layernorm_mlp(delay, fuse):
    torch.manual_seed(0)
    mlp = LayerNormMLP(8, 12, params_dtype=torch.bfloat16, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
    plain = LayerNormMLP(8, 12, params_dtype=torch.float32)
    plain.load_state_dict({k: v.float() for k, v in mlp.state_dict().items()})
    for name in ("fc1_weight", "fc2_weight"):
        setattr(mlp, name, _te_style(getattr(mlp, name), fused=fuse))
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    mlp(x).float().square().sum().backward()
    mlp.backward_dw()
    plain(x.float()).square().sum().backward()
    for name in ("fc1_weight", "fc2_weight"):
        w = getattr(mlp, name)
        assert w.log[-1] == ("finalize", torch.float32) and w.main_grad.dtype == torch.float32
        assert w.grad.dtype == torch.bfloat16 and torch.equal(w.grad, w.main_grad.to(torch.bfloat16))
        want = getattr(plain, name).grad  # an fp32 model: bf16 operands' rounding only
        assert (w.main_grad - want).abs().max() <= 0.05 * want.abs().max(), name


def test_unfused_foreign_group_never_calls_grad_buffer():
    """TE's ops test shape: only the leader implements the protocol, and its grad_buffer() is not a scratch
    (it returns the weight's own data). Unfused, the wgrad GEMM must write fresh buffers: the weights stay
    untouched and main_grad gets exactly the reference gradient."""
    from distwgrad.nn import ops

    class Leader(torch.nn.Parameter):
        is_distributed_weight = True

        def materialize_group_for_forward(self):
            return [w.detach() for w in self.group]

        def materialize_group_for_backward(self, **kwargs):
            return [w.detach() for w in self.group]

        def finalize_group_grads(self, wgrads, **kwargs):
            for w, g in zip(self.group, wgrads):
                w.main_grad.add_(g.to(w.main_grad.dtype))
            return [torch.zeros_like(g) for g in wgrads]

        def grad_buffer(self):
            return self.data  # not a scratch: writing a wgrad here would corrupt the weight

    torch.manual_seed(0)
    op = ops.GroupedLinear(2, 4, 6, bias=False, device="cpu", dtype=torch.float32)
    ref = ops.GroupedLinear(2, 4, 6, bias=False, device="cpu", dtype=torch.float32)
    ref.load_state_dict(op.state_dict())
    leader = Leader(op.weight0.detach().clone())
    leader.group = [leader, op.weight1]
    op.weight0 = leader
    for w in (op.weight0, op.weight1):
        w.main_grad = torch.zeros(6, 4)
    before = [w.detach().clone() for w in (op.weight0, op.weight1)]
    x = torch.randn(5, 4)
    op(x, torch.tensor([2, 3])).sum().backward()
    ref(x, torch.tensor([2, 3])).sum().backward()
    for w, b, r in zip((op.weight0, op.weight1), before, (ref.weight0, ref.weight1)):
        assert torch.equal(w.detach(), b), "a weight was written"
        assert torch.equal(w.main_grad, r.grad)


def test_a_buffer_of_the_wrong_shape_or_a_narrow_dtype_is_refused():
    """grad_buffer() is the fused path's scratch (TE's contract), so the checks are of fused modules."""
    lin = Linear(5, 6, bias=False, weight=_te_style(torch.randn(6, 5), buffer_shape=(3, 5), fused=True),
                 fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="wgrad GEMM needs a buffer of shape \\(6, 5\\)"):
        lin(torch.randn(2, 5)).sum().backward()
    w = _te_style(torch.randn(6, 5, dtype=torch.bfloat16), fused=True)
    w.grad_buffer = lambda: torch.zeros(6, 5, dtype=torch.bfloat16)  # main_grad is fp32
    lin = Linear(5, 6, bias=False, weight=w, fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="grad_buffer\\(\\) is torch.bfloat16 but the wgrad must be torch.float32"):
        lin(torch.randn(2, 5, dtype=torch.bfloat16)).sum().backward()
