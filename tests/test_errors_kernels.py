"""The kernels' input checks that run on CPU, one case per docs/errors.md ID.

The launchers check their arguments before any launch, so a bad argument raises here without a GPU. Checks
that only a CUDA launch reaches are catalogued against the interpreter and GPU tests (docs/errors.md).
"""

from __future__ import annotations

import pytest
import torch
from distwgrad.kernels import _grouped_gemm_configs as cfg
from distwgrad.kernels import cast_transpose, flagged_zero, rotary, token_layout, weights_fp8
from distwgrad.kernels import grouped_gemm as kg
from distwgrad.kernels import grouped_gemm_fp8 as k8
from distwgrad.kernels import quantize as kq

F8 = torch.float8_e4m3fn


def _offs() -> torch.Tensor:
    return torch.tensor([4], dtype=torch.int32)


def _flag(device: str = "cpu") -> torch.Tensor:
    return torch.ones(1, dtype=torch.int32, device=device)


def _fp8_wgrad(**kw):
    one = torch.ones((), dtype=torch.float32)
    return k8.grouped_wgrad_fp8(torch.zeros(3, 16, dtype=torch.float8_e5m2), one,
                                torch.zeros(2, 16, dtype=F8), one, torch.tensor([16], dtype=torch.int32), block=0, **kw)


