"""Problems and checks shared by the bf16 / fp16 / fp32 grouped GEMM tests (``test_grouped_gemm_*.py``):
random routings with empty groups, NaN-poisoned outputs, every op checked against the fp64 oracle with
[Note: grouped gemm error bound]. Not a test module: the tests import it (pytest puts tests/ on the path;
the interpreter child runs from there too).
"""

import os

import torch

from distwgrad.testing import reference as R

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernels():
    from distwgrad.kernels import grouped_gemm
    return grouped_gemm


def _bound():
    from distwgrad.kernels import _grouped_gemm_configs
    return _grouped_gemm_configs.error_vs_oracle


def _random_offsets(T: int, E: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random split of T tokens into E groups, about a third of them empty."""
    weights = torch.rand(E, generator=gen) * (torch.rand(E, generator=gen) > 0.33)
    if weights.sum() == 0:
        weights[0] = 1.0
    idx = torch.multinomial(weights, T, replacement=True, generator=gen) if T else torch.empty(0).long()
    splits = torch.bincount(idx, minlength=E)
    return splits.cumsum(0).to(torch.int32).to(device)


def _inputs(T, E, K, N, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    return dict(x=r(T, K), w=r(E, N, K), b=r(E, N), dy=r(T, N), m=torch.randn(E, N, K, generator=gen)
                .to(device), offs=_random_offsets(T, E, gen, device))


def _check(what, ours, reference, oracle):
    res = _bound()(ours, reference, oracle)
    assert res["ok"], f"{what}: {res}"


def _poisoned(shape, like):
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _check_all_ops(T, E, K, N, dtype, device, *, seed=0, use_tma=None, config=None, bias=True,
                   ops=("fprop", "dgrad", "wgrad", "wgrad_acc", "wgrad_acc_list"), splits=None, exact_fresh=False):
    """Runs the launchers on NaN-poisoned outputs and checks each op against the oracle; ``splits``
    (tokens per group) replaces the random split. ``exact_fresh``: "wgrad_fp32" must also be bit-equal to
    the accumulating wgrad into zeros (where both run one kernel with one tile order)."""
    k = _kernels()
    d = _inputs(T, E, K, N, dtype, device, seed)
    x, w, dy, offs, m = d["x"], d["w"], d["dy"], d["offs"], d["m"]
    if splits is not None:
        assert len(splits) == E and sum(splits) == T
        offs = torch.tensor(splits).cumsum(0).to(device=device, dtype=torch.int32)
    b = d["b"] if bias else None
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    kw = dict(config=config, use_tma=use_tma)
    tag = f"T={T} E={E} K={K} N={N} {dtype} tma={use_tma}"
    if "fprop" in ops:
        y = k._launch_ragged(x, w, offs, b, _poisoned((T, N), x), w_trans=True, **kw)
        _check(f"fprop {tag}", y, R.grouped_fprop(x, w, offs, b),
               R.grouped_fprop(x64, w64, offs, None if b is None else b.double()))
    if "dgrad" in ops:
        dx = k._launch_ragged(dy, w, offs, None, _poisoned((T, K), x), w_trans=False, **kw)
        _check(f"dgrad {tag}", dx, R.grouped_dgrad(dy, w, offs), R.grouped_dgrad(dy64, w64, offs))
    oracle_dw = R.grouped_wgrad(dy64, x64, offs)
    if "wgrad" in ops:
        dw = _poisoned((E, N, K), x)
        k._launch_wgrad(dy, x, offs, dw, accumulate=False, table=None, **kw)
        _check(f"wgrad {tag}", dw, R.grouped_wgrad(dy, x, offs), oracle_dw)
    if "wgrad_fp32" in ops:  # a fresh fp32 output: what adding into zeros holds ([Note: a fresh first contribution])
        dw = torch.full((E, N, K), float("nan"), device=device)
        k._launch_wgrad(dy, x, offs, dw, accumulate=False, table=None, **kw)
        assert not dw.isnan().any(), f"wgrad_fp32 {tag}: a tile left unwritten"
        zeros = torch.zeros(E, N, K, device=device)
        _check(f"wgrad_fp32 {tag}", dw, R.grouped_wgrad(dy, x, offs, out=zeros.clone()), oracle_dw)
        if exact_fresh:  # the same kernel and tile order with and without the add into zeros
            added = k._wgrad(dy, x, offs, out=zeros.clone(), **kw)
            assert torch.equal(dw, added), f"wgrad_fp32 {tag}: not the bits of the add into zeros"
    if "wgrad_acc" in ops:
        out = k._wgrad(dy, x, offs, out=m.clone(), **kw)
        _check(f"wgrad_acc {tag}", out, R.grouped_wgrad(dy, x, offs, out=m.clone()), m.double() + oracle_dw)
    if "wgrad_acc_list" in ops:
        # separate buffers at unrelated addresses, each a strided view (row stride K + 3)
        bufs = [torch.zeros(N, K + 3, device=device)[:, :K] for _ in range(E)]
        for e in range(E):
            bufs[e].copy_(m[e])
        k._wgrad(dy, x, offs, out=bufs, **kw)
        _check(f"wgrad_acc_list {tag}", torch.stack(bufs), R.grouped_wgrad(dy, x, offs, out=m.clone()),
               m.double() + oracle_dw)
