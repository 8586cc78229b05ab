"""Reference grouped GEMMs: the CPU path of ``distwgrad.ops`` and, re-exported by
``distwgrad.testing.reference``, the oracle that tests and benchmarks share.

Legend: E experts (groups), T tokens, K in-features, N out-features; ``offs_E`` are int32 END offsets.
Each op is a plain per-group loop of ``torch`` calls in the input dtype (fp32 accumulation inside the
matmul, as cuBLAS and the CPU BLAS do), so on CPU it is bit-exact with a per-expert
``torch.nn.Linear`` oracle that runs the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["group_ranges", "grouped_fprop", "grouped_dgrad", "grouped_wgrad", "grouped_bias_grad"]


def group_ranges(offs_E: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` token ranges from end offsets (reads them on the host)."""
    ends = [int(v) for v in offs_E.tolist()]
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def grouped_fprop(x_TK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                  bias_EN: torch.Tensor | None = None) -> torch.Tensor:
    y_TN = x_TK.new_empty(x_TK.shape[0], w_ENK.shape[1])
    for e, (s, t) in enumerate(group_ranges(offs_E)):
        y_TN[s:t] = F.linear(x_TK[s:t], w_ENK[e], None if bias_EN is None else bias_EN[e])
    return y_TN


def grouped_dgrad(dy_TN: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    dx_TK = dy_TN.new_empty(dy_TN.shape[0], w_ENK.shape[2])
    for e, (s, t) in enumerate(group_ranges(offs_E)):
        dx_TK[s:t] = dy_TN[s:t].mm(w_ENK[e])
    return dx_TK


def grouped_wgrad(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor, *,
                  out: torch.Tensor | Sequence[torch.Tensor] | None = None):
    ranges = group_ranges(offs_E)
    if out is None:
        dW_ENK = dy_TN.new_zeros(len(ranges), dy_TN.shape[1], x_TK.shape[1])
        for e, (s, t) in enumerate(ranges):
            if t > s:
                dW_ENK[e] = dy_TN[s:t].t().mm(x_TK[s:t])
        return dW_ENK
    for e, (s, t) in enumerate(ranges):
        if t > s:
            out[e].add_(dy_TN[s:t].t().mm(x_TK[s:t]))
    return out


def grouped_bias_grad(dy_TN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    ranges = group_ranges(offs_E)
    db_EN = dy_TN.new_zeros(len(ranges), dy_TN.shape[1])
    for e, (s, t) in enumerate(ranges):
        if t > s:
            db_EN[e] = dy_TN[s:t].sum(0)
    return db_EN

