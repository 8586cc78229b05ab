"""FP8 weights kept across microbatches in CUDA graphs ([Note: fp8 weights kept in CUDA graphs] in
``distwgrad/fp8/graph_kept.py``, [Note: gated weight quantization] in ``kernels/_gate.py``).

On CPU: the gated kernels (interpreted) and the host's choice of flag. On a GPU: graphs that keep copies give the
bits of graphs that quantize at every use, over steps of three microbatches with fused AdamW, skip what they
should, and hold the bytes they promise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from distwgrad.kernels._gate import gate_outputs, gated

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, compute_amax
from distwgrad.fp8.graph_kept import GraphKept
from distwgrad.nn import GroupedLinear, LayerNormMLP, Linear
from distwgrad.testing.interpreter import run_interpreted

REPO = Path(__file__).resolve().parents[1]


# --- the host's flag -------------------------------------------------------------------------------------
def _weight() -> ShardedWeight:
    return ShardedWeight.from_full(torch.randn(8, 4))


def _captured(kept: GraphKept, w: torch.Tensor) -> None:
    """A capture that quantized ``w`` under the gate (one recorded output)."""
    kept.make([w], lambda: gate_outputs(torch.device("cpu"), ((8, 4), torch.float8_e4m3fn)))


def test_the_flag_skips_only_within_a_step_and_only_where_asked():
    w = _weight()
    kept = GraphKept(torch.device("cpu"))
    _captured(kept, w)
    assert kept.weights == [w] and len(kept.held) == 1

    def replay(reuse: bool) -> int:
        kept.before_replay(reuse)
        return int(kept.flag.item())

    assert replay(True) == 0  # nothing quantized yet: the first replay always quantizes
    assert replay(True) == 1 and replay(False) == 0 and replay(True) == 1
    # a step boundary (an optimizer step moves every weight's epoch, fused or not) forces a fresh replay
    opt = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.zeros_like(w)
    opt.step()
    assert replay(True) == 0 and replay(True) == 1
    w.discard_step()  # any boundary of the lifecycle
    assert replay(True) == 0
    with torch.no_grad():
        w.add_(1.0)  # an in-place write moves _version
    assert replay(True) == 0 and replay(True) == 1
    assert (kept.replays, kept.skips) == (9, 4)


def test_a_graph_that_quantized_nothing_under_its_gate_keeps_nothing():
    w, kept = _weight(), GraphKept(torch.device("cpu"))
    assert kept.make([w], lambda: 5) == 5
    assert kept.weights == [] and kept.held == []
    kept.before_replay(True)
    assert int(kept.flag.item()) == 0 and kept.replays == 0


def test_a_gate_records_only_outputs_on_its_flags_device():
    flag, cpu, spec = torch.zeros(1, dtype=torch.int32), torch.device("cpu"), ((2,), torch.float32)
    with gated(flag) as outs:
        (meta,), skip, on = gate_outputs(torch.device("meta"), spec)
        assert meta.device.type == "meta" and (skip, on) == (None, False)
        (t,), skip, on = gate_outputs(cpu, spec)
        assert skip is flag and on and outs == [t]
    (u,), skip, on = gate_outputs(cpu, spec)
    assert (skip, on) == (None, False) and len(outs) == 1
    with pytest.raises(ValueError, match="one int32 element, got torch.int64"):
        with gated(torch.zeros(1, dtype=torch.int64)):
            pass


# --- the gated kernels -------------------------------------------------------------------------------------
def case_gated(device: str) -> None:
    """Each gated kernel: a clear flag writes the ungated bits, a set one writes nothing (the outputs keep a
    sentinel that ``torch.empty`` is made to fill them with)."""
    from distwgrad.kernels import quantize as kq
    from distwgrad.kernels import weights_fp8 as kw

    torch.manual_seed(0)
    w = torch.randn(2, 64, 32, device=device)
    amax = w.abs().max().reshape(1)
    runs = {"per_tensor": lambda: kq.quantize_per_tensor(w[0], torch.float8_e4m3fn, amax=amax),
            "blocks": lambda: kq.quantize_blockwise(w[0], (32, 32), torch.float8_e4m3fn),
            "packed": lambda: kw.quantize_packed_per_tensor(w, torch.float8_e4m3fn, amax, transpose=True),
            "experts": lambda: kw.quantize_experts_blockwise(w, (32, 32), torch.float8_e4m3fn, transpose=True),
            "amax": lambda: (kw.weight_amax(w),)}
    odd = torch.randn(3, 4099, device=device)  # the gated amax has compute_amax's bits, nonfinite included
    for x in (odd, odd.index_fill(1, torch.tensor([7], device=device), float("nan")), odd[:0]):
        assert torch.equal(kw.weight_amax(x).reshape(()), compute_amax(x))
    empty = torch.empty

    def sentinel(*a, **k):
        out = empty(*a, **k)
        return out.fill_(7.0) if out.dtype == torch.float32 else out.view(torch.uint8).fill_(0x5A).view(out.dtype)

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float32 else t.contiguous().view(torch.uint8)
    for name, run in runs.items():
        want = run()
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        for skip in (0, 1):
            flag.fill_(skip)
            torch.empty = sentinel
            try:
                with gated(flag) as outs:
                    got = run()
            finally:
                torch.empty = empty
            assert len(outs) == 2, name
            for g, x in zip(got, want, strict=True):
                if skip:
                    assert bool((raw(g) == (7.0 if g.dtype == torch.float32 else 0x5A)).all()), name
                else:
                    assert torch.equal(raw(g), raw(x)), name
        with gated(flag) as outs:  # a kernel outside the weights' set is never gated: an activation's amax pass
            kq.quantize_per_tensor(w[0], torch.float8_e4m3fn)
        assert outs == []


@pytest.mark.interpret
def test_gated_kernels_interpreted():
    run_interpreted(__file__, "gated", cwd=str(REPO), timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gated_kernels_gpu():
    case_gated("cuda")


# --- graphs on a GPU -----------------------------------------------------------------------------------------
K, N, T = 256, 384, 512


def _module(kind: str, k: int, n: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    kw = dict(params_dtype=torch.bfloat16, device="cuda")
    if kind == "linear":
        m = Linear(k, n, **kw)
    elif kind == "mlp":
        m = LayerNormMLP(k, n, **kw)
    else:
        m = GroupedLinear(3, k, n, single_grouped_weight=kind == "grouped", delay_wgrad_compute=True, **kw)
    for name, p in list(m.named_parameters()):  # held whole on one rank: what is kept
        if p.dim() >= 2:
            setattr(m, name, ShardedWeight.from_full(p.detach().clone()))
    return m


def _train(kind: str, recipe, cache: bool, flags, *, steps: int = 3, write_data: bool = False):
    """Two modules graphed as two callables (so a replay of one could overwrite what the other keeps), ``steps``
    steps of ``len(flags)`` microbatches with fused AdamW; returns every output, input gradient and parameter
    gradient in order, and the modules."""
    second = (K, N) if kind == "mlp" else (N, K)  # an MLP maps K to K, the others K to N
    mods = [_module(kind, K, N, 0), _module(kind, *second, 1)]
    extra = (torch.tensor([T // 2, 0, T - T // 2], device="cuda"),) if "grouped" in kind else ()
    gen = torch.Generator(device="cuda").manual_seed(1)
    samples = ((torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True), *extra),
               (torch.randn(T, second[0], device="cuda", dtype=torch.bfloat16, requires_grad=True), *extra))
    a, b = distwgrad.make_graphed_callables(tuple(mods), samples, fp8_enabled=True, fp8_recipe=recipe,
                                            cache_quantized_params=cache)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    seen = []
    for _ in range(steps):
        for first in flags:
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            y = b(a(x, *extra, is_first_microbatch=first), *extra, is_first_microbatch=first)
            y.backward(torch.randn(y.shape, device="cuda", dtype=torch.bfloat16, generator=gen))
            for m in mods:
                distwgrad.drain_deferred_wgrads(m)
            seen += [y.detach().clone(), x.grad.clone()]
        distwgrad.finalize_model_grads(mods)
        seen += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if write_data:  # a write no version counter sees, between steps
            with torch.no_grad():
                for p in params:
                    p.data.mul_(0.5)
    return seen, mods


def _graph_kept(mods) -> list[tuple[GraphKept, GraphKept, torch.nn.Module]]:
    """Each callable's forward and backward ``GraphKept`` (``reset`` is the graphed set's)."""
    return [(c.kept_fwd, c.kept_bwd, c.module) for c in mods[0].reset.__self__.callables]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", [PerTensorScaling(), BlockwiseScaling()], ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("kind", ["linear", "grouped", "grouped_discrete", "mlp"])
@pytest.mark.parametrize("flags,write_data", [((True, False, False), False), ((False, False, False), True)],
                         ids=["first_then_not", "never_first_and_data_writes"])
def test_kept_in_graphs_gives_the_bits_of_quantizing_at_every_use(kind, recipe, flags, write_data):
    every_use, plain = _train(kind, recipe, False, flags, write_data=write_data)
    kept, mods = _train(kind, recipe, True, flags, write_data=write_data)
    assert len(kept) == len(every_use)
    for i, (x, y) in enumerate(zip(kept, every_use)):
        assert torch.equal(x, y), f"tensor {i} of {len(kept)}"
    for fwd, bwd, module in _graph_kept(mods):
        # each step's first replay of each graph quantizes; forwards skip where told, backwards always after
        assert (fwd.replays, fwd.skips) == (9, 6) and (bwd.replays, bwd.skips) == (9, 6)
        # the promised bytes: one an element per layout, forward's in the forward graph, dgrad's in the backward's
        weights = sum(p.numel() for p in module.parameters() if p.dim() >= 2)
        for g in (fwd, bwd):
            assert sum(t.numel() for t in g.held if t.dtype == torch.float8_e4m3fn) == weights, kind
    mods[0].reset()
    plain[0].reset()

if __name__ == "__main__":  # the interpreter's entry point: python tests/test_graph_fp8_kept.py gated
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    {"gated": case_gated}[sys.argv[1]]("cpu")
    print(f"ok {sys.argv[1]}")
