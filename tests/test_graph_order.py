"""Capture in a pipeline schedule's order (``make_graphed_callables(..., _order=, _num_layers_per_chunk=)``,
[Note: capture in schedule order]): the order's bookkeeping on its own, and the capture and replay wiring with
CUDA modelled on the CPU (``tests/test_graphs.py``'s ``modelled_cuda``: graphs record nothing, captures run
eagerly once); the replays' numbers are the GPU tests' (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import pytest
import torch
from test_graphs import _ModelGraph, _x, modelled_cuda  # noqa: F401  the fixture

import distwgrad
from distwgrad import graphs
from distwgrad.graph_order import plan_order
from distwgrad.nn import Linear

# Two chunks of one layer each over two microbatches, as an interleaved 1F1B schedule runs them on one rank:
# chunk 1 twice forward, chunk 2 forward and backward per microbatch, chunk 1 twice backward.
ORDER = [1, 1, 2, -2, 2, -2, -1, -1]


def test_plan_follows_the_order_chunk_by_chunk():
    plan = plan_order(ORDER, None, modules=2, samples=4)
    assert (plan.microbatches, plan.layers, plan.forward_passes) == (2, (1, 1), 4)
    # forward pass index: chunk-major, then microbatch, then layer
    assert [plan.index(c, m, 0) for c in (0, 1) for m in (0, 1)] == [0, 1, 2, 3]
    assert [plan.module_of(i) for i in range(4)] == [0, 0, 1, 1]
    assert plan.captures == (("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 2), ("fwd", 3), ("bwd", 3),
                             ("bwd", 0), ("bwd", 1))


def test_plan_with_uneven_chunks_runs_a_chunks_layers_backward_in_reverse():
    plan = plan_order([1, 2, -2, -1], [2, 1], modules=3, samples=3)
    assert plan.layers == (2, 1) and [plan.module_of(i) for i in range(3)] == [0, 1, 2]
    assert plan.captures == (("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 2), ("bwd", 1), ("bwd", 0))
    assert plan_order([1, -1, 1, -1], 2, modules=2, samples=4).captures == (
        ("fwd", 0), ("fwd", 1), ("bwd", 1), ("bwd", 0), ("fwd", 2), ("fwd", 3), ("bwd", 3), ("bwd", 2))


@pytest.mark.parametrize(("order", "layers", "modules", "samples", "match"), [
    ([], None, 1, 1, "_order must be a non-empty list of nonzero ints"),
    ([1, 0, -1], None, 1, 1, "_order must be a non-empty list of nonzero ints"),
    ([1, 2, -1], None, 2, 2, "_order has 3 entries, not a multiple of 2 x 2 chunks"),
    ([1, 1, -1, 2], None, 2, 2, "_order has chunk 1 2 times forward and 1 times backward; each chunk runs 1"),
    ([1, 2, -2, -1], None, 2, 3, "3 sample_args for 2 chunks x 1 microbatches; pass _num_layers_per_chunk"),
    ([1, 2, -2, -1], [1], 2, 2, r"_num_layers_per_chunk must be an int > 0 or 2 of them .*got \[1\]"),
    ([1, 2, -2, -1], 1, 3, 2, r"3 modules for chunks of \[1, 1\] layers; pass 2"),
    ([1, 2, -2, -1], [1, 2], 3, 4, "4 sample_args; _order needs one per forward pass, 3 layers x 1 microbatches"),
    ([-1, 1], None, 1, 1, "runs the backward of chunk 1's microbatch 0 before its forward"),
])
def test_bad_orders_are_refused_naming_the_value(order, layers, modules, samples, match):
    with pytest.raises(ValueError, match=match):
        plan_order(order, layers, modules=modules, samples=samples)


def test_the_order_is_checked_before_anything_needs_cuda():
    with pytest.raises(ValueError, match="_order has chunk 1 2 times forward and 0 times backward"):
        distwgrad.make_graphed_callables((Linear(4, 4, device="cpu"),), ((_x(2, 4),),), _order=[1, 1])
    with pytest.raises(ValueError, match=r"_num_layers_per_chunk=\[2\] without _order"):
        distwgrad.make_graphed_callables(Linear(4, 4, device="cpu"), (_x(2, 4),), _num_layers_per_chunk=[2])


def _recorder(captured: list, kind: str, real):
    def record(gs, c, i, *rest):
        captured.append((kind, i))
        return real(gs, c, i, *rest)
    return record


@pytest.mark.usefixtures("modelled_cuda")
def test_capture_and_replay_follow_the_schedule(monkeypatch):
    torch.manual_seed(0)
    a, b = (Linear(8, 8, device="cpu", delay_wgrad_compute=True) for _ in range(2))
    captured = []
    for kind, name in (("fwd", "_capture_forward"), ("bwd", "_capture_backward")):
        monkeypatch.setattr(graphs, name, _recorder(captured, kind, getattr(graphs, name)))
    xs = [_x(4, 8, requires_grad=True) for _ in range(4)]  # (chunk 1, mb 0), (1, 1), (2, 0), (2, 1)
    fns = distwgrad.make_graphed_callables((a, b), tuple((x,) for x in xs), _order=ORDER)
    assert captured == list(plan_order(ORDER, None, 2, 4).captures)
    assert len(fns) == 4 and all(callable(f) and callable(f.reset) for f in fns)
    assert "forward" not in vars(a) and "forward" not in vars(b), "the modules' own forward is untouched"
    assert a.pending_backward_dw == b.pending_backward_dw == 0 and all(p.grad is None for p in a.parameters())
    # the schedule: chunk 1 forward for both microbatches, then chunk 2 forward and backward per microbatch
    h0, h1 = fns[0](xs[0]), fns[1](xs[1])
    fns[2](h0).sum().backward()
    assert (a.pending_backward_dw, b.pending_backward_dw) == (1, 1)
    fns[3](h1).sum().backward()  # another forward pass's buffers: allowed while microbatch 0's wgrads wait
    assert (a.pending_backward_dw, b.pending_backward_dw) == (2, 2)
    with pytest.raises(distwgrad.DeferredWgradError, match="still queued; a forward replay overwrites"):
        fns[2](h0)  # its own buffers, which its queued wgrad still reads
    distwgrad.drain_deferred_wgrads([a, b])
    assert a.pending_backward_dw == b.pending_backward_dw == 0
    assert all(p.grad is not None for p in (a.weight, b.weight))
    fns[2](h0.detach())  # drained: the forward pass replays again
    fns[0].reset()
    with pytest.raises(RuntimeError, match=r"were reset\(\)"):
        fns[1](xs[1])


@pytest.mark.usefixtures("modelled_cuda")
def test_every_backward_queues_its_own_wgrad_graph():
    """Two microbatches of one layer: two deferred wgrad graphs, one per forward pass, replayed FIFO."""
    m = Linear(8, 8, device="cpu", delay_wgrad_compute=True)
    xs = [_x(4, 8) for _ in range(2)]
    f0, f1 = distwgrad.make_graphed_callables((m,), ((xs[0],), (xs[1],)), _order=[1, 1, -1, -1])
    replays = []
    for graph in (_ModelGraph,):
        original = graph.replay
        graph.replay = lambda self, _o=original: (replays.append(id(self)), _o(self))[1]
    try:
        f0(xs[0]).sum().backward()
        f1(xs[1]).sum().backward()
        m.backward_dw()
        m.backward_dw()
    finally:
        _ModelGraph.replay = original
    # forward 0, forward 1, backward 0, backward 1, then the two wgrad graphs: six distinct graphs
    assert len(replays) == 6 and len(set(replays)) == 6


@pytest.mark.usefixtures("modelled_cuda")
@pytest.mark.parametrize("with_order", [False, True])
def test_capture_time_hooks_run_around_each_warmup_and_capture_step_and_never_replay(with_order):
    """TE's ``capture_time_hooks``: per module, around its forward and backward in every warm-up iteration
    and at capture, in the schedule's order (forwards, then backwards in reverse), outside the capture."""
    mods = (Linear(8, 8, device="cpu"), Linear(8, 8, device="cpu"))
    records = []

    def hook(i, kind):
        def record(module):
            assert module is mods[i]
            records.append((i, kind))
        return record

    hooks = [{kind: {0: hook(i, kind)} for kind in ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks",
                                                    "backward_hooks")} for i in range(2)]
    fns = distwgrad.make_graphed_callables(mods, tuple((_x(4, 8, requires_grad=True),) for _ in mods),
                                           num_warmup_iters=2, _order=[1, 2, -2, -1] if with_order else None,
                                           capture_time_hooks=hooks)
    one = [(0, "forward_pre_hooks"), (0, "forward_hooks"), (1, "forward_pre_hooks"), (1, "forward_hooks"),
           (1, "backward_pre_hooks"), (1, "backward_hooks"), (0, "backward_pre_hooks"), (0, "backward_hooks")]
    assert records == one * 3  # two warm-up iterations, then the capture
    for f in fns:
        f(_x(4, 8, requires_grad=True)).sum().backward()
    assert records == one * 3, "a replay ran a capture-time hook"


