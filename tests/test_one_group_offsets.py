"""[Note: one-group offsets] in ``distwgrad/nn/linear.py``: an FP8 Linear's one-group offsets are one device
table per (device, tokens), made once ([Note: device tables]); a tensor subclass gets a fresh tensor."""

from __future__ import annotations

import torch

from distwgrad.nn import linear


def test_one_table_per_tokens():
    a = linear._one_group(torch.empty(12, 4))
    assert a.dtype == torch.int32 and a.tolist() == [12]
    assert linear._one_group(torch.empty(12, 8)) is a                 # same device and tokens: the same tensor
    b = linear._one_group(torch.empty(7, 4))
    assert b is not a and b.tolist() == [7]
    from distwgrad.kernels._host import device_table
    wide = device_table((12,), torch.device("cpu"), "test")          # another dtype: another table
    assert wide.dtype == torch.int64 and wide is not a


def test_subclass_gets_a_fresh_one():
    class Sub(torch.Tensor):
        pass

    x = torch.empty(5, 2)
    kept = linear._one_group(x)
    fresh = linear._one_group(x.as_subclass(Sub))
    assert fresh is not kept and fresh.tolist() == [5] and fresh.dtype == torch.int32
