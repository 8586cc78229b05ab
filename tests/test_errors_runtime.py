"""Errors of the runtime (weights, protocol, modules, Megatron hooks, FP8), one case per docs/errors.md ID.

Each case calls the public API with one bad value and checks the exception type and that the message names
that value. The IDs are docs/errors.md's; tests/test_error_catalogue.py checks that the rows name these.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distwgrad import ShardedWeight, coalesce
from distwgrad.fp8 import quantize as q
from distwgrad.fp8.recipe import BlockwiseScaling, microbatch
from distwgrad.fp8.weights import quantize_weight
from distwgrad.integrations import megatron
from distwgrad.integrations._megatron_hooks import register_grad_ready_hook
from distwgrad.nn import Embedding, GroupedLinear, LayerNormMLP, Linear
from distwgrad.ops import gemm, grouped_gemm, grouped_gemm_fp8
from distwgrad.protocol import finalize_weight_grads, materialize_weight_for_forward
from distwgrad.weights.base import main_grad_of
from distwgrad.weights.replicated import ReplicatedWeight
from distwgrad.weights.sharded import shard_rows
from distwgrad.wgrad import accumulate, finalize, scheduler


def _param_with_main_grad(shape, main_shape):
    p = nn.Parameter(torch.zeros(shape))
    p.main_grad = torch.zeros(main_shape)
    return p


def _quantized(x=None):
    return q.quantize_per_tensor(torch.ones(4, 4) if x is None else x, torch.float8_e4m3fn)


def _offs4() -> torch.Tensor:
    return torch.tensor([4], dtype=torch.int32)


CASES = [
    # weights and accounting
    ("WGT-003", lambda: main_grad_of(_param_with_main_grad((2, 3), (3, 2))), ValueError, r"shape \(3, 2\)"),
    ("WGT-004", lambda: ShardedWeight.from_full(torch.ones(4, 2), reduce_policy="per_step"), TypeError,
     "'per_step'"),
    ("WGT-005", lambda: ShardedWeight.from_full(torch.ones(4, 2), async_reduce="yes"), TypeError, "'yes'"),
    ("WGT-007", lambda: ShardedWeight.from_full(torch.ones(4, 2)).finalize_group_grads(
        [torch.ones(4, 2), torch.ones(4, 2)]), ValueError, "expected 1 wgrad, got 2"),
    ("WGT-008", lambda: ShardedWeight.from_full(torch.ones(4, 2)).finalize_group_grads([torch.ones(2, 4)]),
     ValueError, r"wgrad of shape .*2, 4.* full shape .*4, 2"),
    ("WGT-011", lambda: ReplicatedWeight.from_full([1.0, 2.0]), TypeError, "list"),
    ("WGT-013", lambda: shard_rows(-1, 2), ValueError, "rows=-1, size=2"),
    ("WGT-014", lambda: ShardedWeight.from_full(torch.tensor(1.0)), ValueError, r"at least one dimension"),
    ("WGT-019", lambda: accumulate.add_to_grad(nn.Parameter(torch.zeros(2, 3)), torch.ones(3, 2)), ValueError,
     r"shape \(3, 2\) for a parameter of shape \(2, 3\)"),
    ("WGT-021", lambda: _finalize_with_tokens(0), ValueError, "is 0"),
    ("WGT-037", lambda: ShardedWeight.from_full(torch.ones(4, 2)).gather_rows(torch.ones(3, 2)), ValueError,
     r"shape \(3, 2\); it must have the shard's 4 rows"),
    ("WGT-031", lambda: _units().units[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)]), ValueError,
     r"Linear is not a unit .* units are \['blocks.0', '<root>'\]"),
    ("WGT-032", lambda: coalesce([nn.Linear(2, 2)]), TypeError, "got list"),
    ("WGT-033", lambda: coalesce(_units().model, units=[nn.Linear(2, 2)]), ValueError, "got Linear"),
    ("WGT-034", lambda: coalesce((m := _units(coalesced=False).model), units=[m]), ValueError, "root unit"),
    ("WGT-035", lambda: coalesce((m := _units(coalesced=False).model), units=[m.blocks[0], m.blocks[0]]),
     ValueError, r"twice in units: \['blocks.0', 'blocks.0'\]"),
    ("WGT-036", lambda: coalesce(_units().model), ValueError, "already belongs to a unit"),
    # protocol
    ("PRO-002", lambda: materialize_weight_for_forward([]), ValueError, "empty list"),
    ("PRO-006", lambda: finalize_weight_grads([ShardedWeight.from_full(torch.ones(4, 2))], []), ValueError,
     "0 wgrads for 1 weights"),
    # modules
    ("MOD-005", lambda: Linear(2, 2).register_wgrad_accumulation_and_reduce_hooks(3), TypeError, "3"),
    ("MOD-008", lambda: LayerNormMLP(4, 8, eps=-1.0), ValueError, "-1.0"),
    ("MOD-012", lambda: Embedding(4, 2)(torch.zeros(3, dtype=torch.long, device="meta")), ValueError,
     "ids on meta, weight on cpu"),
    ("MOD-017", lambda: GroupedLinear(2, 4, 4)(torch.ones(3, 4, device="meta"), [1, 2]), ValueError,
     r"input on meta, parameters on \['cpu'\]"),
    ("MOD-019", lambda: LayerNormMLP(0, 8), ValueError, "got 0"),
    ("MOD-021", lambda: LayerNormMLP(4, 8)(torch.ones(2, 5)), ValueError, r"\(2, 5\).*hidden_size=4"),
    ("MOD-025", lambda: Linear(2, 3, bias=nn.Parameter(torch.zeros(2))), ValueError,
     r"bias has shape \(2,\), expected \(3,\)"),
    ("MOD-026", lambda: Linear(2, 3)([1.0, 2.0]), TypeError, "list"),
    ("MOD-055", lambda: Linear(2, 3, fp8_exempt=1), TypeError, r"Linear\(2, 3\): fp8_exempt must be a bool, got 1"),
    ("MOD-056", lambda: GroupedLinear(2, 4, 4)(torch.ones(3, 4), [1, 2], is_first_microbatch=1), TypeError,
     r"GroupedLinear\(2, 4, 4\): is_first_microbatch must be True, False or None, got 1"),
    ("MOD-029", lambda: Linear(2, 3)(torch.ones(4, 2, device="meta")), ValueError, "input on meta, weight on cpu"),
    ("MOD-033", lambda: GroupedLinear(2, 4, 4)(torch.ones(3, 4), [1.5, 1.5]), TypeError, "1.5"),
    ("MOD-036", lambda: scheduler.drain_deferred_wgrads(3), TypeError, "int"),
    ("MOD-037", lambda: scheduler.drain_deferred_wgrads(Linear(2, 2), order="sideways"), ValueError, "'sideways'"),
    # Megatron integration
    ("INT-001", lambda: megatron.finalize_model_grads(3), TypeError, "int"),
    ("INT-003", lambda: register_grad_ready_hook(Linear(2, 2), "hook"), TypeError, "'hook'"),
    ("INT-006", lambda: megatron.attach_main_grads(Linear(2, 2).requires_grad_(False)), ValueError,
     "no trainable parameter"),
    ("INT-010", lambda: megatron.grad_sync_func(torch.ones(2, 3)), TypeError, r"single tensor of shape \(2, 3\)"),
    ("INT-011", lambda: megatron.grad_sync_func(3), TypeError, "int"),
    ("INT-012", lambda: megatron.grad_sync_func([torch.ones(1), "w"]), TypeError, r"\(1, 'str'\)"),
    # FP8
    ("FP8-001", lambda: q.Quantized(torch.zeros(2, dtype=torch.float8_e4m3fn), torch.tensor(1.0).double(), None,
                                    torch.float32, torch.Size([2])), ValueError, "float64"),
    ("FP8-002", lambda: q.Quantized(torch.zeros(2, dtype=torch.float8_e4m3fn), torch.tensor(1.0), None,
                                    torch.float32, torch.Size([3])), ValueError, r"\(2,\), expected \(3,\)"),
    ("FP8-005", lambda: q.quantize_per_tensor([1.0], torch.float8_e4m3fn), TypeError, "list"),
    ("FP8-051", lambda: microbatch(first=0).__enter__(), TypeError, "microbatch: first must be True or False, got 0"),
    ("FP8-008", lambda: q.quantize_per_tensor(torch.ones(2), torch.float8_e4m3fn,
                                              amax=torch.ones(1, device="meta")), ValueError, "amax is on meta"),
    ("FP8-010", lambda: q.quantize_rowwise_and_columnwise(torch.ones(4, 4), "fp8"), TypeError, "'fp8'"),
    ("FP8-035", lambda: quantize_weight(torch.ones(4, 4), "fp8"), TypeError, "'fp8'"),
    ("FP8-037", lambda: grouped_gemm_fp8.quantize_operand(torch.ones(4, 128), BlockwiseScaling(), grad=False,
                                                          aligned_offs=torch.tensor([4], dtype=torch.int32)),
     ValueError, "BlockwiseScaling"),
    ("FP8-039", lambda: grouped_gemm_fp8.align_token_groups(_quantized(torch.ones(4)),
                                                            torch.tensor([4], dtype=torch.int32)),
     ValueError, r"\(4,\)"),
    ("FP8-040", lambda: grouped_gemm_fp8.grouped_wgrad_fp8(_quantized(), _quantized(),
                                                           torch.tensor([4], dtype=torch.int32),
                                                           out=torch.zeros(1, 4, 4), out_dtype=torch.bfloat16),
     ValueError, "out_dtype=torch.bfloat16"),
    ("FP8-041", lambda: gemm.wgrad_mm(torch.ones(4, 3), torch.ones(4, 2), torch.zeros(3, 2), out_dtype=torch.float32),
     ValueError, "out_dtype=torch.float32"),
    ("MOD-043", lambda: grouped_gemm.grouped_wgrad(torch.ones(4, 3), torch.ones(4, 2), _offs4(),
                                                   out=torch.zeros(1, 3, 2), out_dtype=torch.float32),
     ValueError, "out_dtype=torch.float32"),
    ("MOD-044", lambda: grouped_gemm.grouped_wgrad(torch.ones(4, 3), torch.ones(4, 2), _offs4(),
                                                   out_dtype=torch.float16),
     ValueError, "got torch.float16"),
    ("MOD-045", lambda: grouped_gemm.grouped_wgrad(torch.ones(4, 3), torch.ones(4, 2), _offs4(),
                                                   first=torch.ones(1, dtype=torch.int32)),
     ValueError, "pass out as well"),
    ("FP8-044", lambda: grouped_gemm_fp8.grouped_wgrad_fp8(None, None, _offs4(),
                                                           first=torch.ones(1, dtype=torch.int32)),
     ValueError, "pass out as well"),
]


class _Coalesced:
    def __init__(self, coalesced: bool = True) -> None:
        self.model = nn.Module()
        self.model.blocks = nn.ModuleList([Linear(2, 3, bias=False, weight=ShardedWeight.from_full(torch.ones(3, 2)))])
        self.units = coalesce(self.model) if coalesced else None


def _units(coalesced: bool = True) -> _Coalesced:
    return _Coalesced(coalesced)


def _finalize_with_tokens(n):
    w = ShardedWeight.from_full(torch.ones(4, 2))
    model = nn.Module()
    model.w = w
    finalize.finalize_model_grads(model, num_tokens=torch.tensor(n))


@pytest.mark.parametrize("case, call, exc, match", CASES, ids=[c[0] for c in CASES])
def test_raises(case, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_cases_are_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))

