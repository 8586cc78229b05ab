"""``distwgrad.make_graphed_callables`` on CPU: argument checks, refusals, and the replay bookkeeping.

The GPU tests (``tests/test_cuda_graphs.py``) compare graph replay with eager runs. Here nothing is
captured: the validation and the refusals run before any CUDA work, and the bookkeeping tests model a
CUDA graph whose capture runs its body once, eagerly, and whose replay does nothing
([Note: graphed deferred wgrads] in ``distwgrad/graphs.py``): they check what is queued, refused and
released, never gradient values.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distwgrad
from distwgrad import graphs
from distwgrad.nn import GroupedLinear, Linear


def _x(*shape, requires_grad=False):
    return torch.randn(*shape, requires_grad=requires_grad)


# --- validation, before CUDA --------------------------------------------------------------------------
def test_modules_must_be_modules():
    with pytest.raises(TypeError, match=r"nn.Modules; got \['0: function'\]"):
        distwgrad.make_graphed_callables(lambda x: x, (_x(2, 4),))


def test_empty_tuple_of_modules():
    with pytest.raises(ValueError, match="empty tuple"):
        distwgrad.make_graphed_callables((), ())


def test_sample_args_one_per_module():
    mods = (Linear(4, 4), Linear(4, 4))
    with pytest.raises(TypeError, match=r"sample_args must be a tuple per module \(a tuple of 2\), got \['tuple'\]"):
        distwgrad.make_graphed_callables(mods, ((_x(2, 4),),))
    with pytest.raises(TypeError, match="sample_args must be a tuple, got list"):
        distwgrad.make_graphed_callables(Linear(4, 4), [_x(2, 4)])


# resolve_options' keywords, each at its default
_NO_OPTIONS = dict(num_warmup_iters=3, enabled=None, fp8_enabled=None, recipe=None, fp8_recipe=None, calibrating=None,
                   fp8_calibrating=None, amax_reduction_group=None, fp8_group=None, cache_quantized_params=None,
                   fp8_weight_caching=None, _reuse_graph_input_output_buffers=False)


def test_sample_inputs_must_be_tensors():
    with pytest.raises(TypeError, match=r"sample inputs of module 0 must be tensors, got \['int'\]"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4), 3))


def test_sample_kwargs_shape():
    with pytest.raises(TypeError, match="sample_kwargs must be a dict, got list"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), sample_kwargs=[])


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_num_warmup_iters(bad):
    with pytest.raises(ValueError, match=f"num_warmup_iters must be an int >= 1.*got {bad!r}"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), num_warmup_iters=bad)


def test_fp8_options():
    recipe = distwgrad.fp8.PerTensorScaling()
    with pytest.raises(ValueError, match="fp8_recipe=PerTensorScaling.*fp8_enabled=False"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), fp8_recipe=recipe)
    with pytest.raises(TypeError, match="fp8_enabled must be a bool, got 1"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), fp8_enabled=1)


def test_reuse_of_buffers_needs_order_and_shares_nothing():
    """TE allows buffer reuse only in a pipeline order; distwgrad accepts it there and says it shares none."""
    with pytest.raises(ValueError, match="_reuse_graph_input_output_buffers=True without _order"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), _reuse_graph_input_output_buffers=True)
    from distwgrad.graph_options import GraphOptions, resolve_options

    none = {k: v for k, v in _NO_OPTIONS.items() if k != "_reuse_graph_input_output_buffers"}
    with pytest.warns(UserWarning, match="accepted but shares no buffer"):
        assert resolve_options(**none, _reuse_graph_input_output_buffers=True) == GraphOptions(3, False, None)


def test_te_keywords_in_both_spellings():
    """TE's new and old keyword names resolve to the same options; what distwgrad cannot do is refused by
    name (distwgrad/graph_options.py)."""
    from distwgrad.graph_options import GraphOptions, resolve_options

    recipe = distwgrad.fp8.PerTensorScaling()
    none = _NO_OPTIONS
    assert resolve_options(**none) == GraphOptions(3, False, None)
    with pytest.raises(ValueError, match="enabled=True and fp8_enabled=True are one option"):
        resolve_options(**{**none, "enabled": True, "fp8_enabled": True})
    with pytest.raises(ValueError, match="recipe=.* and fp8_recipe=.* are one option"):
        resolve_options(**{**none, "enabled": True, "recipe": recipe, "fp8_recipe": recipe})
    want = GraphOptions(3, True, recipe)
    assert resolve_options(**{**none, "enabled": True, "recipe": recipe}) == want
    assert resolve_options(**{**none, "fp8_enabled": True, "fp8_recipe": recipe}) == want
    for cache in ("cache_quantized_params", "fp8_weight_caching"):  # [Note: fp8 weights kept in CUDA graphs]
        assert resolve_options(**{**none, cache: True}) == GraphOptions(3, False, None, cache_weights=True)
        assert resolve_options(**{**none, cache: False}) == GraphOptions(3, False, None)
    with pytest.raises(TypeError, match="cache_quantized_params must be a bool, got 'yes'"):
        resolve_options(**{**none, "cache_quantized_params": "yes"})
    for calibrating in ("calibrating", "fp8_calibrating"):
        with pytest.raises(ValueError, match="calibrating=True is delayed scaling's calibration"):
            distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), **{calibrating: True})
    for group in ("amax_reduction_group", "fp8_group"):
        with pytest.raises(ValueError, match="amax_reduction_group='g'.*pass None"):
            distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), **{group: "g"})
    # positional, in TE's order: num_warmup_iters, allow_unused_input, sample_kwargs, fp8_enabled
    with pytest.raises(ValueError, match="num_warmup_iters must be an int >= 1.*got 0"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), 0)


def test_te_signature_in_te_order():
    """TransformerEngine's make_graphed_callables keywords, in its order (transformer_engine/pytorch/graph.py)."""
    import inspect

    te_order = ["modules", "sample_args", "num_warmup_iters", "allow_unused_input", "sample_kwargs", "fp8_enabled",
                "fp8_calibrating", "fp8_recipe", "fp8_group", "fp8_weight_caching", "enabled", "calibrating",
                "recipe", "amax_reduction_group", "cache_quantized_params", "_order", "_num_layers_per_chunk",
                "pool", "retain_graph_in_backward", "_reuse_graph_input_output_buffers",
                "clone_param_grads_on_return", "pre_warmup_hook", "post_warmup_hook", "capture_time_hooks"]
    assert list(inspect.signature(distwgrad.make_graphed_callables).parameters) == te_order


