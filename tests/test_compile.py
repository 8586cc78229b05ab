"""``torch.compile(module, fullgraph=True)`` of Linear, GroupedLinear and LayerNormMLP: [Note: torch.compile].

Each case runs the same two steps on an eager model and on a compiled deep copy (forward, backward,
deferred wgrads drained by ``backward_dw()``, ``finalize_model_grads`` where a distributed weight is
present) and requires every gradient (input, ``.grad``, ``main_grad``) to be bit-equal. A compile costs
seconds on a CPU, so the default run takes a covering sample (both backends, every module and route at
least once); the rest of the grid carries the ``full`` marker.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import distwgrad.nn as dnn
from distwgrad import ShardedWeight, finalize_model_grads
from distwgrad.fp8.recipe import PerTensorScaling, fp8_autocast
from distwgrad.nn import _compiled
from distwgrad.weights.base import MissingContributionError

E, T, K, N = 3, 10, 8, 6
SPLITS = [4, 0, 6]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (the grid would otherwise pile up on one code object's recompiles)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    out = {"input": x.grad}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = p.grad
        out[f"{name}.main_grad"] = getattr(p, "main_grad", None)
    return out


def _assert_bit_equal(eager: dict, compiled: dict) -> None:
    assert eager.keys() == compiled.keys()
    for name, g in eager.items():
        h = compiled[name]
        assert (g is None) == (h is None), name
        if g is not None:
            assert g.dtype == h.dtype and torch.equal(g, h), f"{name}: max diff {(g.float() - h.float()).abs().max()}"


def _step(model, run, x, extra, finalize: bool) -> dict:
    loss = run(x, *extra).float().square().sum()
    loss.backward()
    for m in model.modules():
        if isinstance(m, dnn.Linear | dnn.GroupedLinear | dnn.LayerNormMLP):
            while m.pending_backward_dw:
                m.backward_dw()
    if finalize:
        finalize_model_grads(model)
    return _grads(model, x)


def _compare(model: nn.Module, inputs, *, backend: str = "aot_eager", finalize: bool = False,
             steps: int = 2) -> None:
    """Eager ``model`` against ``torch.compile`` of a deep copy, ``steps`` steps, every gradient bit-equal."""
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True, backend=backend)
    for step in range(steps):
        x, extra = inputs(step)
        xc = x.detach().clone().requires_grad_(x.requires_grad)
        _assert_bit_equal(_step(model, model, x, extra, finalize), _step(twin, compiled, xc, extra, finalize))


def _x(dtype=torch.float32, shape=(2, 5, K)):
    def inputs(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(shape, generator=g).to(dtype).requires_grad_(), ()
    return inputs


class _Tied(nn.Module):
    """Two Linears sharing one weight, used in sequence: two contributions per step."""

    def __init__(self, weight: torch.Tensor, **kw) -> None:
        super().__init__()
        self.a = dnn.Linear(K, K, bias=False, weight=weight, **kw)
        self.b = dnn.Linear(K, K, weight=self.a.weight, **kw)

    def forward(self, x):
        return self.b(self.a(x))


class _Experts(nn.Module):
    def __init__(self, splits, **kw) -> None:
        super().__init__()
        self.gl = dnn.GroupedLinear(E, K, N, **kw)
        self.splits = splits

    def forward(self, x):
        return self.gl(x, self.splits)


def _linear_case(bias, delay, fuse, dtype):
    torch.manual_seed(0)
    return dnn.Linear(K, N, bias=bias, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse, params_dtype=dtype)


# --- the covering sample: each line one compile -----------------------------------------------------
def test_linear_aot_eager_no_graph_breaks():
    model = _linear_case(True, False, False, torch.float32)
    explain = torch._dynamo.explain(copy.deepcopy(model))(torch.randn(2, 5, K))
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    _compare(model, _x())


def test_linear_inductor_bf16_no_bias_deferred():
    _compare(_linear_case(False, True, False, torch.bfloat16), _x(torch.bfloat16), backend="inductor")


def test_grouped_linear_discrete_list_splits_deferred():
    torch.manual_seed(0)
    model = _Experts(SPLITS, delay_wgrad_compute=True)
    explain = torch._dynamo.explain(copy.deepcopy(model))(torch.randn(T, K))
    assert explain.graph_break_count == 0, explain.break_reasons
    _compare(model, _x(shape=(T, K)))


def test_grouped_linear_packed_tensor_splits_fused_inductor():
    torch.manual_seed(0)
    model = _Experts(torch.tensor(SPLITS), single_grouped_weight=True, fuse_wgrad_accumulation=True)
    _compare(model, _x(shape=(T, K)), backend="inductor")


def test_layernorm_mlp_deferred_fused():
    torch.manual_seed(0)
    model = dnn.LayerNormMLP(K, 2 * K, delay_wgrad_compute=True, fuse_wgrad_accumulation=True,
                             activation="swiglu")
    explain = torch._dynamo.explain(copy.deepcopy(model))(torch.randn(2, 5, K))
    assert explain.graph_break_count == 0, explain.break_reasons
    _compare(model, _x())


def test_tied_sharded_weight_deferred_finalize():
    """A ShardedWeight on a one-rank group tied between two Linears, deferred, finalized each step."""
    torch.manual_seed(0)
    weight = ShardedWeight.from_full(torch.randn(K, K) / K**0.5)
    model = _Tied(weight, delay_wgrad_compute=True)
    assert model.a.weight is model.b.weight
    _compare(model, _x(), finalize=True)


def test_accounting_counts_every_compiled_contribution():
    """A dropped compiled graph withdraws its use; an undrained deferred wgrad refuses to finish; after
    draining, finalize_model_grads works and the next step starts clean."""
    torch.manual_seed(0)
    model = dnn.Linear(K, N, weight=ShardedWeight.from_full(torch.randn(N, K)), delay_wgrad_compute=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(torch.randn(4, K))
    assert model.weight.pending_contributions == 1
    del out  # the graph is freed without a backward: the use is withdrawn
    assert model.weight.pending_contributions == 0
    compiled(torch.randn(4, K)).sum().backward()
    assert model.pending_backward_dw == 1 and model.weight.pending_contributions == 1
    with pytest.raises(RuntimeError, match="never drained"):
        finalize_model_grads(model)
    with pytest.raises(MissingContributionError, match="0 of 1 gradient contributions"):
        model.weight.finish_step()
    model.backward_dw()
    assert finalize_model_grads(model) == 1 and model.weight.grad is not None
    compiled(torch.randn(4, K)).sum().backward()
    model.backward_dw()
    assert finalize_model_grads(model) == 1


def test_checks_and_retained_graphs_as_in_eager():
    """The module's own checks run inside the op (its error, not a tracing error); a retained graph's
    second backward delivers once more."""
    model = dnn.Linear(K, N)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(TypeError, match=r"Linear\(8, 6\): input dtype torch.float64"):
        compiled(torch.randn(3, K, dtype=torch.float64))
    y = compiled(torch.randn(3, K, requires_grad=True))
    y.sum().backward(retain_graph=True)
    first = model.weight.grad.clone()
    y.sum().backward()
    assert torch.equal(model.weight.grad, first + first)


def test_layers_of_one_configuration_share_one_graph():
    """The module handle is a tensor input, not a constant: ten layers compile once, not ten times."""
    torch.manual_seed(0)
    layers = [dnn.Linear(K, K) for _ in range(10)]
    with torch._dynamo.config.patch(recompile_limit=1):
        x = torch.randn(4, K, requires_grad=True)
        for layer in layers:
            torch.compile(layer, fullgraph=True, backend="aot_eager")(x).sum().backward()
    assert all(layer.weight.grad is not None for layer in layers)


def test_fp8_recipe_under_compile():
    """The recipe is read inside the op at run time, as in eager: FP8 (emulated on CPU) is bit-equal."""
    model = _linear_case(True, False, False, torch.float32)

    def fp8(module):
        def run(x):
            with fp8_autocast(PerTensorScaling()):
                return module(x)
        return run

    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, K, requires_grad=True)
    xc = x.detach().clone().requires_grad_()
    _assert_bit_equal(_step(model, fp8(model), x, (), False), _step(twin, fp8(compiled), xc, (), False))


def test_fp8_exempt_under_compile():
    """[Note: a module out of FP8]: under fp8_autocast a compiled exempt Linear is one graph and gives the bits
    of the eager Linear with FP8 off; the same compiled Linear not exempt does not (so the comparison can fail)."""
    model = _linear_case(True, False, False, torch.float32)
    exempt = copy.deepcopy(model)
    exempt.fp8_exempt = True
    twin = copy.deepcopy(model)

    def fp8(module):
        def run(x):
            with fp8_autocast(PerTensorScaling()):
                return module(x)
        return run

    explain = torch._dynamo.explain(copy.deepcopy(exempt))(torch.randn(2, 5, K))
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    x = torch.randn(2, 5, K, requires_grad=True)
    xe, xt = (x.detach().clone().requires_grad_() for _ in range(2))
    want = _step(model, model, x, (), False)
    _assert_bit_equal(want, _step(exempt, fp8(torch.compile(exempt, fullgraph=True, backend="aot_eager")), xe, (),
                                  False))
    quantized = _step(twin, fp8(torch.compile(twin, fullgraph=True, backend="aot_eager")), xt, (), False)
    assert not torch.equal(quantized["input"], want["input"])


def test_eager_modules_never_call_the_op(monkeypatch):
    """Outside torch.compile the modules call today's path directly ([Note: torch.compile])."""
    import distwgrad.nn._compiled as compiled_mod

    def refuse(*args, **kwargs):
        raise AssertionError("the eager path went through the custom op")

    for name in ("linear", "grouped_linear", "layernorm_mlp"):
        monkeypatch.setattr(f"distwgrad.nn.{name}.compiled_forward", refuse)
    assert compiled_mod.compiled_forward is not refuse
    dnn.Linear(K, N)(torch.randn(2, K)).sum().backward()
    dnn.GroupedLinear(E, K, N)(torch.randn(T, K), SPLITS).sum().backward()
    dnn.LayerNormMLP(K, 2 * K)(torch.randn(2, K)).sum().backward()


