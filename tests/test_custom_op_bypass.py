"""[Note: custom op bypass] (kernels/_dispatch.py): when the kernels' public functions may call a custom
op's implementation directly, and when they must go through the op. The kernels' own tests check that
both paths give the same bits (test_fp8_quantize_kernels.py ``case_opcheck``, test_grouped_gemm_kernels.py
``custom_ops``)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

_dispatch = pytest.importorskip("distwgrad.kernels._dispatch")
direct_call_ok, call = _dispatch.direct_call_ok, _dispatch.call


def test_plain_eager_tensors_call_the_implementation():
    x = torch.ones(3)
    assert direct_call_ok((x, None, 2, torch.float8_e4m3fn, [x, x]))


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
def test_tracing_modes_and_subclasses_go_through_the_op():
    x = torch.ones(3)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        assert not direct_call_ok((fx,))
    assert not direct_call_ok((x, [x, fx]))  # a subclass inside a list of tensors
    with torch.profiler.profile():
        assert not direct_call_ok((x,))
    seen = []
    torch.jit.trace(lambda t: seen.append(direct_call_ok((t,))) or t * 2, x, check_trace=False)
    assert seen == [False]
    torch.func.vmap(lambda t: seen.append(direct_call_ok((t,))) or t)(torch.ones(2, 3))
    assert seen == [False, False]
    compiled = torch.compile(lambda t: t + 1 if direct_call_ok((t,)) else t - 1, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x - 1)


def test_call_picks_the_path_and_bumps_mutated_versions():
    x = torch.zeros(3)
    def impl(t, out):  # writes nothing: the version bump is ``call``'s job, as the op's registration's
        return None

    op_calls = []
    before = x._version
    call(lambda *a: op_calls.append(a), impl, torch.ones(3), x, mutated=(1,))
    assert op_calls == [] and x._version == before + 1
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        call(lambda *a: op_calls.append(a), impl, fx, fx, mutated=(1,))
    assert len(op_calls) == 1
    bufs = [torch.zeros(2), torch.zeros(2)]
    versions = [b._version for b in bufs]
    call(lambda *a: None, lambda *a: None, bufs, mutated=(0,))
    assert [b._version for b in bufs] == [v + 1 for v in versions]
