"""megatron-core's real ``forward_backward_no_pipelining`` driving distwgrad through our config hooks.

What it checks: a model chunk ``Linear(K,H) -> relu -> GroupedLinear(E,H,H) -> relu -> head_a -> relu ->
head_b`` (``head_a``/``head_b`` tie one weight; weights are ``ShardedWeight`` over the data-parallel
group, experts packed and sharded, biases plain parameters) runs under megatron-core's own schedule with
``config.finalize_model_grads_func``/``no_sync_func``/``grad_sync_func``/``param_sync_func`` set by
``distwgrad.integrations.megatron.install``, for deferred and immediate wgrads, fused and unfused
accumulation, Megatron's per-microbatch and per-token loss scaling. Gradients are compared with a
single-process ``torch.nn`` reference fed every rank's microbatches. The data are small dyadic numbers
and every divisor a power of two, so every sum is exact in fp32 and the comparison is bit-exact whatever
the summation order (TF32 is turned off; with TF32 the inputs would be rounded). It also checks that each
sharded weight reduced exactly once per step (the schedule's ``no_sync_func`` held back the others).

Run (megatron-core is not a project dependency; carry its wheel, e.g.
``megatron_core-0.16.1-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl``, and install it
without dependencies; it needs ``numpy`` and ``packaging>=24.2``, which torch machines usually have)::

    pip install --no-deps megatron_core-0.16.1-*.whl
    python qa/L2_gpu/megatron_real_schedule.py                          # 1 GPU (data-parallel group of 1)
    torchrun --nproc-per-node 2 qa/L2_gpu/megatron_real_schedule.py     # 2 GPUs: weights really sharded
    python qa/L2_gpu/megatron_real_schedule.py --device cpu             # smoke test on CPU (gloo)

On CPU the schedule's one CUDA allocation (``torch.zeros(..., device="cuda")``, its token counter) is
redirected to the CPU, and the script says so; on a GPU nothing of megatron-core is touched. It prints
which parts ran, ``PASS``/``FAIL`` per case with max differences, and exits non-zero on any failure or
when megatron-core does not import.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import types

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # keep NVLink multicast off (shared hosts)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from distwgrad import ReducePolicy, ShardedWeight  # noqa: E402
from distwgrad.integrations import megatron as dw_megatron  # noqa: E402
from distwgrad.nn import GroupedLinear, Linear  # noqa: E402
from distwgrad.ops import grouped_gemm  # noqa: E402

K, H, E, MICROBATCHES = 8, 16, 4, 4  # in-features, hidden, experts, microbatches
TOKENS = [16, 32, 8, 8]  # per microbatch (powers of two; 64 per rank)


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def dyadic(shape, g, device, scale=0.5, lo=-2, hi=3):
    return (torch.randint(lo, hi, shape, generator=g).float() * scale).to(device)


def full_tensors(device):
    g = torch.Generator().manual_seed(0)
    return {"w_in": dyadic((H, K), g, device), "b_in": dyadic((H,), g, device),
            "w_exp": dyadic((E, H, H), g, device), "b_exp": dyadic((E, H), g, device),
            "w_tied": dyadic((H, H), g, device)}


def global_batch(step, world, device):
    """``[rank][microbatch] = (x_TK, splits, c_TH)``: every rank builds every rank's data."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for r in range(world):
        mbs = []
        for m, t in enumerate(TOKENS):
            splits = [t // 2, 0, t // 4, t // 4] if (m + r) % 2 else [t // 8, t // 8, t // 4, t // 2]
            mbs.append((dyadic((t, K), g, device, 1.0, -1, 2), splits, dyadic((t, H), g, device)))
        out.append(mbs)
    return out


class Net(nn.Module):
    def __init__(self, full, *, delay, fuse):
        super().__init__()
        kw = dict(delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
        shard = lambda t: ShardedWeight.from_full(t, reduce_policy=ReducePolicy.PER_MICROBATCH)
        plain = lambda t: nn.Parameter(t.clone())
        self.inp = Linear(K, H, weight=shard(full["w_in"]), bias=plain(full["b_in"]), **kw)
        self.experts = GroupedLinear(E, H, H, single_grouped_weight=True, **kw)
        self.experts.weight, self.experts.bias = shard(full["w_exp"]), plain(full["b_exp"])
        tied = shard(full["w_tied"])
        self.head_a = Linear(H, H, bias=False, weight=tied, **kw)
        self.head_b = Linear(H, H, bias=False, weight=tied, **kw)

    def set_input_tensor(self, input_tensor):  # megatron's forward_step calls it
        pass

    def forward(self, x, splits):
        h = F.relu(self.inp(x))
        h = F.relu(self.experts(h, splits))
        return self.head_b(F.relu(self.head_a(h)))

    def by_name(self):
        return {"w_in": self.inp.weight, "b_in": self.inp.bias, "w_exp": self.experts.weight,
                "b_exp": self.experts.bias, "w_tied": self.head_a.weight}


def reference(full, data, per_token, dtype):
    """torch.nn oracle: Megatron's loss scaling and data-parallel averaging, all ranks' microbatches."""
    inp = nn.Linear(K, H).to(full["w_in"].device, dtype)
    experts = nn.ModuleList(nn.Linear(H, H).to(full["w_in"].device, dtype) for _ in range(E))
    head = nn.Linear(H, H, bias=False).to(full["w_in"].device, dtype)
    with torch.no_grad():
        inp.weight.copy_(full["w_in"])
        inp.bias.copy_(full["b_in"])
        for e, lin in enumerate(experts):
            lin.weight.copy_(full["w_exp"][e])
            lin.bias.copy_(full["b_exp"][e])
        head.weight.copy_(full["w_tied"])
    world, total_tokens = len(data), sum(x.shape[0] for rank in data for x, _, _ in rank)
    for rank in data:
        for x, splits, c in rank:
            h = F.relu(inp(x.to(dtype)))
            h = F.relu(torch.cat([lin(part) for lin, part in zip(experts, h.split(splits))]))
            loss = (head(F.relu(head(h))) * c.to(dtype)).sum()
            if per_token:
                loss = loss / total_tokens
            else:  # megatron's forward_step_calc_loss, then the data-parallel average
                loss = loss / x.shape[0] / len(rank) / world
            loss.backward()
    return {"w_in": inp.weight.grad, "b_in": inp.bias.grad, "w_tied": head.weight.grad,
            "w_exp": torch.stack([lin.weight.grad for lin in experts]),
            "b_exp": torch.stack([lin.bias.grad for lin in experts])}


def forward_step_func(data_iterator, model):
    """Megatron's contract: ``(data_iterator, model) -> (output, loss_func)``."""
    x, splits, c = next(data_iterator)
    y = model(x, splits)

    def loss_func(output):
        loss = (output * c).sum()
        return loss, torch.tensor(x.shape[0], dtype=torch.int, device=x.device), {"loss": loss.detach()}
    return y, loss_func


class CpuTorch(types.ModuleType):
    """For ``--device cpu`` only: megatron's schedules module sees ``torch.zeros(device="cuda")`` on CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def run_case(case, schedules, model_type, transformer_config, device) -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    full = full_tensors(device)
    net = Net(full, delay=case["delay"], fuse=case["fuse"])
    net.model_type = model_type
    net.config = dw_megatron.install(transformer_config(num_layers=1, hidden_size=H, num_attention_heads=1,
                                                        calculate_per_token_loss=case["per_token"]), [net])
    weights = [p for p in net.parameters() if isinstance(p, ShardedWeight)]
    ok = True
    for step in range(2):
        data = global_batch(step, world, device)
        before = [w.bytes_reduced for w in weights]
        schedules.forward_backward_no_pipelining(
            forward_step_func=forward_step_func, data_iterator=iter(data[rank]), model=[net],
            num_microbatches=MICROBATCHES, seq_length=max(TOKENS), micro_batch_size=1)
        want = reference(full, data, case["per_token"], torch.float32)
        want64 = reference(full, data, case["per_token"], torch.float64)
        exact = all(torch.equal(want[n].double(), want64[n]) for n in want)
        diffs = {}
        for name, p in net.by_name().items():
            main_grad = getattr(p, "main_grad", None)
            got = main_grad if main_grad is not None else p.grad
            expected = want[name]
            if isinstance(p, ShardedWeight):
                expected = expected[p.shard_offset:p.shard_offset + p.shape[0]]
            diff = torch.tensor(float("inf") if got is None else (got.float() - expected).abs().max().item(),
                                device=device)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            diffs[name] = diff.item()
        once = torch.tensor(float(all(w.bytes_reduced - b == w.full_shape.numel() * 4
                                      for w, b in zip(weights, before)) or world == 1), device=device)
        dist.all_reduce(once, op=dist.ReduceOp.MIN)
        passed = exact and all(d == 0 for d in diffs.values()) and once.item() == 1
        ok &= passed
        log(f"  {'PASS' if passed else 'FAIL'} {case} step {step}: max |diff| by tensor "
            f"{ {n: f'{d:.3g}' for n, d in diffs.items()} }, oracle exact: {exact}, "
            f"one reduce-scatter per weight per step: {bool(once.item()) if world > 1 else 'n/a (1 rank)'}")
        dw_megatron.zero_grad_buffer([net])
        for p in net.parameters():
            p.grad = None
    return ok


def init(device: str) -> None:
    if "RANK" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
        return
    if device == "cuda":
        torch.cuda.set_device(0)
    store = os.path.join(tempfile.mkdtemp(prefix="mcore-rdzv-"), "store")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1, timeout=datetime.timedelta(minutes=5))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device (use --device cpu for a smoke test)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # IEEE fp32 products: the bit-exact comparison needs them
    torch.backends.cudnn.allow_tf32 = False
    init(args.device)
    try:
        import megatron.core
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        log(f"FAIL: megatron-core does not import ({exc}); nothing ran")
        return 2
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    probe = torch.zeros(1, device=args.device)
    log(f"megatron-core {getattr(megatron.core, '__version__', '?')} from {os.path.dirname(megatron.core.__file__)}")
    log(f"torch {torch.__version__}, device {args.device}"
        f"{' (' + torch.cuda.get_device_name() + ')' if args.device == 'cuda' else ''}, "
        f"world {dist.get_world_size()}, backend {dist.get_backend()}")
    log("schedule: megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining (real), "
        "pg_collection built by megatron from parallel_state"
        + ("; CPU smoke test: its torch.zeros(device='cuda') redirected to CPU" if args.device == "cpu" else ""))
    log(f"grouped GEMM: {'Triton kernels' if grouped_gemm.kernels_available(probe) else 'torch reference'}")
    if args.device == "cpu":
        schedules.torch = CpuTorch("torch")
    cases = [dict(delay=d, fuse=f, per_token=t) for d in (False, True) for f in (False, True) for t in (False, True)]
    ok = all([run_case(c, schedules, ModelType.encoder_or_decoder, TransformerConfig, args.device) for c in cases])
    log("PASS: all cases" if ok else "FAIL: see the cases above")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