def test_clone_and_warmup_hook_options():
    from distwgrad.graph_options import GraphOptions, resolve_options

    none = _NO_OPTIONS
    hook = print
    assert resolve_options(**none, clone_param_grads_on_return=False, pre_warmup_hook=hook,
                           post_warmup_hook=hook) == GraphOptions(3, False, None, False, hook, hook)
    with pytest.raises(TypeError, match="clone_param_grads_on_return must be a bool, got 0"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), clone_param_grads_on_return=0)
    with pytest.raises(TypeError, match="post_warmup_hook must be a callable or None, got 'h'"):
        distwgrad.make_graphed_callables(Linear(4, 4), (_x(2, 4),), post_warmup_hook="h")


def test_hooks_refused():
    m = Linear(4, 4)
    m.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"module 0 \(Linear\) has hooks registered"):
        distwgrad.make_graphed_callables(m, (_x(2, 4),))


def test_queued_deferred_wgrads_refused():
    m = Linear(4, 4, delay_wgrad_compute=True)
    m(_x(2, 4)).sum().backward()
    with pytest.raises(distwgrad.DeferredWgradError, match=r"Linear\(4, 4\).*1 queued.*drain them"):
        distwgrad.make_graphed_callables(m, (_x(2, 4),))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_no_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"needs a CUDA device \(torch.cuda.is_available\(\) is False\)"):
        distwgrad.make_graphed_callables(Linear(4, 4, delay_wgrad_compute=True), (_x(2, 4),))


