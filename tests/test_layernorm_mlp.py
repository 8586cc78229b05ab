"""LayerNormMLP's and LayerNormLinear's gradient contract (seed 000's matrix) against independent oracles.

The oracles are plain torch (``nn.LayerNorm`` / ``nn.RMSNorm``, ``nn.Linear``, the activations written
out here), never distwgrad code. Tolerances as in ``tests/test_linear.py``: bit-exact wherever both sides
add the same terms in the same order; a TIED module over several microbatches is also bit-exact against
the oracle summed in the deferred order, and within a few ulps of autograd's own order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distwgrad.nn import LayerNormLinear, LayerNormMLP
from distwgrad.wgrad import DeferredWgradError

DTYPES = [torch.float32, torch.bfloat16]
KINDS = ["mlp", "ln_linear"]
H, FFN = 16, 24  # hidden size, ffn hidden size

_ACT = {  # the oracle's own activations (TE's definitions)
    "gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x), "srelu": lambda x: F.relu(x) ** 2,
}
_GATED = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu", "sreglu": "srelu"}


def _oracle_act(name, h):
    if name in _ACT:
        return _ACT[name](h)
    a, b = h.chunk(2, dim=-1)
    return _ACT[_GATED[name]](a) * b


class _Oracle(torch.nn.Module):
    """norm -> Linear (-> act -> Linear) in plain torch, with the module's values."""

    def __init__(self, mod):
        super().__init__()
        mlp = isinstance(mod, LayerNormMLP)
        dtype = (mod.fc1_weight if mlp else mod.weight).dtype
        rms = mod.normalization == "RMSNorm"
        self.norm = (torch.nn.RMSNorm(H, eps=mod.eps) if rms else torch.nn.LayerNorm(H, eps=mod.eps)).to(dtype)
        gamma = mod.layer_norm_weight.detach()
        self.norm.weight.data.copy_(1 + gamma if mod.zero_centered_gamma else gamma)
        if not rms:
            self.norm.bias.data.copy_(mod.layer_norm_bias.detach())
        self.act = mod.activation if mlp else None
        pairs = [("fc1_weight", "fc1_bias"), ("fc2_weight", "fc2_bias")] if mlp else [("weight", "bias")]
        self.fcs = torch.nn.ModuleList()
        for w, b in pairs:
            weight, bias = getattr(mod, w), getattr(mod, b)
            fc = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None).to(dtype)
            fc.weight.data.copy_(weight.detach())
            if bias is not None:
                fc.bias.data.copy_(bias.detach())
            self.fcs.append(fc)
        self.names = {"layer_norm_weight": self.norm.weight, "layer_norm_bias": getattr(self.norm, "bias", None)}
        for (w, b), fc in zip(pairs, self.fcs):
            self.names[w], self.names[b] = fc.weight, fc.bias

    def forward(self, x):
        y = self.fcs[0](self.norm(x))
        if self.act is not None:
            y = self.fcs[1](_oracle_act(self.act, y))
        return y


def _one(kind, *, delay, bias, dtype, fuse=False, **kw):
    if kind == "mlp":
        mod = LayerNormMLP(H, FFN, bias=bias, params_dtype=dtype, delay_wgrad_compute=delay,
                           fuse_wgrad_accumulation=fuse, **kw)
    else:
        mod = LayerNormLinear(H, H, bias=bias, params_dtype=dtype, delay_wgrad_compute=delay,
                              fuse_wgrad_accumulation=fuse, **kw)
    with torch.no_grad():  # every parameter away from its initial value, so each gradient shows
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p is mod.layer_norm_weight else 0.0))
    return mod


def _two(kind, *, delay, bias, dtype, fuse=False, **kw):
    torch.manual_seed(3)
    return torch.nn.Sequential(_one(kind, delay=delay, bias=bias, dtype=dtype, fuse=fuse, **kw),
                               _one(kind, delay=delay, bias=bias, dtype=dtype, fuse=fuse, **kw))


def _tie(model):
    for name, p in list(model[0].named_parameters()):
        setattr(model[1], name, p)
    return model


def _oracle_like(model, *, tied):
    ref = torch.nn.Sequential(*[_Oracle(m) for m in model])
    if tied:
        for name in ("norm", "fcs"):
            setattr(ref[1], name, getattr(ref[0], name))
        ref[1].names = ref[0].names
    return ref


def _grads(model, ref):
    """(ours, oracle's) gradient per named parameter of each module."""
    return [(n, p.grad, r.names[n].grad) for m, r in zip(model, ref) for n, p in m.named_parameters()]


