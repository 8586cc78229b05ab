"""The model, data and oracle shared by the ``distwgrad.integrations.megatron`` tests (``test_megatron_*.py``).

The model (legend: K in-features, H hidden, E experts, T tokens of a microbatch, M microbatches, W ranks)
is ``Linear(K,H) -> relu -> GroupedLinear(E,H,H) -> relu -> head_a(H,H) -> relu -> head_b(H,H)`` with
``head_a`` and ``head_b`` sharing one weight (``_Net``; ``_RefNet`` is its plain ``torch.nn`` twin). The
schedules that drive it are ``test_megatron_schedule.py``'s.

Tolerances. The oracle is a single-process ``torch.nn`` model fed every rank's microbatches.
* Exact data (most tests): weights, inputs and loss weights are small dyadic numbers (multiples of 1/2
  with |v| <= 1, inputs in {-1, 0, 1}) and every divisor is a power of two, so every product and every
  partial sum is exactly representable in fp32 (``_reference`` asserts it: the fp32 oracle equals the
  fp64 one). Any summation order then gives the same bits, so comparisons are ``torch.equal`` although
  distwgrad adds microbatches and tied uses in another order than autograd; a lost, duplicated or
  mis-scaled contribution changes the result by a whole term.
* Random data (``test_random_data_within_reassociation_bound``) catches what exact data cannot (a
  reduction or buffer in a low precision, a scale rounded early): the per-use terms are the same fp32
  GEMMs on both sides, only their summation order differs, so the bound is the reassociation error of
  n terms, ``n * eps * sum(|term|)``, plus one rounding of the result.

Not a test module: the tests import it (pytest puts tests/ on the path; spawned ranks unpickle their
functions from the test modules, which import this one, there too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distwgrad import ReducePolicy, ShardedWeight
from distwgrad.nn import GroupedLinear, Linear

K, H, E = 4, 6, 2  # H = 6 rows: 3 per rank on 2 ranks
# Tokens per [rank][microbatch]: powers of two, and each rank's total is the same power of two so that
# the per-token scale (W / total tokens) is exact; unequal per microbatch so per-token loss differs from
# Megatron's default per-microbatch averaging.
_TOKENS = {(1, 1): [[4]], (1, 4): [[4, 8, 2, 2]], (2, 1): [[4], [4]], (2, 4): [[4, 4, 4, 4], [8, 4, 2, 2]]}
_SPLITS = {8: [[5, 3]], 4: [[1, 3], [0, 4]], 2: [[2, 0]]}  # expert token splits; includes empty groups


# --- data, model, oracle ---------------------------------------------------------------------------------

def _values(shape, g, exact, scale=0.5, lo=-2, hi=3):
    if exact:
        return torch.randint(lo, hi, shape, generator=g).float() * scale
    return torch.randn(shape, generator=g) * scale


def _full(exact=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w_in": _values((H, K), g, exact), "b_in": _values((H,), g, exact),
            "w_exp": _values((E, H, H), g, exact), "b_exp": _values((E, H), g, exact),
            "w_tied": _values((H, H), g, exact)}


def _data(step, world, microbatches, exact=True):
    """Every rank's microbatches ``(x_TK, splits, c_TH)``: the global batch, known to every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for tokens in _TOKENS[(world, microbatches)]:
        out.append([(_values((t, K), g, exact, scale=1.0, lo=-1, hi=2), _SPLITS[t][m % len(_SPLITS[t])],
                     _values((t, H), g, exact)) for m, t in enumerate(tokens)])
    return out


class _Net(nn.Module):
    """A Megatron model chunk: ``config``, ``model_type`` and ``set_input_tensor`` as the schedules expect."""

    def __init__(self, case, full):
        super().__init__()
        policy = ReducePolicy(case.get("policy", "per_microbatch"))
        sharded = case["kind"] == "sharded"
        kw = dict(delay_wgrad_compute=case["delay"], fuse_wgrad_accumulation=case["fuse"])

        def weight(t):
            if sharded:
                return ShardedWeight.from_full(t, reduce_policy=policy)
            return nn.Parameter(t.clone())

        plain = lambda t: nn.Parameter(t.clone())  # biases stay plain: the data-parallel all-reduce path
        self.inp = Linear(K, H, weight=weight(full["w_in"]), bias=plain(full["b_in"]), **kw)
        self.experts = GroupedLinear(E, H, H, single_grouped_weight=case["packed"], **kw)
        if case["packed"]:
            self.experts.weight, self.experts.bias = weight(full["w_exp"]), plain(full["b_exp"])
        else:
            for e in range(E):
                setattr(self.experts, f"weight{e}", weight(full["w_exp"][e]))
                setattr(self.experts, f"bias{e}", plain(full["b_exp"][e]))
        tied = weight(full["w_tied"])
        self.head_a = Linear(H, H, bias=False, weight=tied, **kw)
        self.head_b = Linear(H, H, bias=False, weight=tied, **kw)
        self.model_type = None  # the real-schedule test sets megatron's ModelType

    def set_input_tensor(self, input_tensor):
        pass

    def forward(self, x, splits):
        h = F.relu(self.inp(x))
        h = F.relu(self.experts(h, splits))
        return self.head_b(F.relu(self.head_a(h)))

    def by_reference_name(self):
        """``(oracle name, index into it or None, parameter)`` for every distinct parameter."""
        out = [("w_in", None, self.inp.weight), ("b_in", None, self.inp.bias), ("w_tied", None, self.head_a.weight)]
        if self.experts.single_grouped_weight:
            out += [("w_exp", None, self.experts.weight), ("b_exp", None, self.experts.bias)]
        else:
            out += [(n, e, getattr(self.experts, f"{a}{e}")) for e in range(E)
                    for n, a in (("w_exp", "weight"), ("b_exp", "bias"))]
        return out