class _Counted:
    """An op overload whose ``redispatch`` is counted (the ops' Autograd kernels redispatch through it)."""

    def __init__(self, op) -> None:
        self.op, self.calls = op, 0

    def redispatch(self, *args):
        self.calls += 1
        return self.op.redispatch(*args)


class _PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_ops_run_directly_at_run_time_and_redispatch_elsewhere(monkeypatch):
    """[Note: the ops' run-time path]: a compiled graph's calls run the module without a redispatch; under
    a dispatch mode the same graph redispatches; both give eager's gradients bit for bit, and under fake
    tensors the op runs its fake implementation, never the module."""
    torch.manual_seed(0)
    model = nn.Sequential(dnn.Linear(K, K, delay_wgrad_compute=True), _Experts(SPLITS, bias=True))
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    x = torch.randn(T, K, requires_grad=True)
    _step(twin, compiled, x.detach().clone().requires_grad_(), (), False)  # compiles (traced: redispatches)
    for p in twin.parameters():
        p.grad = None
    fwd, bwd = _Counted(_compiled._FORWARD), _Counted(_compiled._BACKWARD)
    monkeypatch.setattr(_compiled, "_FORWARD", fwd)
    monkeypatch.setattr(_compiled, "_BACKWARD", bwd)
    want = _step(model, model, x, (), False)
    xc = x.detach().clone().requires_grad_()
    _assert_bit_equal(want, _step(twin, compiled, xc, (), False))
    assert (fwd.calls, bwd.calls) == (0, 0)
    lin = twin[0]  # the ops called by hand, as a graph calls them: without and with a dispatch mode

    def call():
        lin.weight.grad = lin.bias.grad = None
        with torch.no_grad():
            y, token = torch.ops.distwgrad.module_forward(x, [lin.weight, lin.bias], [], [], lin._op_handle, True,
                                                         [False, False], K)
            dx, _ = torch.ops.distwgrad.module_backward(token, torch.ones_like(y), [lin.weight, lin.bias],
                                                        list(x.shape), True, [False, False])
        lin.backward_dw()
        return y, dx, lin.weight.grad.clone(), lin.bias.grad.clone()

    direct = call()
    assert (fwd.calls, bwd.calls) == (0, 0)
    with _PassThrough():
        dispatched = call()
    assert (fwd.calls, bwd.calls) == (1, 1)
    for a, b in zip(direct, dispatched):
        assert torch.equal(a, b)

    def refuse(*args):
        raise AssertionError("the op ran the module on fake tensors")

    monkeypatch.setattr(_compiled, "module_forward", refuse)
    with torch._subclasses.FakeTensorMode() as mode, torch.no_grad():
        lin = model[0]
        y, token = torch.ops.distwgrad.module_forward(mode.from_tensor(x), [mode.from_tensor(lin.weight)], [], [],
                                                     mode.from_tensor(lin._op_handle), False, [False], K)
    assert isinstance(y, torch._subclasses.FakeTensor) and y.shape == (T, K) and token.shape == (1,)