@pytest.mark.usefixtures("modelled_cuda")
@pytest.mark.parametrize(("hooks", "error", "match"), [
    ([{}], ValueError, r"one entry per module \(2\)"),
    ([{"forward_hook": {}}, None], ValueError, r"capture_time_hooks\[0\] must be a dict with keys from"),
    ([None, {"forward_hooks": {0: "f"}}], TypeError, r"capture_time_hooks\[1\]\['forward_hooks'\] must be a dict"),
    ([{"forward_hooks": {7: lambda m: 1}}, None], RuntimeError,
     r"capture_time_hooks\[0\]\['forward_hooks'\]\[7\] returned 1; a capture-time hook must return None"),
])
def test_capture_time_hooks_bad_input(hooks, error, match):
    mods = (Linear(8, 8, device="cpu"), Linear(8, 8, device="cpu"))
    with pytest.raises(error, match=match):
        distwgrad.make_graphed_callables(mods, tuple((_x(4, 8),) for _ in mods), capture_time_hooks=hooks)


@pytest.mark.usefixtures("modelled_cuda")
def test_reuse_of_buffers_in_an_order_is_accepted_and_each_pass_keeps_its_own():
    m = Linear(8, 8, device="cpu", delay_wgrad_compute=True)
    xs = [_x(4, 8) for _ in range(2)]
    with pytest.warns(UserWarning, match="shares no buffer"):
        f0, f1 = distwgrad.make_graphed_callables((m,), ((xs[0],), (xs[1],)), _order=[1, 1, -1, -1],
                                                 _reuse_graph_input_output_buffers=True)
    y0, y1 = f0(xs[0]), f1(xs[1])
    assert y0.data_ptr() != y1.data_ptr(), "each forward pass keeps its own static output"