def _run(model, x, *, microbatches=1, backward_dw_order=(0, 1)):
    """Forward/backward each microbatch, then drain the deferred wgrads in ``backward_dw_order``."""
    for microbatch in torch.chunk(x, microbatches, dim=0):
        model(microbatch).float().square().sum().backward()
        for i in backward_dw_order:
            model[i].backward_dw()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_non_tied_matches_oracle_bit_exact(kind, dtype, bias, delay):
    model = _two(kind, delay=delay, bias=bias, dtype=dtype)
    ref = _oracle_like(model, tied=False)
    x = torch.randn(8, H, dtype=dtype)
    _run(model, x)
    ref(x).float().square().sum().backward()
    for name, got, want in _grads(model, ref):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_tied_deferred_accumulates_every_use(kind, dtype, order, bias):
    model = _tie(_two(kind, delay=True, bias=bias, dtype=dtype))
    regular = _tie(_two(kind, delay=False, bias=bias, dtype=dtype))
    ref = _oracle_like(model, tied=True)
    x = torch.randn(8, H, dtype=dtype)
    _run(model, x, backward_dw_order=order)
    _run(regular, x)
    ref(x).float().square().sum().backward()
    assert all(p is q for p, q in zip(model[0].parameters(), model[1].parameters()))
    for m in (model, regular):
        for name, got, want in _grads(m, ref)[: len(list(m[0].parameters()))]:
            assert torch.equal(got, want), name