def _interpreting(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at call time: CPU tensors pass the device check


CASES = [
    ("KRN-022", lambda: cfg.TileConfig(48, 64, 64), ValueError, "got 48"),
    ("KRN-023", lambda: cfg.TileConfig(64, 64, 64, num_warps=3), ValueError, "num_warps=3"),
    ("KRN-024", lambda: cfg.TileConfig(64, 64, 64, add_mode="store"), ValueError, "'store'"),
    ("KRN-025", lambda: cfg.TileConfig(16, 64, 64, half_tail=True), ValueError, "block_m=16"),
    ("KRN-077", lambda: kq.quantize_per_tensor([1.0], F8), TypeError, "list"),
    ("KRN-078", lambda: kq.quantize_per_tensor(torch.ones(4, dtype=torch.float64), F8), ValueError,
     "torch.float64"),
    ("KRN-080", lambda: kq.quantize_per_tensor(torch.ones(4, 4).t()[:, :2], F8), ValueError,
     r"strides \(1, 4\)"),
    ("KRN-081", lambda: kq.quantize_blockwise(torch.ones(4), (1, 4), F8), ValueError, r"shape \(4,\)"),
    ("KRN-082", lambda: kq.quantize_blockwise(torch.ones(4, 4), (1, 3), F8), ValueError, r"\(1, 3\)"),
    ("KRN-083", lambda: kq.quantize_per_tensor(torch.ones(4), F8, amax=torch.ones(2)), ValueError,
     r"shape \(2,\)"),
    ("KRN-100", lambda: kq.quantize_per_tensor(torch.ones(4), torch.int8), ValueError, "torch.int8"),
    ("KRN-101", lambda: kg.grouped_wgrad(torch.ones(4, 3), torch.ones(4, 2), torch.tensor([4], dtype=torch.int32),
                                         out=torch.zeros(1, 3, 2), out_dtype=torch.float32),
     ValueError, "out_dtype=torch.float32"),
    ("KRN-102", lambda: kg.grouped_wgrad(torch.ones(4, 3, dtype=torch.float16), torch.ones(4, 2, dtype=torch.float16),
                                         torch.tensor([4], dtype=torch.int32), out_dtype=torch.bfloat16),
     ValueError, "got torch.bfloat16"),
    ("KRN-085", lambda: token_layout.transpose(torch.ones(4, 4)), ValueError, "torch.float32"),
    ("KRN-086", lambda: token_layout.transpose_aligned(torch.zeros(4, 4, dtype=F8), torch.tensor([4])),
     ValueError, "torch.int64"),
    ("KRN-087", lambda: token_layout.transpose_aligned(torch.zeros(4, 4, dtype=F8),
                                                       torch.tensor([4], dtype=torch.int32), align=24),
     ValueError, "got 24"),
    ("KRN-103", lambda: weights_fp8.quantize_experts_blockwise(torch.ones(2, 40, 48), (32, 32), F8), ValueError,
     r"N a multiple of a square block's side, got shape \(2, 40, 48\) and block \(32, 32\)"),
    ("KRN-104", lambda: weights_fp8.quantize_packed_per_tensor(torch.ones(4, 4), F8, torch.ones(1)), ValueError,
     r"a packed \[E, N, K\] weight, got shape \(4, 4\)"),
    ("KRN-105", lambda: weights_fp8.quantize_packed_per_tensor(torch.ones(2, 4, 4), F8, torch.ones(2)), ValueError,
     r"amax must be one fp32 value on cpu, got torch.float32 \(2,\) on cpu"),
    ("KRN-106", lambda: kg.grouped_wgrad(torch.ones(4, 3), torch.ones(4, 2), _offs(), first=_flag()), ValueError,
     r"a fresh output \(out=None\) takes none"),
    ("KRN-107", lambda: kg.grouped_wgrad(torch.ones(4, 3), torch.ones(4, 2), _offs(), out=torch.zeros(1, 3, 2),
                                         first=torch.ones(1)), TypeError, r"got torch.float32 of shape \(1,\)"),
    ("KRN-108", lambda: kg.grouped_wgrad(torch.ones(4, 3), torch.ones(4, 2), _offs(), out=torch.zeros(1, 3, 2),
                                         first=_flag("meta")), ValueError, "first is on meta but the output is on cpu"),
    ("KRN-109", lambda: _fp8_wgrad(first=_flag()), ValueError, r"a fresh output \(out=None\) takes none"),
    ("KRN-110", lambda: flagged_zero.zero_if_flagged(torch.zeros(2, 2).t(), _flag()), ValueError,
     r"contiguous float32 tensor, got torch.float32 with strides \(1, 2\)"),
    ("KRN-111", lambda: flagged_zero.zero_if_flagged(torch.zeros(2), torch.ones(2, dtype=torch.int32)), ValueError,
     r"first must be one int32 on cpu, got torch.int32 of shape \(2,\) on cpu"),
    ("KRN-113", lambda: cast_transpose.cast_transpose_per_tensor(torch.zeros(2, 3, 4), F8), ValueError,
     r"x must be 2-D \[T, R\] \(tokens, features\), got shape \(2, 3, 4\)"),
    ("KRN-114", lambda: rotary.rotate(torch.zeros(1, 2, 3, 5), torch.zeros(3, 2), torch.zeros(3, 2)), ValueError,
     r"x must be \[B, H, S, D\] with an even D, got shape \(1, 2, 3, 5\)"),
    ("KRN-115", lambda: rotary.rotate(torch.zeros(1, 2, 3, 4), torch.zeros(2, 3).t(), torch.zeros(3, 2)), ValueError,
     r"cos must be a contiguous \[S, D / 2\] = \[3, 2\] tensor on cpu, got shape \(3, 2\), strides \(1, 3\)"),
    ("KRN-116", lambda: rotary.rotate(torch.zeros(1, 2, 3, 4, dtype=torch.int32), torch.zeros(3, 2),
                                      torch.zeros(3, 2)), ValueError,
     r"bf16, fp16 or fp32, got torch.int32, torch.float32"),
    ("KRN-088", lambda: weights_fp8.quantize_weights_per_tensor([], F8), ValueError, "no weights"),
    ("KRN-089", lambda: weights_fp8.quantize_weights_per_tensor([torch.ones(4, 4), torch.ones(2, 4)], F8),
     ValueError, r"weights\[1\]"),
]


@pytest.mark.parametrize("case, call, exc, match", CASES, ids=[c[0] for c in CASES])
def test_raises(case, call, exc, match, monkeypatch):
    _interpreting(monkeypatch)
    with pytest.raises(exc, match=match):
        call()
