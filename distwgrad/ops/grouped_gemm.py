"""The one grouped-GEMM interface GroupedLinear calls: three MoE products over ragged token groups.

Legend: E experts (groups), T tokens, K in-features, N out-features. ``offs_E``: each group's END offset
(int32, on the tokens' device, as ``torch._grouped_mm`` takes it): group e owns rows ``offs_E[e-1]:offs_E[e]``.

    fprop   y_TN[g]   = x_TK[g] @ w_ENK[e]^T (+ bias_EN[e])
    dgrad   dx_TK[g]  = dy_TN[g] @ w_ENK[e]
    wgrad   dW_ENK[e] = dy_TN[g]^T @ x_TK[g]      (contraction over the group's tokens)

[Note: grouped gemm dispatch]
CPU tensors take the torch reference (``distwgrad.ops.reference``, bit-exact with a per-expert ``F.linear``);
CUDA tensors the Triton kernels of ``distwgrad.kernels.grouped_gemm`` when Triton imports, else the
reference. The choice is made here only: the modules never know which one ran.

[Note: fp32 on CUDA]
fp32 IEEE products have no tensor-core instruction, so the kernels (built for 16-bit operands) would run FMA
loops far below cuBLAS. fp32 CUDA tensors take ``torch._grouped_mm`` (no host sync; torch's TF32 switch
applies), or where a build lacks it, the reference's per-expert loop (one host read of the offsets).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence

import torch

from distwgrad.kernels._host import to_device  # (torch only: no Triton, no kernel)
from distwgrad.ops import reference

__all__ = ["splits_to_offsets", "grouped_fprop", "grouped_dgrad", "grouped_wgrad", "kernels_available", "torch_route"]


_last_offsets: list = []  # [(weakref to a device m_splits, its _version, num_groups, num_tokens, device, offs)]


def _remembered_offsets(m_splits: torch.Tensor, num_groups: int, num_tokens: int, device: torch.device):
    """The offsets computed last for this very tensor, if unchanged since (``_version``), for the same problem.

    [Note: one routing, two GEMMs]
    An MoE layer hands the same device ``m_splits`` to fc1 and fc2, so the second call reuses the first's cumsum
    and device assertions. The entry holds a weak reference and the version counter: an in-place change, a new
    tensor at the same address or another token count computes afresh. Never used while a CUDA graph captures.
    """
    if not _last_offsets:
        return None
    ref, version, groups, tokens, dev, offs = _last_offsets[0]
    if ref() is m_splits and version == m_splits._version and (groups, tokens, dev) == (num_groups, num_tokens,
                                                                                          device):
        return offs
    return None


def splits_to_offsets(m_splits: Sequence[int] | torch.Tensor, num_groups: int, num_tokens: int,
                      device: torch.device) -> torch.Tensor:
    """Validates ``m_splits`` and returns int32 end offsets on ``device``: a list or CPU tensor on the host; a CUDA
    tensor never read there, its sum an async device assertion, once per tensor ([Note: one routing, two GEMMs])."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.numel() != num_groups:
            raise ValueError(f"m_splits must have {num_groups} entries (one per GEMM), got shape "
                             f"{tuple(m_splits.shape)}")
        if m_splits.dtype.is_floating_point or m_splits.dtype == torch.bool:
            raise TypeError(f"m_splits must be an integer tensor, got {m_splits.dtype}")
        if m_splits.device.type == "cpu":
            return splits_to_offsets(m_splits.tolist(), num_groups, num_tokens, device)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        offs = None if capturing else _remembered_offsets(m_splits, num_groups, num_tokens, device)
        if offs is not None:
            return offs
        offs = torch.cumsum(m_splits.to(device=device, dtype=torch.int32), 0, dtype=torch.int32)
        torch._assert_async(offs[-1] == num_tokens, "m_splits do not sum to the number of tokens")
        torch._assert_async((m_splits >= 0).all(), "m_splits has a negative split")
        if not capturing:
            _last_offsets[:] = [(weakref.ref(m_splits), m_splits._version, num_groups, num_tokens, device, offs)]
        return offs
    splits = list(m_splits)
    if len(splits) != num_groups:
        raise ValueError(f"m_splits must have {num_groups} entries (one per GEMM), got {len(splits)}: "
                         f"{splits}")
    if any((not isinstance(s, int)) or isinstance(s, bool) for s in splits):
        raise TypeError(f"m_splits must hold ints, got {splits}")
    if any(s < 0 for s in splits):
        raise ValueError(f"m_splits has a negative split: {splits}")
    if sum(splits) != num_tokens:
        raise ValueError(f"m_splits {splits} sum to {sum(splits)}, but the input has {num_tokens} tokens")
    ends, total = [], 0
    for s in splits:
        total += s
        ends.append(total)
    return to_device(ends, torch.int32, device)