class _Chain(nn.Module):
    """Three deferred Linears with pointwise work between them: inductor's buffers of one size, each dead
    to the graph once the next op has read it."""

    def __init__(self, d: int):
        super().__init__()
        self.a, self.b, self.c = (dnn.Linear(d, d, delay_wgrad_compute=True) for _ in range(3))

    def forward(self, x):
        h = self.a(F.gelu(x * 1.5))
        h = self.b(torch.tanh(h) * 2)
        return self.c(torch.sigmoid(h) + h)


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")  # the cache switched off, as intended
def test_inductor_keeps_what_the_ops_hold():
    """[Note: op inputs that outlive the op]: the saved activations and a deferred wgrad's ``dy`` live past the
    ops' calls; inductor, left to its memory planning, reused their buffers (gradients 1.16 of their largest
    entry off). Compiled and eager gradients now differ by the reordered fp32 sums (measured 1.8e-7
    relative; bound 1e-4). Inductor's cache is off: a graph cached by another build must not stand in."""
    import torch._inductor.config

    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _Chain(64)
        x = torch.randn(32, 64, requires_grad=True)
        with torch._inductor.config.patch(force_disable_caches=True):
            (torch.compile(model) if compiled else model)(x).square().sum().backward()
        for m in (model.a, model.b, model.c):
            while m.pending_backward_dw:
                m.backward_dw()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert ((grads[1][name] - g).abs().max() / g.abs().max()).item() < 1e-4, name


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("sharded", [False, True])
def test_embedding_compiles_around_a_graph_break(sharded):
    """docs/architecture.md: ``Embedding``'s use records break the graph (``fullgraph=True`` is refused);
    compiled around that, its gradients over two steps are eager's, bit for bit, a ShardedWeight's counted
    and finalized each step. The objects dynamo builds and drops at the break raise nothing when freed."""
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        weight = torch.randn(50, 16)
        emb = dnn.Embedding(50, 16, weight=ShardedWeight.from_full(weight) if sharded else weight)
        run = torch.compile(emb, backend="aot_eager") if compiled else emb
        ids = torch.randint(50, (4, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            run(ids).square().sum().backward()
            if sharded:
                assert finalize_model_grads([emb]) == 1
        grads.append(emb.weight.grad)
        gc.collect()
    assert torch.equal(grads[0], grads[1])
    torch._dynamo.reset()  # else the frames compiled above, with their break, serve the call below
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(dnn.Embedding(50, 16), backend="aot_eager", fullgraph=True)(ids)


def test_lowering_registration_is_marked_as_dynamo_marks_it():
    """``_compiled._lowering_registered`` carries the mark ``torch.compiler.assume_constant_result`` sets (set
    by hand: the decorator imports dynamo): dynamo runs it while tracing instead of tracing into it
    ([Note: op inputs that outlive the op])."""
    def probe():
        return True

    marked = torch.compiler.assume_constant_result(probe)
    assert [k for k in vars(marked) if k.startswith("_dynamo")] == ["_dynamo_marked_constant"]
    assert _compiled._lowering_registered._dynamo_marked_constant is True


# --- the rest of the grid ---------------------------------------------------------------------------
@pytest.mark.full
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("bias,delay,fuse,dtype", [
    (True, True, True, torch.float32), (False, False, True, torch.float32), (True, False, False, torch.bfloat16),
    (True, True, False, torch.float32)])
def test_linear_grid(backend, bias, delay, fuse, dtype):
    _compare(_linear_case(bias, delay, fuse, dtype), _x(dtype), backend=backend)


@pytest.mark.full
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tensor_splits", [False, True])
@pytest.mark.parametrize("delay,fuse", [(False, False), (True, True)])
def test_grouped_linear_grid(packed, tensor_splits, delay, fuse):
    torch.manual_seed(0)
    splits = torch.tensor(SPLITS) if tensor_splits else SPLITS
    model = _Experts(splits, single_grouped_weight=packed, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
    _compare(model, _x(shape=(T, K)))


@pytest.mark.full
@pytest.mark.parametrize("delay", [False, True])
def test_sharded_weights_in_every_module(delay):
    torch.manual_seed(0)
    mlp = dnn.LayerNormMLP(K, 2 * K, delay_wgrad_compute=delay)
    mlp.fc1_weight = ShardedWeight.from_full(mlp.fc1_weight.detach())
    mlp.fc2_weight = ShardedWeight.from_full(mlp.fc2_weight.detach(), param_dtype=None)
    _compare(mlp, _x(), finalize=True)
    experts = _Experts(SPLITS, single_grouped_weight=True, delay_wgrad_compute=delay)
    experts.gl.weight = ShardedWeight.from_full(experts.gl.weight.detach())
    _compare(experts, _x(shape=(T, K)), finalize=True)


@pytest.mark.full
def test_layernorm_linear():
    torch.manual_seed(0)
    _compare(dnn.LayerNormLinear(K, N, delay_wgrad_compute=True, normalization="RMSNorm"), _x())


@pytest.mark.full
def test_tied_plain_weight_bf16_sharded_param_dtype():
    torch.manual_seed(0)
    _compare(_Tied(nn.Parameter(torch.randn(K, K) / K**0.5)), _x())
    weight = ShardedWeight.from_full(torch.randn(K, K) / K**0.5, param_dtype=torch.bfloat16)
    _compare(_Tied(weight, delay_wgrad_compute=True), _x(torch.bfloat16), finalize=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_op_outputs_are_aligned_for_inductor():
    """[Note: aligned op outputs]: both ops' outputs, and what attention's backward computes from them, are
    16-byte aligned buffers in inductor's code (the handle and the token live on the GPU)."""
    from torch._inductor.utils import run_fw_bw_and_get_code

    torch.manual_seed(0)
    a = dnn.Linear(256, 3 * 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    b = dnn.Linear(256, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")

    def block(x):
        q, k, v = a(x).view(2, 128, 3, 4, 64).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return b(y.transpose(1, 2).reshape(2, 128, 256))

    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)
    _, codes = run_fw_bw_and_get_code(lambda: compiled(x).float().sum())
    assert a._op_handle.device.type == "cuda"
    forward, backward = codes[0], codes[-1]
    assert "distwgrad.module_forward" in forward and "distwgrad.module_backward" in backward
    unaligned = [line.strip() for code in (forward, backward) for line in code.splitlines()
                 if "is assumed to be not aligned" in line]
    assert not unaligned, unaligned


def test_op_handle_follows_the_parameters():
    """[Note: aligned op outputs]: the handle moves with the module, and a copy gets its own."""
    lin = dnn.Linear(K, N, bias=False, device="meta")
    assert lin._op_handle.device.type == "cpu"  # a meta module's handle stays on the CPU
    lin = dnn.Linear(K, N, bias=False, device="cpu")
    handle = lin._op_handle
    twin = copy.deepcopy(lin)
    assert twin._op_handle.data_ptr() != handle.data_ptr()
    assert _compiled._module(twin._op_handle) is twin and _compiled._module(handle) is lin
    if torch.cuda.is_available():
        lin.cuda()
        assert lin._op_handle.device.type == "cuda" and _compiled._module(lin._op_handle) is lin
