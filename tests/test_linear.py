"""Linear's gradient contract (seed 000's matrix), against independent ``torch.nn.Linear`` oracles.

Tolerances: everything here is bit-exact (``torch.equal``) because each comparison adds the same terms
in the same order. The one exception is explicit: a TIED weight over several microbatches, compared with
autograd's own order. Autograd sums the two uses of one backward first, ``(a1+b1)+(a2+b2)``, while
deferred wgrads drained after each backward add in queue order, ``((a1+b1)+a2)+b2``; those differ by
rounding only, so that comparison allows a few ulps of the dtype at the gradient's magnitude. The same
case is also checked bit-exactly against the oracle summed in the deferred order.
"""

from __future__ import annotations

import pytest
import torch

import distwgrad
from distwgrad.nn import Linear
from distwgrad.wgrad import DeferredWgradError

DTYPES = [torch.float32, torch.bfloat16]


def _two_linears(*, delay, bias, dtype, fuse=False):
    torch.manual_seed(3)
    return torch.nn.Sequential(
        Linear(16, 16, bias=bias, params_dtype=dtype, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse),
        Linear(16, 16, bias=bias, params_dtype=dtype, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse),
    )


def _tie(model, *, bias):
    model[1].weight = model[0].weight
    if bias:
        model[1].bias = model[0].bias
    return model


def _oracle_like(model, *, tied):
    """Independent torch.nn.Linear pair with the same values (tied the same way)."""
    ref = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=m.bias is not None) for m in model])
    for r, m in zip(ref, model):
        r.to(m.weight.dtype)
        r.weight.data.copy_(m.weight.detach())
        if m.bias is not None:
            r.bias.data.copy_(m.bias.detach())
    if tied:
        ref[1].weight = ref[0].weight
        if ref[1].bias is not None:
            ref[1].bias = ref[0].bias
    return ref


def _run(model, x, *, microbatches=1, backward_dw_order=(0, 1)):
    """Forward/backward each microbatch, then drain the deferred wgrads in ``backward_dw_order``."""
    for microbatch in torch.chunk(x, microbatches, dim=0):
        model(microbatch).float().square().sum().backward()
        for i in backward_dw_order:
            model[i].backward_dw()