@pytest.fixture
def gloo_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_gloo_refused_naming_the_backend(gloo_world):
    w = distwgrad.ShardedWeight.from_full(torch.randn(8, 4), group=gloo_world)
    m = Linear(4, 8, bias=False, weight=w, delay_wgrad_compute=True)
    with pytest.raises(RuntimeError, match=r"reduces over a 'gloo' process group; gloo collectives cannot be "
                                           r"captured"):
        distwgrad.make_graphed_callables(m, (_x(2, 4),))


def test_distributed_weight_options_refused():
    w = distwgrad.ShardedWeight.from_full(torch.randn(8, 4), async_reduce=True)
    with pytest.raises(ValueError, match="async_reduce=True"):
        distwgrad.make_graphed_callables(Linear(4, 8, bias=False, weight=w), (_x(2, 4),))
    w = distwgrad.ShardedWeight.from_full(torch.randn(8, 4), reduce_policy=distwgrad.ReducePolicy.PER_STEP)
    with pytest.raises(ValueError, match="reduce_policy=ReducePolicy.PER_STEP"):
        distwgrad.make_graphed_callables(Linear(4, 8, bias=False, weight=w), (_x(2, 4),))


def test_hand_made_capture_into_grad_still_refused(monkeypatch):
    """Outside ``graph_owned_gradients`` an add into ``.grad`` under capture is refused, pointing here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="make_graphed_callables"):
        distwgrad.wgrad.add_to_grad(p, torch.ones(3))
    sink: dict = {}
    with distwgrad.wgrad.accumulate.graph_owned_gradients(sink):
        distwgrad.wgrad.add_to_grad(p, torch.ones(3))
        distwgrad.wgrad.add_to_grad(p, torch.ones(3))
    assert p.grad is None and torch.equal(sink[id(p)][1], torch.full((3,), 2.0))


# --- bookkeeping under a modelled graph -----------------------------------------------------------------
class _ModelGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: counts replays; resets."""

    def __init__(self):
        self.replays, self.was_reset = 0, False

    def replay(self):
        assert not self.was_reset
        self.replays += 1

    def reset(self):
        self.was_reset = True


@pytest.fixture
def modelled_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _ModelGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(graphs, "check_devices", lambda *a: None)


def _two_layers(fuse=False):
    torch.manual_seed(0)
    kw = dict(device="cpu", delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)  # CUDA is modelled here
    return nn.Sequential(Linear(8, 8, **kw), Linear(8, 8, **kw))


def test_backward_queues_one_replay_per_deferred_module(modelled_cuda):
    model = _two_layers()
    x = _x(4, 8)
    graphed = distwgrad.make_graphed_callables(model, (x,))
    assert graphed is model and callable(graphed.reset)
    assert all(p.grad is None for p in model.parameters()), "warm-up and capture leave .grad alone"
    graphed(x).sum().backward()
    assert [m.pending_backward_dw for m in model] == [1, 1]
    with pytest.raises(distwgrad.DeferredWgradError, match=r"still queued; a forward replay overwrites"):
        graphed(x)
    assert distwgrad.drain_deferred_wgrads(model) == 2
    # the modelled replay wrote nothing, but each graph-owned gradient was cloned into .grad
    assert all(p.grad is not None for p in model.parameters())
    graphed(x).sum().backward()
    graphed.backward_dw()
    assert [m.pending_backward_dw for m in model] == [0, 0]


def test_per_module_schedule_returns_a_tuple(modelled_cuda):
    a, b = _two_layers()
    x = _x(4, 8, requires_grad=True)
    h = a(x).detach().requires_grad_()
    ga, gb = distwgrad.make_graphed_callables((a, b), ((x,), (h,)))
    assert (ga, gb) == (a, b)
    gb(ga(x)).sum().backward()
    assert (a.pending_backward_dw, b.pending_backward_dw) == (1, 1)
    b.backward_dw()
    a.backward_dw()


