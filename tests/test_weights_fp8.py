"""``kernels/weights_fp8.py`` ([Note: a group of weights in two launches]): a group of weights quantized per
tensor in two launches, as views of one stacked buffer, holds the bits of quantizing each weight alone
(``distwgrad.fp8.weights.quantize_weight``, the torch reference), in both layouts; ``stacked_view`` finds
such views and nothing else. The kernels run on CPU under ``TRITON_INTERPRET=1`` (a child process) and on
the GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE))


def _weights(E: int, N: int, K: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(E * N + K)
    ws = [torch.randn(N, K, generator=gen) * 4.0 ** (e % 5 - 2) for e in range(E)]
    ws[1].zero_()                                   # amax 0: scale 1
    ws[2][0, 0] = float("nan")                      # NaN scale for that expert alone
    if E > 3:
        ws[3][N - 1, K - 1] = float("inf")
    return [w.to(device, dtype) for w in ws]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, any NaN equal to any NaN (the NaN sign is not specified; tests/test_fp8_quantize.py)."""
    a, b = a.cpu(), b.cpu()
    view = torch.uint8 if a.element_size() == 1 else torch.int32
    return bool(((a.view(view) == b.view(view)) | (a.float().isnan() & b.float().isnan())).all())


def _check(device: str) -> None:
    from distwgrad.kernels.weights_fp8 import quantize_weights_per_tensor, stacked_view

    from distwgrad.fp8.recipe import PerTensorScaling
    from distwgrad.fp8.weights import quantize_weight
    for E, N, K, dtype, fp8, margin in ((5, 48, 80, torch.float32, torch.float8_e4m3fn, 0),
                                        (4, 130, 66, torch.bfloat16, torch.float8_e5m2, 2)):
        ws = _weights(E, N, K, dtype, device)
        recipe = PerTensorScaling(fwd_dtype=fp8, margin=margin)
        ref = [quantize_weight(w.cpu(), recipe)[0] for w in ws]
        for transpose in (False, True):
            got = quantize_weights_per_tensor(ws, fp8, margin=margin, transpose=transpose)
            for e, (g, r) in enumerate(zip(got, ref)):
                assert g.data.shape == (N, K) and g.scale_inv.shape == () and g.orig_dtype == dtype
                assert _same(g.data, r.data) and _same(g.scale_inv, r.scale_inv), (E, e, transpose)
            view = stacked_view([g.data for g in got])
            assert view is not None and view.shape == (E, N, K) and (view.stride(1) == 1) is transpose
            assert stacked_view([g.scale_inv for g in got]).shape == (E,)
        # a packed [E, N, K] parameter: its experts share one amax, as quantize_weight gives them
        packed = torch.stack([w for w in ws if bool(torch.isfinite(w).all())])  # one amax: the largest expert's
        ref = quantize_weight(packed.cpu(), recipe)
        got = quantize_weights_per_tensor(list(packed.unbind(0)), fp8, margin=margin, shared=[0] * packed.shape[0])
        for g, r in zip(got, ref):
            assert _same(g.data, r.data) and _same(g.scale_inv, r.scale_inv)


def _case_interpreter() -> None:
    _check("cpu")
    from distwgrad.kernels.weights_fp8 import quantize_weights_per_tensor
    with pytest.raises(ValueError, match=r"weights\[1\] is torch.float32 \(4, 8\) on cpu, weights\[0\] torch.float32 "
                                         r"\(4, 4\)"):
        quantize_weights_per_tensor([torch.ones(4, 4), torch.ones(4, 8)], torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no weights"):
        quantize_weights_per_tensor([], torch.float8_e4m3fn)


def test_stacked_view():
    from distwgrad.kernels.weights_fp8 import stacked_view
    buf = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    assert stacked_view(list(buf.unbind(0))).data_ptr() == buf.data_ptr()
    assert torch.equal(stacked_view(list(buf.unbind(0))), buf)
    assert torch.equal(stacked_view([b.t() for b in buf.unbind(0)]), buf.transpose(1, 2))
    assert torch.equal(stacked_view([buf[0]]), buf[:1])
    assert stacked_view([buf[1], buf[0]]) is None                       # out of order
    assert stacked_view([buf[0], buf[0].clone()]) is None               # another storage
    assert stacked_view([buf[0], buf[1][:, :3]]) is None                # another shape
    assert stacked_view([]) is None


@pytest.mark.interpret
def test_quantize_weights_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, _HERE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantize_weights_gpu():
    _check("cuda")


if __name__ == "__main__":  # child of test_quantize_weights_interpreted
    _case_interpreter()
    print("ok")
