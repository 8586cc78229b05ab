"""FP8 weight scales and device tables while a CUDA graph captures, modelled on the CPU.

[Note: amax under capture] (``distwgrad/fp8/weights.py``): a capture computes each weight's amax (and
blockwise grid) from the weight, in the graph, and neither reads nor writes the host-side cache. Each test
first shows that eagerly the (poisoned) cache is what is read, so the capture's answer can only come from
the weight. [Note: device tables] (``kernels/_host.py``): a table first made inside a capture is refused.
The real capture, with an optimizer moving the weights between replays, is
``tests/test_cuda_graphs.py::test_fp8_per_tensor_scales_follow_the_weights`` (GPU).
"""

from __future__ import annotations

import pytest
import torch

from distwgrad import ReplicatedWeight, ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling
from distwgrad.fp8 import weights as fw
from distwgrad.fp8.quantize import compute_amax


def _capturing(monkeypatch) -> None:
    monkeypatch.setattr(fw, "_capturing", lambda w: True)


def _bits(qs) -> list[bytes]:
    return [bytes(q.data.view(torch.uint8).flatten().tolist()) + bytes(q.scale_inv.flatten().numpy().tobytes())
            for q in qs]


@pytest.mark.parametrize("kind", [ShardedWeight, ReplicatedWeight])
def test_amax_is_the_weights_own_while_capturing(monkeypatch, kind):
    torch.manual_seed(0)
    w = kind.from_full(torch.randn(16, 8), param_dtype=torch.bfloat16)
    recipe = PerTensorScaling()
    true = compute_amax(w.detach())
    w.expect_contribution()  # a step is open: its amax is kept for it
    assert torch.equal(fw.global_amax(w), true)  # fills the cache
    stale = torch.tensor(1e-3)
    w.pin_cache(fw._AMAX, stale)  # a stale amax under the weight's current token: what a graph must not read
    assert fw.global_amax(w) is stale
    eager = _bits(fw.materialize_quantized(w, recipe, backward=False))
    _capturing(monkeypatch)
    got = fw.global_amax(w)
    assert torch.equal(got, true) and got is not stale
    assert w._life.caches[fw._AMAX][2] is stale  # the cache is left as it was
    want = _bits(fw.quantize_weight(w.detach(), recipe, amax=true))
    captured = _bits(fw.materialize_quantized(w, recipe, backward=True))
    assert captured == want and captured != eager


@pytest.mark.filterwarnings(r"ignore:index_reduce\(\) is in beta")
def test_block_scales_are_the_weights_own_while_capturing(monkeypatch):
    torch.manual_seed(0)
    w = ShardedWeight.from_full(torch.randn(256, 128))
    recipe = BlockwiseScaling()
    w.expect_contribution()  # a step is open: its grid is kept for it
    true = fw.global_block_scales(w, recipe).clone()  # fills the cache
    (key,) = w._life.caches
    stale = torch.full_like(true, 7.0)
    w.pin_cache(key, stale)
    assert fw.global_block_scales(w, recipe) is stale
    _capturing(monkeypatch)
    got = fw.global_block_scales(w, recipe)
    assert torch.equal(got, true) and w._life.caches[key][2] is stale


def test_sync_weight_amax_fills_what_eager_reads():
    """The eager parts of a graphed step read the cache sync_weight_amax refreshes; no capture touches it."""
    torch.manual_seed(0)
    w = ShardedWeight.from_full(torch.randn(16, 8))
    fw.global_amax(w)
    with torch.no_grad():
        w.mul_(4.0)
    fw.sync_weight_amax(torch.nn.ParameterList([w]))
    assert torch.equal(fw.global_amax(w), compute_amax(w.detach()))
    assert torch.equal(w._life.caches[fw._AMAX][2], compute_amax(w.detach()))


def test_a_device_table_first_made_while_capturing_is_refused(monkeypatch):
    from distwgrad.kernels import _host

    made = _host.device_table((11, 22, 33), torch.device("cpu"), "op")
    assert _host.device_table((11, 22, 33), torch.device("cpu"), "op") is made  # made once, kept
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"quantize_weights_per_tensor: first use of this table of 2 values "
                                           r"inside a CUDA graph capture; call once before capturing"):
        _host.device_table((1, 2), torch.device("cuda", 0), "quantize_weights_per_tensor")
    assert not any(values == (1, 2) for *_, values in _host._TABLES)