def test_reset_refuses_while_queued_then_releases(modelled_cuda):
    model = _two_layers()
    x = _x(4, 8)
    graphed = distwgrad.make_graphed_callables(model, (x,))
    graphed(x).sum().backward()
    with pytest.raises(distwgrad.DeferredWgradError, match="reset\\(\\): graphed deferred wgrads"):
        graphed.reset()
    distwgrad.drain_deferred_wgrads(model)
    graphed.reset()
    graphed.reset()  # idempotent
    with pytest.raises(RuntimeError, match=r"were reset\(\); their graphs and pool are gone"):
        graphed(x)


def test_replaced_main_grad_is_refused(modelled_cuda):
    model = _two_layers(fuse=True)
    x = _x(4, 8)
    mg = model[0].weight.main_grad = torch.zeros(8, 8)
    mg.fill_(3.0)
    graphed = distwgrad.make_graphed_callables(model, (x,))
    assert torch.equal(mg, torch.full((8, 8), 3.0)), "warm-up must leave main_grad as it was"
    assert model[1].weight.main_grad is not None, "created before capture, outside the graph"
    graphed(x).sum().backward()
    model[0].weight.main_grad = torch.zeros(8, 8)
    with pytest.raises(RuntimeError, match=r"Linear.weight.main_grad was replaced \(captured: \(8, 8\) "
                                           r"torch.float32 at 0x"):
        distwgrad.drain_deferred_wgrads(model)
    assert model[0].pending_backward_dw == 1, "the refused replay stays queued"
    model[0].weight.main_grad = mg
    distwgrad.drain_deferred_wgrads(model)


def test_a_graphed_distributed_weight_keeps_its_main_grad(modelled_cuda):
    """A weight's own ``main_grad`` (from an eager step before graphing) is kept once graphed: the graphs
    bake in its address, so the next step zeroes it in place ([Note: main_grad lifetime])."""
    w = distwgrad.ShardedWeight.from_full(torch.randn(8, 8))
    m = Linear(8, 8, bias=False, weight=w, delay_wgrad_compute=True)
    x = _x(4, 8)
    m(x).sum().backward()
    distwgrad.drain_deferred_wgrads(m)
    distwgrad.finalize_model_grads(m)
    kept, w.grad = w.main_grad, None
    graphed = distwgrad.make_graphed_callables(m, (x,))
    for _ in range(2):
        graphed(x).sum().backward()
        distwgrad.drain_deferred_wgrads(m)
        distwgrad.finalize_model_grads(m)
        w.grad = None
    assert w.main_grad is kept


def test_grouped_linear_and_training_state(modelled_cuda):
    torch.manual_seed(0)
    layer = GroupedLinear(2, 8, 8, device="cpu", delay_wgrad_compute=True)
    x, splits = _x(6, 8), torch.tensor([2, 4])
    graphed = distwgrad.make_graphed_callables(layer, (x, splits))
    graphed(x, splits).sum().backward()
    assert layer.pending_backward_dw == 1
    layer.backward_dw()
    layer.eval()  # another training state runs eagerly, as torch's graphed callables do
    with torch.no_grad():
        assert graphed(x, splits).shape == (6, 8)


def test_unused_parameter_refused(modelled_cuda):
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.spare = Linear(8, 8, device="cpu"), nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(ValueError, match=r"parameter 'spare' of module 0 requires grad but its forward does not"):
        distwgrad.make_graphed_callables(Unused(), (_x(4, 8),))
    distwgrad.make_graphed_callables(Unused(), (_x(4, 8),), allow_unused_input=True)