class _RefNet(nn.Module):
    def __init__(self, full, dtype, untie):
        super().__init__()
        self.inp = nn.Linear(K, H).to(dtype)
        self.experts = nn.ModuleList(nn.Linear(H, H).to(dtype) for _ in range(E))
        self.head_a, self.head_b = nn.Linear(H, H, bias=False).to(dtype), nn.Linear(H, H, bias=False).to(dtype)
        with torch.no_grad():
            self.inp.weight.copy_(full["w_in"])
            self.inp.bias.copy_(full["b_in"])
            for e, lin in enumerate(self.experts):
                lin.weight.copy_(full["w_exp"][e])
                lin.bias.copy_(full["b_exp"][e])
            self.head_a.weight.copy_(full["w_tied"])
            self.head_b.weight.copy_(full["w_tied"])
        if not untie:
            self.head_b.weight = self.head_a.weight

    def forward(self, x, splits):
        h = F.relu(self.inp(x))
        parts, start = [], 0
        for lin, n in zip(self.experts, splits):
            parts.append(lin(h[start:start + n]))
            start += n
        h = F.relu(torch.cat(parts))
        return self.head_b(F.relu(self.head_a(h)))

    def sources(self):
        """Oracle name -> its gradient sources: one per use of the tensor (two for the untied heads); the
        experts' source is the list of per-expert weights (their gradients are stacked)."""
        tied = [self.head_a.weight] + ([self.head_b.weight] if self.head_b.weight is not self.head_a.weight else [])
        return {"w_in": [self.inp.weight], "b_in": [self.inp.bias], "w_tied": tied,
                "w_exp": [[lin.weight for lin in self.experts]], "b_exp": [[lin.bias for lin in self.experts]]}


def _grad_with_lists(loss, sources):
    """``autograd.grad`` over sources that may be lists (the experts), stacked back per source."""
    flat = [s for src in sources for s in (src if isinstance(src, list) else [src])]
    grads = iter(torch.autograd.grad(loss, flat))
    return [torch.stack([next(grads) for _ in src]) if isinstance(src, list) else next(grads) for src in sources]


def _reference(full, data, per_token):
    """The oracle's gradients, checked exact: fp32 oracle == fp64 oracle (see the module docstring)."""
    want = {n: torch.stack(t).sum(0) for n, t in _terms(full, data, per_token, torch.float32).items()}
    want64 = {n: torch.stack(t).sum(0) for n, t in _terms(full, data, per_token, torch.float64).items()}
    for n in want:
        assert torch.equal(want[n].double(), want64[n]), f"test data not exact for {n}"
    return want


def _terms(full, data, per_token, dtype, untie=False):
    ref = _RefNet({k: v.to(dtype) for k, v in full.items()}, dtype, untie)
    world, mbs = len(data), len(data[0])
    total_tokens = sum(x.shape[0] for rank in data for x, _, _ in rank)
    names = [n for n, srcs in ref.sources().items() for _ in srcs]
    sources = [src for srcs in ref.sources().values() for src in srcs]
    terms: dict[str, list[torch.Tensor]] = {}
    for rank in data:
        for x, splits, c in rank:
            loss = (ref(x.to(dtype), splits) * c.to(dtype)).sum()
            if not per_token:  # forward_step_calc_loss: / num_tokens, then / num_microbatches
                loss = loss / x.shape[0]
                loss = loss / mbs
            for n, gr in zip(names, _grad_with_lists(loss, sources)):
                terms.setdefault(n, []).append(gr / total_tokens if per_token else gr / world)
    return terms


def _local(p, t):
    return t[p.shard_offset:p.shard_offset + p.shape[0]] if isinstance(p, ShardedWeight) else t


def _result_of(p):
    """Where the step's gradient lives: weights: main_grad and .grad agree; plain: main_grad if any."""
    main_grad = getattr(p, "main_grad", None)
    if isinstance(p, ShardedWeight):
        assert torch.equal(p.grad, main_grad.to(p.dtype))
        return main_grad
    if main_grad is not None:
        assert p.grad is None, "plain parameter with main_grad: .grad must be folded into it"
        return main_grad
    return p.grad


def _assert_matches(net, want):
    for name, index, p in net.by_reference_name():
        expected = want[name] if index is None else want[name][index]
        got = _result_of(p)
        assert got is not None and got.dtype == torch.float32, (name, index)
        assert torch.equal(got, _local(p, expected)), (name, index, (got - _local(p, expected)).abs().max())
