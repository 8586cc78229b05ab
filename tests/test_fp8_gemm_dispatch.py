"""The FP8 modules on the FP8 Triton kernels ([Note: fp8 gemm dispatch] in distwgrad/ops/grouped_gemm_fp8.py).

``Linear`` and ``GroupedLinear`` under ``fp8_autocast`` are run end to end (forward, dgrad, deferred or
immediate wgrad fused into fp32 ``main_grad``, bias) and checked against the FP8 oracle of
``distwgrad.testing.reference_fp8`` built from the same tensors with the reference quantizers: the
output, the input gradient and the weight gradient must lie within ``reference_fp8.error_bound`` (fp32
accumulation in another order; on Hopper its limited-precision fp8 accumulation). Each case also
counts the kernel launches (and a Linear's cuBLASLt GEMMs), so a silent fallback to the emulation fails the test.

On CPU the cases run in a child process under ``TRITON_INTERPRET=1`` with ``DISTWGRAD_KERNELS_ON_CPU=1``
(fp32 modules: the interpreter truncates bf16 stores); on a GPU (``-m gpu``) in bf16 at larger shapes.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE))
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _counting(monkeypatch_like, module, names):
    """Wraps ``module.<name>`` for each name; returns the dict of call counts."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(module, name)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            counts[_name] += 1
            return _fn(*a, **kw)
        monkeypatch_like(module, name, wrapped)
    return counts


def _check(what, ours, expected, S, *, depth, out_dtype, device, addend=None):
    from distwgrad.testing import reference_fp8 as RF
    mma_rel = RF.HOPPER_MMA_REL if device == "cuda" else 0.0
    res = RF.check(ours, expected, S, depth=depth, out_dtype=out_dtype, mma_rel=mma_rel, addend=addend)
    assert res["ok"], f"{what}: {res}"
    return res["worst"]


