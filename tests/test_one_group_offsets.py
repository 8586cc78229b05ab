"""[Note: one-group offsets] in ``distwgrad/nn/linear.py``: an FP8 Linear's one-group offsets are kept per
(device, tokens) and handed out only while unwritten; a tensor subclass or a traced call gets a fresh one;
the store stays bounded."""

from __future__ import annotations

import torch

from distwgrad.nn import linear


def test_kept_per_tokens_and_renewed_when_written():
    linear._ONE_GROUP.clear()
    a = linear._one_group(torch.empty(12, 4))
    assert a.dtype == torch.int32 and a.tolist() == [12]
    assert linear._one_group(torch.empty(12, 8)) is a                 # same device and tokens: the same tensor
    b = linear._one_group(torch.empty(7, 4))
    assert b is not a and b.tolist() == [7]
    a.fill_(3)                                                        # written: never handed out again
    c = linear._one_group(torch.empty(12, 4))
    assert c is not a and c.tolist() == [12]


def test_subclass_gets_a_fresh_one_and_the_store_is_bounded():
    class Sub(torch.Tensor):
        pass

    linear._ONE_GROUP.clear()
    x = torch.empty(5, 2)
    kept = linear._one_group(x)
    fresh = linear._one_group(x.as_subclass(Sub))
    assert fresh is not kept and fresh.tolist() == [5]
    for t in range(1, 200):
        assert linear._one_group(torch.empty(t, 1)).tolist() == [t]
        assert len(linear._ONE_GROUP) <= 64