def test_uncloned_parameter_grads_are_never_kept_as_a_grad(modelled_cuda, monkeypatch):
    """``clone_param_grads_on_return=False``: autograd adds the static gradients into an existing ``.grad``,
    and a new ``.grad`` is a copy: kept, a static buffer would be rewritten by the next replay, and a
    ``zero_grad(set_to_none=False)`` gradient then added to itself."""
    made = []

    class Recording(graphs._Callable):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(graphs, "_Callable", Recording)
    m = Linear(4, 4, device="cpu")
    x = _x(3, 4, requires_grad=True)
    g = distwgrad.make_graphed_callables(m, (x,), clone_param_grads_on_return=False)
    for _ in range(3):
        m.zero_grad(set_to_none=False)
        g(x).sum().backward()
        static = [t for t in made[0].static_grad_inputs if t is not None]
        assert len(made[0].uncloned) == 2  # the weight's and the bias's, handed over uncloned
        for name, p in m.named_parameters():
            assert all(p.grad.data_ptr() != t.data_ptr() for t in static), f"{name}.grad is a static buffer"



def test_a_replay_that_keeps_weights_needs_is_first_microbatch(modelled_cuda):
    """With ``cache_quantized_params=True`` a replay takes TE's ``is_first_microbatch`` (or ``fp8.microbatch``'s);
    without, the keyword is accepted and changes nothing ([Note: fp8 weights kept in CUDA graphs])."""
    x = _x(4, 8)
    kept = distwgrad.make_graphed_callables(Linear(8, 8, device="cpu"), (x,), cache_quantized_params=True)
    with pytest.raises(TypeError, match="captured with cache_quantized_params=True .*pass is_first_microbatch=True"):
        kept(x)
    with pytest.raises(TypeError, match="is_first_microbatch must be True, False or None, got 1"):
        kept(x, is_first_microbatch=1)
    kept(x, is_first_microbatch=True)
    with distwgrad.fp8.microbatch(first=False):
        kept(x)
    plain = distwgrad.make_graphed_callables(Linear(8, 8, device="cpu"), (x,))
    plain(x)
    plain(x, is_first_microbatch=False)


class _Scaled(nn.Module):
    """A Linear and a buffer its forward reads."""

    def __init__(self):
        super().__init__()
        self.lin = Linear(8, 8, device="cpu")
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_parameter_or_buffer_replaced_after_the_capture_is_refused(modelled_cuda):
    """A replay reads the addresses its capture baked in, so writes in place go on replaying and a replaced
    parameter or buffer is refused by name ([Note: a graph reads captured addresses])."""
    torch.manual_seed(0)
    m, x = _Scaled(), _x(4, 8)
    graphed = distwgrad.make_graphed_callables(m, (x,))
    w = m.lin.weight
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    for _ in range(2):  # in place: an optimizer's step, a .data write, load_state_dict without assign
        graphed(x).sum().backward()
        opt.step()
        opt.zero_grad()
    w.data.copy_(torch.randn(8, 8))
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()})
    graphed(x)
    captured = w.data
    w.data = captured.clone()
    with pytest.raises(RuntimeError, match=r"graphed forward of module 0 \(_Scaled\): lin.weight was replaced after "
                                           r"the capture \(captured: \(8, 8\) torch.float32 at 0x[0-9a-f]+; now: "
                                           r"\(8, 8\) torch.float32 at 0x"):
        graphed(x)
    w.data = captured  # the captured storage again
    graphed(x)
    scale = m.scale
    m.scale = torch.full((8,), 2.0)  # another tensor under the buffer's name
    with pytest.raises(RuntimeError, match=r"\): scale was replaced after the capture .*now: another tensor, \(8,\) "):
        graphed(x)
    m.scale = scale
    graphed(x)
    m.lin.load_state_dict({k: v.clone() for k, v in m.lin.state_dict().items()}, assign=True)
    with pytest.raises(RuntimeError, match=r"lin.weight was replaced after the capture .*now: another tensor, "):
        graphed(x)
    m.eval()  # another training state runs eagerly: nothing captured is read
    with torch.no_grad():
        assert graphed(x).shape == (4, 8)