def run_case(recipe_name: str, module: str, delay: bool, device: str, setattr_fn) -> dict:
    """One module under one recipe through the kernels; returns the worst error/bound ratios. Module
    "grouped_aligned": GroupedLinear with its wgrad operands in the aligned layout ([Note: aligned token
    groups] in kernels/token_layout.py; ``ALIGN_MIN_TOKENS`` lowered to take it at these sizes) and a fresh
    weight gradient (no ``main_grad``) in the parameters' dtype."""
    from distwgrad.kernels import grouped_gemm_fp8 as K

    from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
    from distwgrad.fp8.quantize import quantize_blockwise, quantize_per_tensor, quantize_rowwise_and_columnwise
    from distwgrad.nn import GroupedLinear, Linear
    from distwgrad.ops import grouped_gemm_fp8 as gg8
    from distwgrad.testing import reference_fp8 as RF

    cuda = device == "cuda"
    L = 128 if cuda else 32
    recipe = (PerTensorScaling() if recipe_name == "per_tensor"
              else BlockwiseScaling(act_block=(1, L), weight_block=(L, L)))
    dtype = torch.bfloat16 if cuda else torch.float32
    T, K_, N_ = (1000, 384, 320) if cuda else (40, 72, 48)  # K, N off the block grid on purpose
    torch.manual_seed(0)
    aligned = module == "grouped_aligned"
    setattr_fn(gg8, "ALIGN_MIN_TOKENS", 1 if aligned else 10 ** 9)
    if module.startswith("grouped"):
        splits = [300, 0, 1, 699] if cuda else [11, 0, 1, 28]
        mod = GroupedLinear(len(splits), K_, N_, bias=True, params_dtype=dtype, device=device,
                            delay_wgrad_compute=delay, fuse_wgrad_accumulation=not aligned)
        weights = [getattr(mod, f"weight{e}") for e in range(len(splits))]
    else:
        splits = [T]
        mod = Linear(K_, N_, bias=True, params_dtype=dtype, device=device, delay_wgrad_compute=delay,
                     fuse_wgrad_accumulation=True)
        weights = [mod.weight]
    for w in weights if not aligned else ():
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
    biases = [p for n, p in mod.named_parameters() if n.startswith("bias")]
    with torch.no_grad():
        for b in biases:
            b.normal_()
    counts = _counting(setattr_fn, K, ["grouped_fprop_fp8", "grouped_dgrad_fp8", "grouped_wgrad_fp8"])
    # A Linear's per-tensor GEMMs that cuBLASLt takes ([Note: a Linear's fp8 GEMMs on cuBLASLt]): here only dgrad,
    # as fprop has a bias and the wgrad's T is not a multiple of 16. Blockwise: none (contraction widths off the
    # 512 grid, tokens off the 128 grid: scaled_mm.blockwise_ok).
    on_cublas = {"grouped_dgrad_fp8"} if cuda and module == "linear" and recipe_name == "per_tensor" else set()
    scaled = _counting(setattr_fn, torch, ["_scaled_mm"])
    # the weights' form as the fprop hands them to the kernel: per-expert list or one stacked pair
    forms, real_fprop = [], gg8.kernel_grouped_fprop_fp8
    setattr_fn(gg8, "kernel_grouped_fprop_fp8", lambda x_q, w_qs, *a, **kw: (forms.append(type(w_qs).__name__),
                                                                             real_fprop(x_q, w_qs, *a, **kw))[1])
    widths = []
    real_wgrad = K.grouped_wgrad_fp8
    setattr_fn(K, "grouped_wgrad_fp8", lambda dy_t, dy_s, x_t, x_s, offs_E, *a, **kw: (
        widths.append((dy_t.shape[1], x_t.shape[1], offs_E.tolist())),
        real_wgrad(dy_t, dy_s, x_t, x_s, offs_E, *a, **kw))[1])
    x = torch.randn(T, K_, device=device, dtype=dtype, requires_grad=True)
    with fp8_autocast(recipe):
        y = mod(x, splits) if module != "linear" else mod(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    if delay:
        mod.backward_dw()
    assert counts == {name: int(name not in on_cublas) for name in counts}, counts
    assert scaled == {"_scaled_mm": len(on_cublas)}, scaled
    # plain experts under per-tensor scaling: quantized together, handed over stacked ([Note: a group of
    # weights in two launches])
    assert forms == ["tuple" if recipe_name == "per_tensor" and module != "linear" else "list"], forms
    if aligned:  # the wgrad read both operands in the aligned layout, with its offsets
        padded = [-(-n // 128) * 128 for n in splits]
        want_offs = torch.tensor(padded).cumsum(0).tolist()
        width = -(-(T + 127 * len(splits) + 1) // 128) * 128
        assert widths == [(width, width, want_offs)], widths
    else:
        assert widths and widths[0][0] == T and widths[0][2] == torch.tensor(splits).cumsum(0).tolist(), widths

    # Oracle: the same quantized operands, from the reference quantizers.
    offs = torch.tensor(splits, device=device).cumsum(0).to(torch.int32)
    x_q, x_qt = quantize_rowwise_and_columnwise(x.detach(), recipe)
    dy_q, dy_qt = quantize_rowwise_and_columnwise(dy, recipe, grad=True)
    # Per weight, as the module; the reference quantizers even where the module used the kernels.
    w_qs = [quantize_per_tensor(w.detach(), recipe.fwd_dtype) if recipe_name == "per_tensor" else
            quantize_blockwise(w.detach(), recipe.weight_block, recipe.dtype) for w in weights]
    b_EN = torch.stack([b.detach() for b in biases])
    worst = {}
    exp = RF.grouped_fprop_fp8(x_q, w_qs, offs, b_EN, out_dtype=torch.float32)
    S = RF.grouped_fprop_fp8(x_q, w_qs, offs, absolute=True)
    worst["y"] = _check("y", y.detach(), exp, S, depth=K_, out_dtype=dtype, device=device)
    exp = RF.grouped_dgrad_fp8(dy_q, w_qs, offs, out_dtype=torch.float32)
    S = RF.grouped_dgrad_fp8(dy_q, w_qs, offs, absolute=True)
    worst["dx"] = _check("dx", x.grad, exp, S, depth=N_, out_dtype=dtype, device=device)
    exp = RF.grouped_wgrad_fp8(dy_qt, x_qt, offs)
    S = RF.grouped_wgrad_fp8(dy_qt, x_qt, offs, absolute=True)
    zero = torch.zeros_like(exp)
    for e, w in enumerate(weights):
        if aligned:  # a fresh gradient in the parameters' dtype
            assert w.grad.dtype == dtype, w.grad.dtype
            worst[f"dw{e}"] = _check(f"grad of weight {e}", w.grad, exp[e], S[e], depth=T, out_dtype=dtype,
                                     device=device)
        else:
            worst[f"dw{e}"] = _check(f"main_grad of weight {e}", w.main_grad, exp[e], S[e], depth=T,
                                     out_dtype=torch.float32, device=device, addend=zero[e])
    for e, b in enumerate(biases):  # bias gradients are not FP8: the sum of dy over each group
        s, t = int(offs[e]) - splits[e], int(offs[e])
        torch.testing.assert_close(b.grad.float(), dy[s:t].float().sum(0), rtol=1e-2, atol=1e-2)
    return worst


CASES = [(r, m, d) for r in ("per_tensor", "blockwise") for m in ("grouped", "linear") for d in (False, True)]
CASES += [("per_tensor", "grouped_aligned", d) for d in (False, True)]
IDS = [f"{r}-{m}-{'delay' if d else 'now'}" for r, m, d in CASES]


@pytest.mark.interpret
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_modules_on_fp8_kernels_interpreted(case):
    from distwgrad.testing.interpreter import run_interpreted
    run_interpreted(_HERE, *case, kernels_on_cpu=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_modules_on_fp8_kernels_gpu(case, monkeypatch):
    worst = run_case(*case, "cuda", monkeypatch.setattr)
    print(f"fp8 modules {case}: worst error/bound {max(worst.values()):.3f}")


def test_cpu_takes_the_emulation_by_default():
    """Without the testing route, CPU tensors never reach the kernels (the CPU tests are bit-exact)."""
    from distwgrad.fp8 import BlockwiseScaling
    from distwgrad.ops import grouped_gemm_fp8 as gg8
    if os.environ.get("DISTWGRAD_KERNELS_ON_CPU"):
        pytest.skip("the testing route is switched on")
    q, _ = gg8.quantize_operand(torch.randn(4, 64), BlockwiseScaling(), grad=False)
    assert not gg8.fp8_kernels_accept([q])


if __name__ == "__main__":  # child of test_modules_on_fp8_kernels_interpreted
    recipe_name, module, delay = sys.argv[1], sys.argv[2], sys.argv[3] == "True"
    worst = run_case(recipe_name, module, delay, "cpu", setattr)
    print(f"ok {sys.argv[1:]}: worst error/bound {max(worst.values()):.3f}")


def test_kernels_take_only_operands_they_support(monkeypatch):
    """The dispatch rule of [Note: fp8 gemm dispatch], with the kernels reported available (nothing is
    launched or imported: a Triton module imported here under TRITON_INTERPRET would stay interpreted for
    the rest of the process): one recipe, per-tensor or 1xL tiles with L >= 32 and LxL weight blocks;
    anything else (short tiles, per-row weight scales of an off-grid sharded gather, mixed recipes) is
    emulated."""
    from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling
    from distwgrad.fp8.quantize import dequantize, quantize_blockwise, quantize_rowwise_and_columnwise
    from distwgrad.fp8.weights import quantize_weight
    from distwgrad.ops import grouped_gemm as gg
    from distwgrad.ops import grouped_gemm_fp8 as gg8
    x, w = torch.randn(8, 64), torch.randn(48, 64)
    pt, bw32, bw16 = (PerTensorScaling(), BlockwiseScaling(act_block=(1, 32), weight_block=(32, 32)),
                      BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16)))
    act = {r: quantize_rowwise_and_columnwise(x, r)[0] for r in (pt, bw32, bw16)}
    wq = {r: quantize_weight(w, r) for r in (pt, bw32, bw16)}
    per_row = [quantize_blockwise(w, (1, 32), torch.float8_e4m3fn)]      # an off-grid sharded gather's scales
    offs = torch.tensor([8], dtype=torch.int32)
    want = dequantize(act[bw32], dtype=torch.float32) @ dequantize(per_row[0], dtype=torch.float32).t()
    y = gg8.grouped_fprop_fp8(act[bw32], per_row, offs, None, torch.float32)  # emulated: bit-exact
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    monkeypatch.setattr(gg, "kernels_available", lambda t: True)
    assert gg8.fp8_kernels_accept([act[pt]], wq[pt])
    assert gg8.fp8_kernels_accept([act[bw32]], wq[bw32])
    assert not gg8.fp8_kernels_accept([act[bw16]], wq[bw16])             # tiles shorter than 32
    assert not gg8.fp8_kernels_accept([act[bw32]], wq[pt])               # mixed recipes
    assert not gg8.fp8_kernels_accept([act[pt], act[bw32]])
    assert not gg8.fp8_kernels_accept([act[bw32]], per_row)


@pytest.mark.parametrize("module", ["grouped", "linear"])
@pytest.mark.parametrize("delay", [False, True])
def test_each_operand_is_quantized_once(module, delay, monkeypatch):
    """Forward quantizes x once (rows for fprop, x^T saved for wgrad: backward never re-quantizes x);
    backward quantizes dy once (rows for dgrad, columns for wgrad)."""
    from distwgrad.fp8 import BlockwiseScaling, fp8_autocast
    from distwgrad.nn import GroupedLinear, Linear
    from distwgrad.ops import grouped_gemm_fp8 as gg8
    calls = _counting(monkeypatch.setattr, gg8, ["quantize_operand"])
    torch.manual_seed(0)
    x = torch.randn(24, 64, requires_grad=True)
    recipe = BlockwiseScaling(act_block=(1, 32), weight_block=(32, 32))
    if module == "grouped":
        mod = GroupedLinear(2, 64, 32, delay_wgrad_compute=delay)
        with fp8_autocast(recipe):
            y = mod(x, [10, 14])
    else:
        mod = Linear(64, 32, delay_wgrad_compute=delay)
        with fp8_autocast(recipe):
            y = mod(x)
    assert calls["quantize_operand"] == 1
    y.sum().backward()
    mod.backward_dw()
    assert calls["quantize_operand"] == 2
    assert all(p.grad is not None for p in mod.parameters())


@pytest.mark.parametrize("module", ["grouped", "linear"])
def test_modules_pass_each_gemms_accumulation(module, monkeypatch):
    """The recipe's per-GEMM ``MMParams`` reach the FP8 GEMM dispatchers: fprop off, dgrad and wgrad on
    (TransformerEngine's current-scaling choice), and every default on."""
    from distwgrad.fp8 import MMParams, PerTensorScaling, fp8_autocast
    from distwgrad.nn import GroupedLinear, Linear
    from distwgrad.ops import grouped_gemm_fp8 as gg8
    seen: dict[str, list] = {"fprop": [], "dgrad": [], "wgrad": []}
    for gemm in seen:
        fn = getattr(gg8, f"grouped_{gemm}_fp8")

        def spy(*a, _fn=fn, _gemm=gemm, **kw):
            seen[_gemm].append(kw["split_accumulator"])
            return _fn(*a, **kw)
        monkeypatch.setattr(gg8, f"grouped_{gemm}_fp8", spy)
    monkeypatch.setattr(gg8, "fp8_kernels_accept", lambda *a, **k: True)  # take the kernel branch...
    from distwgrad.kernels import grouped_gemm_fp8 as K
    for gemm in seen:  # ...whose kernels are replaced by the emulation, so CPU runs without Triton
        monkeypatch.setattr(K, f"grouped_{gemm}_fp8", _emulating(gemm))
    for recipe, want in ((PerTensorScaling(fp8_gemm_fprop=MMParams(False)), [False, True, True]),
                         (PerTensorScaling(), [True, True, True])):
        for v in seen.values():
            v.clear()
        torch.manual_seed(0)
        x = torch.randn(24, 64, requires_grad=True)
        mod = GroupedLinear(2, 64, 32) if module == "grouped" else Linear(64, 32)
        with fp8_autocast(recipe):
            y = mod(x, [10, 14]) if module == "grouped" else mod(x)
        y.sum().backward()
        assert [seen[g] for g in ("fprop", "dgrad", "wgrad")] == [[w] for w in want], (recipe, seen)


def _emulating(gemm: str):
    """A stand-in for the kernel ``grouped_<gemm>_fp8`` (tensors in) computing the product with the FP8 oracle
    (``Quantized`` in)."""
    from distwgrad.fp8.quantize import Quantized
    from distwgrad.testing import reference_fp8 as RF

    def act(data, scale_inv, block):
        return Quantized(data, scale_inv, (1, block) if block else None, torch.float32, data.shape)

    def run(a, a_s, b, b_s, offs_E, *rest, block, split_accumulator, **kw):
        assert isinstance(split_accumulator, bool)
        if gemm == "wgrad":
            out, out_dtype = (rest[0] if rest else kw.get("out")), kw.get("out_dtype") or torch.float32
            res = RF.grouped_wgrad_fp8(act(a, a_s, block), act(b, b_s, block), offs_E)
            if out is None:
                return res.to(out_dtype)
            for o, r in zip(out, res):
                o.add_(r)
            return out
        return getattr(RF, f"grouped_{gemm}_fp8")(act(a, a_s, block), (b, b_s), offs_E, *rest, **kw)
    return run


def test_audit_tool_checks_its_arguments():
    """qa/L2_gpu/fp8_kernel_audit.py (GPU tool): a bad product name is refused before anything runs, and
    without a GPU (and without the interpreter route) it says what it needs instead of auditing nothing."""
    tool = os.path.join(_ROOT, "qa", "L2_gpu", "fp8_kernel_audit.py")
    env = {k: v for k, v in os.environ.items() if k not in ("DISTWGRAD_KERNELS_ON_CPU", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    bad = subprocess.run([sys.executable, tool, "--emulate-gemm", "fprop,matmul"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--emulate-gemm takes fprop, dgrad, wgrad; got 'fprop,matmul'" in bad.stderr
    if not torch.cuda.is_available():
        cpu = subprocess.run([sys.executable, tool], env=env, capture_output=True, text=True, timeout=120)
        assert cpu.returncode != 0 and "needs a GPU" in cpu.stderr


@pytest.mark.parametrize("offs", [[100, 100, 350, 600, 650], [0, 0, 0, 0, 700], [128, 256, 384, 512, 640],
                                  [700, 700, 700, 700, 700], [1, 2, 3, 4, 5]])
def test_align_token_groups(offs):
    """``align_token_groups``: each group's tokens start on the 128 grid, the padding and every column
    past the last group are zeros, the new offsets count each group's padding, unrouted tokens are
    dropped, and the wgrad over the new layout is the same sum (exact in float64 over the fp8 values: every
    product and their sums fit its mantissa; the scales' products would not)."""
    from distwgrad.fp8 import PerTensorScaling, quantize_rowwise_and_columnwise
    from distwgrad.ops.grouped_gemm_fp8 import align_token_groups
    from distwgrad.testing import reference_fp8 as RF
    gen = torch.Generator().manual_seed(0)
    T, K, N = 700, 48, 40
    x, dy = torch.randn(T, K, generator=gen), torch.randn(T, N, generator=gen)
    offs_E = torch.tensor(offs, dtype=torch.int32)
    _, x_qt = quantize_rowwise_and_columnwise(x, PerTensorScaling())
    _, dy_qt = quantize_rowwise_and_columnwise(dy, PerTensorScaling(), grad=True)
    x_a, offs_a = align_token_groups(x_qt, offs_E)
    dy_a, offs_b = align_token_groups(dy_qt, offs_E)
    assert torch.equal(offs_a, offs_b) and offs_a.dtype == torch.int32
    width = -(-(T + 127 * len(offs) + 1) // 128) * 128
    assert x_a.data.shape == (K, width) and x_a.data.is_contiguous() and x_a.scale_inv is x_qt.scale_inv
    ends = [min(o, T) for o in offs]
    starts = [0] + ends[:-1]
    a_end = offs_a.tolist()
    a_start = [0] + a_end[:-1]
    bits, bits_a = x_qt.data.view(torch.uint8), x_a.data.view(torch.uint8)
    written = torch.zeros(width, dtype=torch.bool)
    for s, t, s2, t2 in zip(starts, ends, a_start, a_end):
        n = max(t - s, 0)
        assert s2 % 128 == 0 and t2 - s2 == -(-n // 128) * 128, (s2, t2, n)
        assert torch.equal(bits_a[:, s2:s2 + n], bits[:, s:s + n])
        written[s2:s2 + n] = True
    assert not bool(bits_a[:, ~written].any()), "padding and the tail must be zeros"
    # the fp8 values alone (unit scales): every product and sum exact in float64, so equal in any order
    raw = lambda q: dataclasses.replace(q, scale_inv=torch.ones((), dtype=torch.float32))
    want = RF.grouped_wgrad_fp8(raw(dy_qt), raw(x_qt), offs_E, compute_dtype=torch.float64)
    got = RF.grouped_wgrad_fp8(raw(dy_a), raw(x_a), offs_a, compute_dtype=torch.float64)
    assert torch.equal(got, want)


def test_align_token_groups_refuses_blockwise():
    from distwgrad.fp8 import BlockwiseScaling, quantize_rowwise_and_columnwise
    from distwgrad.ops.grouped_gemm_fp8 import align_token_groups
    _, q_t = quantize_rowwise_and_columnwise(torch.randn(256, 128), BlockwiseScaling())
    with pytest.raises(ValueError, match=r"per-tensor operands only .* got block \(1, 128\)"):
        align_token_groups(q_t, torch.tensor([100, 256], dtype=torch.int32))