def _per_use(model, x, *, microbatches):
    """Per-microbatch, per-module oracle gradients {name: grad} from UNtied oracle copies."""
    ref = _oracle_like(model, tied=False)
    out = []
    for microbatch in torch.chunk(x, microbatches, dim=0):
        ys = [r.names for r in ref]
        params = [p for names in ys for p in names.values() if p is not None]
        grads = dict(zip(map(id, params), torch.autograd.grad(ref(microbatch).float().square().sum(), params)))
        out.append([{n: grads[id(p)] for n, p in names.items() if p is not None} for names in ys])
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_microbatches_accumulate(kind, order, microbatches, tied):
    dtype = torch.bfloat16
    model = _two(kind, delay=True, bias=True, dtype=dtype)
    if tied:
        _tie(model)
    x = torch.randn(8, H, dtype=dtype)
    per_use = _per_use(model, x, microbatches=microbatches)
    ref = _oracle_like(model, tied=tied)
    _run(model, x, microbatches=microbatches, backward_dw_order=order)
    for microbatch in torch.chunk(x, microbatches, dim=0):
        ref(microbatch).float().square().sum().backward()
    norm_names = ("layer_norm_weight", "layer_norm_bias")
    for name, got, want in _grads(model, ref):
        if name in norm_names or not tied:  # autograd's order on both sides (the norm is never deferred)
            assert torch.equal(got, want), name
            continue
        expected = None  # bit-exact against the oracle summed in the deferred order
        for mb in per_use:
            for i in order:
                g = mb[i][name]
                expected = g.clone() if expected is None else expected + g
        assert torch.equal(got, expected), name
        bound = 4 * torch.finfo(dtype).eps * want.float().abs().max()  # autograd's order: a few roundings
        assert (got.float() - want.float()).abs().max() <= bound, name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_second_step_equals_fresh_model(kind, set_to_none, tied):
    dtype = torch.bfloat16
    model = _two(kind, delay=True, bias=True, dtype=dtype)
    if tied:
        _tie(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x1, x2 = torch.randn(8, H, dtype=dtype), torch.randn(8, H, dtype=dtype)
    _run(model, x1)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    fresh = _oracle_like(model, tied=tied)  # same weights as after step 1, no history
    _run(model, x2)
    fresh(x2).float().square().sum().backward()
    for name, got, want in _grads(model, fresh):
        assert torch.equal(got, want), name


NORMS = ["LayerNorm", "RMSNorm"]
ACTS = list(_ACT) + list(_GATED)


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_every_normalization_and_activation_matches_oracle(normalization, activation, zero_centered_gamma):
    torch.manual_seed(0)
    mlp = _one("mlp", delay=True, bias=True, dtype=torch.float32, normalization=normalization,
               activation=activation, zero_centered_gamma=zero_centered_gamma)
    gated = activation in _GATED
    assert tuple(mlp.fc1_weight.shape) == ((2 if gated else 1) * FFN, H)
    ref = _Oracle(mlp)
    x = torch.randn(2, 5, H, requires_grad=True)  # leading dims kept
    x_ref = x.detach().clone().requires_grad_()
    y, want = mlp(x), ref(x_ref)
    assert torch.equal(y, want)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    mlp.backward_dw()
    assert torch.equal(x.grad, x_ref.grad)
    for name, p in mlp.named_parameters():
        assert torch.equal(p.grad, ref.names[name].grad), name


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_linear_every_normalization_matches_oracle(normalization, zero_centered_gamma):
    torch.manual_seed(0)
    lin = _one("ln_linear", delay=True, bias=True, dtype=torch.float32, normalization=normalization,
               zero_centered_gamma=zero_centered_gamma)
    ref = _Oracle(lin)
    x = torch.randn(6, H)
    assert torch.equal(lin(x), ref(x))
    lin(x).square().sum().backward()
    ref(x).square().sum().backward()
    lin.backward_dw()
    for name, p in lin.named_parameters():
        assert torch.equal(p.grad, ref.names[name].grad), name


def test_zero_centered_gamma_starts_at_zero_and_rmsnorm_has_no_bias():
    mlp = LayerNormMLP(H, FFN, normalization="RMSNorm", zero_centered_gamma=True)
    assert torch.equal(mlp.layer_norm_weight, torch.zeros(H)) and mlp.layer_norm_bias is None
    assert torch.equal(LayerNormLinear(H, 4).layer_norm_weight, torch.ones(H))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("megatron", [False, True])
def test_fused_main_grad_accumulates_in_place(kind, delay, megatron):
    dtype = torch.bfloat16
    model = _tie(_two(kind, delay=delay, bias=False, dtype=dtype, fuse=True))
    names = ["fc1_weight", "fc2_weight"] if kind == "mlp" else ["weight"]
    attached = {n: torch.full(getattr(model[0], n).shape, 0.5) for n in names}
    for n in names:
        getattr(model[0], n).main_grad = attached[n]  # Megatron attaches views into its flat buffer
        if megatron:
            getattr(model[0], n).grad_added_to_main_grad = False  # [Note: the fused .grad contract]
    x = torch.randn(8, H, dtype=dtype)
    per_use = _per_use(model, x, microbatches=2)
    _run(model, x, microbatches=2, backward_dw_order=(1, 0))
    for n in names:
        w = getattr(model[0], n)
        assert w.main_grad is attached[n]
        assert getattr(w, "grad_added_to_main_grad", None) is (True if megatron else None)
        expected = torch.full(w.shape, 0.5)
        for mb in per_use:  # autograd runs module 1's backward first; the drain order is (1, 0)
            for i in (1, 0):
                expected += mb[i][n].float()
        assert torch.equal(attached[n], expected), n
        assert torch.equal(w.grad, torch.zeros_like(w)) if megatron else w.grad is None
    assert getattr(model[0].layer_norm_weight, "main_grad", None) is None  # the norm is never fused


def test_one_backward_dw_drains_one_backward_fc2_then_fc1(monkeypatch):
    from distwgrad.nn import layernorm_mlp

    mlp = _one("mlp", delay=True, bias=True, dtype=torch.float32)
    seen, fired = [], []
    real = layernorm_mlp._linear_wgrad
    monkeypatch.setattr(layernorm_mlp, "_linear_wgrad",
                        lambda x, dy, w, *a: seen.append(w is mlp.fc2_weight and "fc2" or "fc1") or real(x, dy, w, *a))
    mlp.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(mlp.fc1_weight.grad is not None))
    for _ in range(2):
        mlp(torch.randn(4, H)).sum().backward()
    assert mlp.pending_backward_dw == 2 and seen == []
    assert all(getattr(mlp, n).grad is None for n in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"))
    assert mlp.layer_norm_weight.grad is not None  # the norm's gradient comes from the main backward
    mlp.backward_dw()
    assert seen == ["fc2", "fc1"] and fired == [True] and mlp.pending_backward_dw == 1
    mlp.backward_dw()
    assert fired == [True, True]
    with pytest.raises(DeferredWgradError, match=r"LayerNormMLP\(16, 24\).*no deferred wgrad queued"):
        mlp.backward_dw()
    with pytest.raises(DeferredWgradError, match=r"LayerNormLinear\(16, 16\).*no deferred wgrad queued"):
        LayerNormLinear(H, H, delay_wgrad_compute=True).backward_dw()
    LayerNormMLP(H, FFN).backward_dw()  # a module that does not defer: a no-op, as in TransformerEngine


@pytest.mark.parametrize("kind", KINDS)
def test_skip_backward_post_hook_marks_the_deferred_parameters_only(kind):
    mod = _one(kind, delay=True, bias=True, dtype=torch.float32)
    mod(torch.randn(3, H)).sum().backward()
    for name, p in mod.named_parameters():
        assert getattr(p, "skip_backward_post_hook", False) is (not name.startswith("layer_norm")), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_recomputes_fc1_instead_of_saving_it(dtype):
    torch.manual_seed(0)
    results = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        mlp = _one("mlp", delay=True, bias=True, dtype=dtype, activation="swiglu", checkpoint=checkpoint)
        x = torch.randn(6, H, dtype=dtype, requires_grad=True)
        saved: list[tuple[int, ...]] = []

        def pack(t, saved=saved):
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mlp(x)
        y.float().square().sum().backward()
        mlp.backward_dw()
        results.append([x.grad] + [p.grad for p in mlp.parameters()])
        wide = [s for s in saved if s and s[-1] in (FFN, 2 * FFN)]
        assert bool(wide) is not checkpoint, saved
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_negative_control_assigning_backward_dw_is_caught(monkeypatch):
    """If a deferred contribution assigned ``.grad`` instead of adding, the tests above would fail."""
    from distwgrad.wgrad import accumulate

    def assign(param, grad):
        if grad is not None:
            param.grad = grad.detach().clone()

    monkeypatch.setattr(accumulate, "add_to_grad", assign)
    for kind in KINDS:
        with pytest.raises(AssertionError):
            test_tied_deferred_accumulates_every_use(kind, torch.float32, (0, 1), bias=True)
        with pytest.raises(AssertionError):
            test_microbatches_accumulate(kind, (0, 1), 2, tied=False)


def test_transformer_engine_conventions_and_errors():
    mlp = LayerNormMLP(H, FFN, return_bias=True, return_layernorm_output=True, init_method=torch.nn.init.zeros_)
    x = torch.randn(4, H)
    out, bias, ln_out = mlp(x)
    assert bias is mlp.fc2_bias and torch.equal(out, torch.zeros(4, H))  # fc2's bias returned, not added
    assert torch.equal(ln_out, F.layer_norm(x, (H,)))
    lin = LayerNormLinear(H, 4, return_layernorm_output=True)
    assert len(lin(x)) == 2 and len(LayerNormLinear(H, 4, return_bias=True, return_layernorm_output=True)(x)) == 3
    with pytest.raises(ValueError, match="activation must be one of"):
        LayerNormMLP(H, FFN, activation="tanh")
    with pytest.raises(ValueError, match="normalization must be one of"):
        LayerNormLinear(H, 4, normalization="BatchNorm")
    with pytest.raises(NotImplementedError, match="tensor parallelism is not implemented"):
        LayerNormMLP(H, FFN, tp_size=2)
    with pytest.raises(NotImplementedError, match="tensor parallelism is not implemented"):
        LayerNormLinear(H, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"fc1_weight has full shape \(3, 3\), expected \(24, 16\)"):
        mlp.fc1_weight = torch.nn.Parameter(torch.zeros(3, 3))
        mlp(x)
    with pytest.raises(TypeError, match="input dtype torch.bfloat16"):
        LayerNormMLP(H, FFN)(x.bfloat16())


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("delay", [False, True])
def test_mixed_precision_fcs_match_the_cast_inside_autograd_oracle(activation, delay):
    """fc1 / fc2 as ``ShardedWeight``s with fp32 masters and ``param_dtype=bf16`` (one rank): the module
    computes in bf16 and the fp32 ``.grad`` equals plain autograd through ``w.to(torch.bfloat16)`` bit for
    bit (each product rounded once to bf16, then one fp32 add into a zeroed main_grad, as autograd's cast
    back to fp32 does: [Note: mixed precision] in distwgrad/weights/base.py)."""
    import distwgrad
    from distwgrad import ShardedWeight

    torch.manual_seed(0)
    mlp = LayerNormMLP(H, 2 * H, activation=activation, bias=True, params_dtype=torch.bfloat16,
                       delay_wgrad_compute=delay)
    masters = {n: torch.randn(getattr(mlp, n).shape) / 4 for n in ("fc1_weight", "fc2_weight")}
    for n, w in masters.items():
        setattr(mlp, n, ShardedWeight.from_full(w, param_dtype=torch.bfloat16))
    x = torch.randn(6, H, dtype=torch.bfloat16)
    mlp(x).float().square().sum().backward()
    if delay:
        mlp.backward_dw()
    distwgrad.finalize_model_grads(mlp)

    leaves = {n: w.clone().requires_grad_() for n, w in masters.items()}
    norm = F.layer_norm(x, (H,), mlp.layer_norm_weight.detach(), mlp.layer_norm_bias.detach(), mlp.eps)
    h = F.linear(norm, leaves["fc1_weight"].to(torch.bfloat16), mlp.fc1_bias.detach())
    y = F.linear(_oracle_act(activation, h), leaves["fc2_weight"].to(torch.bfloat16), mlp.fc2_bias.detach())
    y.float().square().sum().backward()
    for n, leaf in leaves.items():
        ours = getattr(mlp, n)
        assert ours.dtype == torch.float32 and ours.grad.dtype == torch.float32
        assert torch.equal(ours.grad, leaf.grad), (n, (ours.grad - leaf.grad).abs().max())
