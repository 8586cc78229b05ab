"""Gradient memory stays flat over microbatches, for every policy, sync or async, deferred or not.

[Note: contribution accounting] promises that ``PER_MICROBATCH`` holds 1/N of a weight's fp32 gradient
between microbatches plus at most one in-flight buffer, and that no policy grows with the number of
microbatches. One ShardedWeight whose full fp32 gradient is 32 MiB, on 2 ranks, 4 microbatches per step:
a buffer kept per microbatch would add 32 MiB per microbatch (96 MiB over the step).

The weight's own fp32 ``main_grad`` (1/N) is created inside each step, at its first landed reduction
([Note: main_grad lifetime] in ``weights/base.py``): after the first microbatch, or after the second
when the first one's reduction is still in flight, and it then stays. It is the one tensor that may
appear during a step, once, so the measures below leave it out while it is live, and check its size.

On CPU (gloo) the measure is each rank's resident set less the live ``main_grad``, read from
``/proc/self/statm`` after every microbatch of the second step (the first warms the allocator). The
ranks run with a fixed glibc mmap threshold (``MALLOC_MMAP_THRESHOLD_``, 1 MiB): every large tensor is
then its own mapping, returned to the system when freed, so RSS follows the live tensors; with glibc's
adaptive threshold, freed 32 MiB chunks fragment the heap and RSS creeps by 16 MiB now and then even on
the synchronous path. The margin, 8 MiB, is a quarter of one buffer: above the noise measured (about
2 MiB), far below one leaked buffer. On GPU the measure is ``torch.cuda.max_memory_allocated``, whose
per-microbatch peak must not move at all from the second microbatch on; the first one's may be lower
by ``main_grad``.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import distwgrad
from distwgrad import ReducePolicy, ShardedWeight
from distwgrad.nn import Linear
from distwgrad.testing import sweep
from distwgrad.testing.multiprocess import for_each_case, run_distributed
from distwgrad.weights import _accounting

N, K = 2048, 4096  # a 32 MiB fp32 gradient, 16 MiB of it per rank
MICROBATCHES = 4
MIB = 2 ** 20
RSS_MARGIN_MIB = 8  # a quarter of one 32 MiB buffer; see the module docstring


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _main_grad_mib(w) -> float:
    """The live ``main_grad``, which must be this rank's shard: 1/N of the full fp32 gradient."""
    main_grad = getattr(w, "main_grad", None)
    if main_grad is None:
        return 0.0
    assert tuple(main_grad.shape) == tuple(w.shape) and main_grad.dtype == torch.float32
    return main_grad.numel() * 4 / MIB


def _step(lin, w, case, x, measure) -> list[float]:
    samples = []
    for _ in range(MICROBATCHES):
        lin(x).sum().backward()
        if case["delay"]:
            distwgrad.drain_deferred_wgrads(lin)
        assert len(w._life.inflight) <= 1 and len(_accounting._LAUNCHED) <= _accounting.MAX_INFLIGHT_REDUCTIONS
        if case["policy"] == "per_microbatch":
            assert w._life.buffer is None  # reduced (or in flight): only 1/N is kept
        samples.append(measure())
    assert distwgrad.finalize_model_grads(lin) == 1
    assert not w._life.inflight and not _accounting._LAUNCHED
    return samples


def _memory_case(case, rank, world, device="cpu"):
    torch.manual_seed(rank)
    w = ShardedWeight.from_full(torch.zeros(N, K, device=device), reduce_policy=ReducePolicy(case["policy"]),
                                async_reduce=case["async"])
    lin = Linear(K, N, bias=False, weight=w, delay_wgrad_compute=case["delay"])
    if case.get("coalesced"):  # the weight as a unit of distwgrad.coalesce: its reduce-scatter staged flat
        model = torch.nn.Sequential(lin)
        distwgrad.coalesce(model, units=[lin])
        lin = model
    x = torch.randn(4, K, device=device)  # no input grad: backward is the wgrad alone
    if device == "cpu":
        _step(lin, w, case, x, _rss_mib)
        rss = _step(lin, w, case, x, lambda: _rss_mib() - _main_grad_mib(w))
        assert _main_grad_mib(w) == N * K * 4 / MIB / world
        growth = max(rss) - rss[0]
        assert growth <= RSS_MARGIN_MIB, f"RSS grew {growth:.1f} MiB over {MICROBATCHES} microbatches: {rss}"
        return [round(r) for r in rss]
    torch.cuda.synchronize()
    _step(lin, w, case, x, lambda: torch.cuda.max_memory_allocated() / MIB)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / MIB
    peaks = _step(lin, w, case, x, lambda: torch.cuda.max_memory_allocated() / MIB)
    assert max(peaks) == peaks[1] and peaks[1] - peaks[0] <= _main_grad_mib(w), \
        f"peak moved over microbatches: {peaks}"
    # main_grad (1/N) + the gathered weight in forward + one accumulating buffer + one in flight (async);
    # coalesced: + the unit's flat staging buffer, which the buffer is copied into before its reduce-scatter
    budget = (N * K * 4 / MIB) * (1 / world + 1 + 1 + (1 if case["async"] else 0) + (1 if case.get("coalesced") else 0))
    assert peaks[1] - base <= budget, (peaks[1] - base, budget)
    return [round(p) for p in peaks]


# CI samples 4 of the 8 (each policy, delay and async value at least once), --full runs all.
CASES = sweep.sample([dict(policy=p, delay=d, **{"async": a})
                      for p, d, a in itertools.product(["per_microbatch", "per_step"], [False, True], [False, True])],
                     4, seed=1)
# Coalesced units (distwgrad.coalesce): CI samples the sync eager and the async deferred case, --full runs 4.
CASES += sweep.sample([dict(policy="per_microbatch", delay=d, coalesced=True, **{"async": a})
                       for d, a in itertools.product([False, True], [False, True])], 2)


def _sweep(rank, world, cases, device="cpu"):
    return for_each_case(cases, _memory_case, rank, world, device)


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_gradient_memory_is_flat_over_microbatches_cpu(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(MIB))  # read by each spawned rank's glibc at start
    run_distributed(_sweep, 2, CASES, timeout=300)


@pytest.mark.gpu
def test_gradient_memory_is_flat_over_microbatches_cuda():
    """Over NCCL with two GPUs (skipped with fewer)."""
    run_distributed(_sweep, 2, CASES, "cuda", timeout=300, device="cuda")