def _per_use_grads(model, x, *, microbatches):
    """Per-microbatch, per-use oracle gradients (weight, bias) from UNtied nn.Linear copies."""
    ref = _oracle_like(model, tied=False)
    out = []
    for microbatch in torch.chunk(x, microbatches, dim=0):
        params = [p for r in ref for p in r.parameters()]
        grads = torch.autograd.grad(ref(microbatch).float().square().sum(), params)
        per_module = [grads[i:i + len(params) // 2] for i in (0, len(params) // 2)]
        out.append(per_module)
    return out


def _ulps(dtype):
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_non_tied_matches_oracle_bit_exact(dtype, bias, delay):
    model = _two_linears(delay=delay, bias=bias, dtype=dtype)
    ref = _oracle_like(model, tied=False)
    x = torch.randn(8, 16, dtype=dtype)
    _run(model, x)
    ref(x).float().square().sum().backward()
    for m, r in zip(model, ref):
        assert torch.equal(m.weight.grad, r.weight.grad)
        if bias:
            assert torch.equal(m.bias.grad, r.bias.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_tied_deferred_accumulates_every_use(dtype, order, bias):
    model = _tie(_two_linears(delay=True, bias=bias, dtype=dtype), bias=bias)
    regular = _tie(_two_linears(delay=False, bias=bias, dtype=dtype), bias=bias)
    ref = _oracle_like(model, tied=True)
    x = torch.randn(8, 16, dtype=dtype)
    _run(model, x, backward_dw_order=order)
    _run(regular, x)
    ref(x).float().square().sum().backward()
    assert model[0].weight is model[1].weight
    assert torch.equal(model[0].weight.grad, ref[0].weight.grad)
    assert torch.equal(regular[0].weight.grad, ref[0].weight.grad)
    if bias:
        assert torch.equal(model[0].bias.grad, ref[0].bias.grad)
        assert torch.equal(regular[0].bias.grad, ref[0].bias.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_microbatches_accumulate(dtype, order, microbatches, tied):
    model = _two_linears(delay=True, bias=True, dtype=dtype)
    if tied:
        _tie(model, bias=True)
    x = torch.randn(8, 16, dtype=dtype)
    per_use = _per_use_grads(model, x, microbatches=microbatches)
    ref = _oracle_like(model, tied=tied)
    _run(model, x, microbatches=microbatches, backward_dw_order=order)
    for microbatch in torch.chunk(x, microbatches, dim=0):
        ref(microbatch).float().square().sum().backward()

    # Bit-exact against the oracle summed in the deferred order.
    for which in (0, 1):  # weight, bias
        if tied:
            expected = None
            for mb in per_use:
                for i in order:
                    g = mb[i][which]
                    expected = g.clone() if expected is None else expected + g
            got = [model[0].weight.grad, model[0].bias.grad][which]
            assert torch.equal(got, expected)
        else:
            for i in (0, 1):
                expected = None
                for mb in per_use:
                    g = mb[i][which]
                    expected = g.clone() if expected is None else expected + g
                got = [model[i].weight.grad, model[i].bias.grad][which]
                assert torch.equal(got, expected)
                # Untied: autograd adds in the same order, so bit-exact against it too.
                assert torch.equal(got, [ref[i].weight.grad, ref[i].bias.grad][which])

    if tied:
        # Against autograd's order: equal up to a few roundings at the gradient's magnitude.
        for got, want in ((model[0].weight.grad, ref[0].weight.grad), (model[0].bias.grad, ref[0].bias.grad)):
            bound = 4 * _ulps(dtype) * want.float().abs().max()
            assert (got.float() - want.float()).abs().max() <= bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_second_step_equals_fresh_model(dtype, set_to_none, tied):
    model = _two_linears(delay=True, bias=True, dtype=dtype)
    if tied:
        _tie(model, bias=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x1, x2 = torch.randn(8, 16, dtype=dtype), torch.randn(8, 16, dtype=dtype)
    _run(model, x1)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    fresh = _oracle_like(model, tied=tied)  # same weights as after step 1, no history
    _run(model, x2)
    fresh(x2).float().square().sum().backward()
    for m, f in zip(model, fresh):
        assert torch.equal(m.weight.grad, f.weight.grad)
        assert torch.equal(m.bias.grad, f.bias.grad)


def test_main_backward_hands_autograd_nothing_for_deferred_grads():
    model = _two_linears(delay=True, bias=True, dtype=torch.float32)
    model(torch.randn(4, 16)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert [m.pending_backward_dw for m in model] == [1, 1]
    assert all(getattr(p, "skip_backward_post_hook", False) for p in model.parameters())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("megatron", [False, True])
def test_fused_main_grad_accumulates_in_fp32(dtype, delay, megatron):
    model = _tie(_two_linears(delay=delay, bias=False, dtype=dtype, fuse=True), bias=False)
    weight = model[0].weight
    attached = torch.full(weight.shape, 0.5, dtype=torch.float32)
    weight.main_grad = attached  # Megatron attaches a view into its flat buffer
    if megatron:
        weight.grad_added_to_main_grad = False  # and marks the parameter: [Note: the fused .grad contract]
    x = torch.randn(8, 16, dtype=dtype)
    per_use = _per_use_grads(model, x, microbatches=2)
    _run(model, x, microbatches=2, backward_dw_order=(1, 0))
    assert weight.main_grad is attached and weight.main_grad.dtype == torch.float32
    assert getattr(weight, "grad_added_to_main_grad", None) is (True if megatron else None)
    expected = torch.full(weight.shape, 0.5)
    # Non-deferred: autograd runs module 1's backward before module 0's; deferred: drain order (1, 0).
    for mb in per_use:
        for i in (1, 0):
            expected += mb[i][0].float()
    assert torch.equal(attached, expected)
    if megatron:  # deferred or not, the main backward hands a dummy of zeros, never garbage
        assert torch.equal(weight.grad, torch.zeros_like(weight))
    else:
        assert weight.grad is None  # a plain optimizer skips the weight


def test_fused_main_grad_created_when_absent():
    lin = Linear(16, 8, bias=False, fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    x = torch.randn(4, 16)
    lin(x).sum().backward()
    assert getattr(lin.weight, "main_grad", None) is None  # nothing before the deferred GEMM
    lin.backward_dw()
    ref = torch.nn.Linear(16, 8, bias=False)
    ref.weight.data.copy_(lin.weight.detach())
    ref(x).sum().backward()
    assert lin.weight.main_grad.dtype == torch.float32
    assert torch.equal(lin.weight.main_grad, ref.weight.grad)


@pytest.mark.parametrize("delay", [False, True])
def test_tied_weight_with_one_fused_and_one_unfused_user(delay):
    torch.manual_seed(0)
    fused = Linear(16, 16, bias=False, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    plain = Linear(16, 16, bias=False, delay_wgrad_compute=delay)
    plain.weight = fused.weight
    fused.weight.zero_out_wgrad = True
    model = torch.nn.Sequential(fused, plain)
    x = torch.randn(8, 16)
    per_use = _per_use_grads(model, x, microbatches=1)[0]
    _run(model, x)
    assert torch.equal(fused.weight.main_grad, per_use[0][0])  # the fused use, in fp32
    assert torch.equal(fused.weight.grad, per_use[1][0])  # the unfused use (+ zero dummy if not deferred)


def test_hooks_fire_after_each_deferred_gemm():
    lin = Linear(16, 8, delay_wgrad_compute=True)
    seen = []
    lin.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(lin.weight.grad is not None))
    for _ in range(2):
        lin(torch.randn(4, 16)).sum().backward()
    lin.backward_dw()
    lin.backward_dw()
    assert seen == [True, True]
    assert lin.need_backward_dw() and not Linear(4, 4).need_backward_dw()


def test_backward_dw_with_nothing_queued_names_the_module():
    model = torch.nn.Sequential(Linear(16, 16, delay_wgrad_compute=True))
    with pytest.raises(DeferredWgradError, match=r"Linear\(16, 16\).*no deferred wgrad queued"):
        model[0].backward_dw()
    Linear(4, 4).backward_dw()  # a module that does not defer: a no-op, as in TransformerEngine


def test_strict_scope_refuses_to_queue_on_undrained_work():
    model = _two_linears(delay=True, bias=True, dtype=torch.float32)
    x = torch.randn(4, 16)
    with pytest.raises(DeferredWgradError, match="undrained"):
        with distwgrad.deferred_wgrad_scope(model, strict=True):
            model(x).sum().backward()
            model(x)
    assert model[0].wgrad_store.strict is False  # restored


@pytest.mark.parametrize("order", ["reverse", "forward", [1, 0]])
def test_scope_drains_every_module(order):
    model = _tie(_two_linears(delay=True, bias=True, dtype=torch.float32), bias=True)
    ref = _oracle_like(model, tied=True)
    x = torch.randn(8, 16)
    with distwgrad.deferred_wgrad_scope(model, order=order):
        for microbatch in torch.chunk(x, 2):
            model(microbatch).square().sum().backward()
    assert [m.pending_backward_dw for m in model] == [0, 0]
    for microbatch in torch.chunk(x, 2):
        ref(microbatch).square().sum().backward()
    bound = 4 * _ulps(torch.float32) * ref[0].weight.grad.abs().max()
    assert (model[0].weight.grad - ref[0].weight.grad).abs().max() <= bound


def test_bad_inputs_give_clear_errors():
    lin = Linear(16, 8)
    with pytest.raises(ValueError, match=r"shape \(4, 15\).*in_features=16"):
        lin(torch.randn(4, 15))
    with pytest.raises(TypeError, match="input dtype torch.bfloat16 does not match the weight dtype torch.float32"):
        lin(torch.randn(4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="in_features must be a positive int, got 0"):
        Linear(0, 8)
    with pytest.raises(TypeError, match="must be bools"):
        Linear(4, 4, delay_wgrad_compute="yes")
    with pytest.raises(ValueError, match=r"weight has full shape \(4, 4\), expected \(8, 16\)"):
        Linear(16, 8, weight=torch.nn.Parameter(torch.zeros(4, 4)))
    with pytest.raises(ValueError, match="order must name each"):
        distwgrad.drain_deferred_wgrads(_two_linears(delay=True, bias=False, dtype=torch.float32), order=[0, 0])


def test_leading_dims_and_no_grad():
    lin = Linear(16, 8, delay_wgrad_compute=True)
    ref = torch.nn.Linear(16, 8)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(2, 3, 16)
    assert torch.equal(lin(x), ref(x))
    with torch.no_grad():
        lin(x)
    assert lin.pending_backward_dw == 0


def test_negative_control_assigning_backward_dw_is_caught(monkeypatch):
    """If a deferred contribution assigned ``.grad`` instead of adding, the tied test above would fail."""
    from distwgrad.wgrad import accumulate

    def assign(param, grad):
        if grad is not None:
            param.grad = grad.detach().clone()

    monkeypatch.setattr(accumulate, "add_to_grad", assign)
    with pytest.raises(AssertionError):
        test_tied_deferred_accumulates_every_use(torch.float32, (0, 1), bias=True)


def test_capturing_an_add_into_grad_is_refused(monkeypatch):
    """Seed 000's CUDA-graph hazard: a captured ``.grad.add_`` outlives the ``.grad`` it wrote into."""
    lin = Linear(16, 8, delay_wgrad_compute=True)
    lin(torch.randn(4, 16)).sum().backward()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph is capturing.*fuse_wgrad_accumulation=True"):
        lin.backward_dw()
    assert lin.pending_backward_dw == 1  # refused, not lost


def test_transformer_engine_constructor_and_forward_conventions():
    """init_method, return_bias, is_first_microbatch, and tensor-parallel arguments at their defaults."""
    lin = Linear(16, 8, init_method=torch.nn.init.zeros_, return_bias=True, sequence_parallel=False, tp_size=1)
    assert torch.equal(lin.weight, torch.zeros(8, 16))
    x = torch.randn(4, 16)
    out, bias = lin(x, is_first_microbatch=True)
    assert bias is lin.bias and torch.equal(out, torch.zeros(4, 8))  # bias returned, not added
    (out + bias).sum().backward()
    assert torch.equal(lin.bias.grad, torch.full((8,), 4.0))
    with pytest.raises(NotImplementedError, match=r"tensor parallelism is not implemented \(\{'tp_size': 2\}\)"):
        Linear(16, 8, tp_size=2)


def test_parameter_checks_rerun_when_a_parameter_changes():
    """[Note: per-call host work] in nn/_base.py: the parameter checks are skipped while nothing they read
    changed, and run again (with their errors) once a parameter is replaced, cast or given a param_dtype."""
    m = Linear(6, 8, bias=False)
    x = torch.randn(3, 6)
    m(x)
    m.weight = torch.nn.Parameter(torch.randn(8, 5))
    with pytest.raises(ValueError, match=r"weight has full shape \(8, 5\), expected \(8, 6\)"):
        m(x)
    m.weight = distwgrad.ShardedWeight.from_full(torch.randn(8, 6), param_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="input dtype torch.float32 does not match the weight dtype torch.bfloat16"):
        m(x)
    assert m(x.bfloat16()).dtype == torch.bfloat16
    m.weight.param_dtype = None  # the same object, computing in fp32 again
    assert m(x).dtype == torch.float32
    with torch.no_grad():
        m.weight.data = m.weight.data.double()
    with pytest.raises(TypeError, match="input dtype torch.float32 does not match the weight dtype torch.float64"):
        m(x)