def _kernels_on_cpu() -> bool:
    """Testing route: CPU tensors through the kernels, under the Triton interpreter only."""
    return (os.environ.get("DISTWGRAD_KERNELS_ON_CPU", "0") not in ("", "0")
            and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


def kernels_available(t: torch.Tensor) -> bool:
    """True when ``t`` lives on CUDA and the Triton grouped-GEMM kernels import (or, for tests of the
    wiring, ``DISTWGRAD_KERNELS_ON_CPU=1`` with ``TRITON_INTERPRET=1`` and ``t`` on the CPU)."""
    if t.device.type != "cuda" and not (t.device.type == "cpu" and _kernels_on_cpu()):
        return False
    return _kernels_import()


@functools.cache
def _kernels_import() -> bool:
    """Whether the kernel module imports, tried once (the modules ask at every GEMM and quantization)."""
    try:
        from distwgrad.kernels import grouped_gemm  # noqa: F401
    except ImportError:
        return False
    return True


def torch_route(t: torch.Tensor) -> bool:
    """True where torch's grouped GEMM beats the kernels: fp32 on CUDA ([Note: fp32 on CUDA])."""
    return t.device.type == "cuda" and t.dtype == torch.float32


@functools.cache
def _has_torch_grouped_mm(dtype: torch.dtype, device: str) -> bool:
    """Whether this torch build runs ``torch._grouped_mm`` for ``dtype`` on ``device`` (probed once)."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    a = torch.zeros(4, 8, dtype=dtype, device=device)
    b = torch.zeros(2, 8, 8, dtype=dtype, device=device)
    try:
        fn(a, b.transpose(-2, -1), offs=torch.tensor([2, 4], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _torch_grouped_mm(dtype: torch.dtype, device: torch.device) -> bool:
    return _has_torch_grouped_mm(dtype, str(device))


def _group_of_token(offs_E: torch.Tensor, num_tokens: int) -> torch.Tensor:
    tokens = torch.arange(num_tokens, device=offs_E.device, dtype=torch.int32)
    return torch.searchsorted(offs_E, tokens, right=True).clamp_max_(offs_E.numel() - 1)


def _torch_fprop(x_TK, w_ENK, offs_E, bias_EN):
    if not _torch_grouped_mm(x_TK.dtype, x_TK.device):
        return reference.grouped_fprop(x_TK, w_ENK, offs_E, bias_EN)
    y_TN = torch._grouped_mm(x_TK, w_ENK.transpose(-2, -1), offs=offs_E)
    if bias_EN is not None:
        y_TN += bias_EN[_group_of_token(offs_E, x_TK.shape[0])]
    return y_TN


def _torch_dgrad(dy_TN, w_ENK, offs_E):
    if not _torch_grouped_mm(dy_TN.dtype, dy_TN.device):
        return reference.grouped_dgrad(dy_TN, w_ENK, offs_E)
    return torch._grouped_mm(dy_TN, w_ENK, offs=offs_E)


def _torch_wgrad(dy_TN, x_TK, offs_E, out):
    if not _torch_grouped_mm(dy_TN.dtype, dy_TN.device):
        return reference.grouped_wgrad(dy_TN, x_TK, offs_E, out=out)
    dW_ENK = torch._grouped_mm(dy_TN.t(), x_TK, offs=offs_E)  # an empty group gives zeros
    return dW_ENK if out is None else add_per_group(out, dW_ENK)


def _as(dW_ENK: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """A fresh product in ``out_dtype``: the bits adding it into zeros of that dtype would leave."""
    return dW_ENK if out_dtype is None else dW_ENK.to(out_dtype)


def grouped_fprop(x_TK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                  bias_EN: torch.Tensor | None = None) -> torch.Tensor:
    """``y_TN`` for every group; see the module docstring."""
    if torch_route(x_TK):
        return _torch_fprop(x_TK, w_ENK, offs_E, bias_EN)
    if kernels_available(x_TK):
        from distwgrad.kernels import grouped_gemm as k
        return k.grouped_fprop(x_TK, w_ENK, offs_E, bias_EN)
    return reference.grouped_fprop(x_TK, w_ENK, offs_E, bias_EN)


def grouped_dgrad(dy_TN: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``dx_TK`` for every group; see the module docstring."""
    if torch_route(dy_TN):
        return _torch_dgrad(dy_TN, w_ENK, offs_E)
    if kernels_available(dy_TN):
        from distwgrad.kernels import grouped_gemm as k
        return k.grouped_dgrad(dy_TN, w_ENK, offs_E)
    return reference.grouped_dgrad(dy_TN, w_ENK, offs_E)


def grouped_wgrad(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor, *,
                  out: torch.Tensor | Sequence[torch.Tensor] | None = None, out_dtype: torch.dtype | None = None,
                  first: torch.Tensor | None = None):
    """``dW`` per group (zeros for a group without tokens), or added into ``out`` and ``out`` returned (fused into
    fp32 buffers; others, e.g. a bf16 ``main_grad``, get a fresh product added). ``out_dtype`` (no ``out``): dy's
    by default; float32 holds exactly what adding into fp32 zeros would. ``first`` (with ``out``): an int32 device
    flag; while set, ``out`` holds nothing yet ([Note: an unwritten accumulator] in ``weights/first_write.py``)."""
    if out is not None and out_dtype is not None:
        raise ValueError(f"grouped_wgrad: out_dtype={out_dtype} is a fresh output's dtype; pass out (added "
                         f"into) or out_dtype, not both")
    if first is not None:
        if out is None:
            raise ValueError("grouped_wgrad: first= flags an output to add into; pass out as well")
        if kernels_available(dy_TN) and not torch_route(dy_TN) and all_fp32(out):
            from distwgrad.kernels import grouped_gemm as k
            return k.grouped_wgrad(dy_TN, x_TK, offs_E, out=out, first=first)
        from distwgrad.weights.first_write import zero_where_flagged
        zero_where_flagged(out, first)
    if out_dtype not in (None, dy_TN.dtype, torch.float32):
        raise ValueError(f"grouped_wgrad: out_dtype must be None, dy's dtype ({dy_TN.dtype}) or torch.float32, "
                         f"got {out_dtype!r}")
    if torch_route(dy_TN):
        return _as(_torch_wgrad(dy_TN, x_TK, offs_E, out), out_dtype)
    if kernels_available(dy_TN):
        from distwgrad.kernels import grouped_gemm as k
        if out is not None and not all_fp32(out):
            return add_per_group(out, k.grouped_wgrad(dy_TN, x_TK, offs_E))
        if out is None:
            return k.grouped_wgrad(dy_TN, x_TK, offs_E, out_dtype=out_dtype)
        return k.grouped_wgrad(dy_TN, x_TK, offs_E, out=out)
    return _as(reference.grouped_wgrad(dy_TN, x_TK, offs_E, out=out), out_dtype)


def all_fp32(out: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """Whether every accumulation target is fp32 (what the fused kernels add into)."""
    return all(t.dtype == torch.float32 for t in ([out] if isinstance(out, torch.Tensor) else out))


def add_per_group(out, dW_ENK: torch.Tensor):
    """Adds a fresh ``[E, N, K]`` product into a stacked or per-group ``out``; returns ``out``."""
    if isinstance(out, torch.Tensor):
        out.add_(dW_ENK)
    else:
        for t, g in zip(out, dW_ENK.unbind(0), strict=True):
            t.add_(g)
    return out


def grouped_bias_grad(dy_TN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``db_EN[e]``: the sum of ``dy_TN`` over group e's tokens. CPU: bit-exact with a per-expert ``nn.Linear``;
    CUDA: one fp32 ``index_add_`` keyed by each token's group (no host sync), cast back."""
    if dy_TN.device.type != "cuda":
        return reference.grouped_bias_grad(dy_TN, offs_E)
    num_tokens = dy_TN.shape[0]
    tokens = torch.arange(num_tokens, device=dy_TN.device, dtype=torch.int32)
    group_T = torch.searchsorted(offs_E, tokens, right=True)
    db_EN = torch.zeros(offs_E.numel(), dy_TN.shape[1], dtype=torch.float32, device=dy_TN.device)
    db_EN.index_add_(0, group_T, dy_TN.float())
    return db_EN.to(dy_TN.dtype)


__all__ += ["grouped_bias_grad", "all_fp32", "add_per_group"]
