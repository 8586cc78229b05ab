"""torchao's FP8 training on the plain ``MoEGPT``: the FP8 peer of ``train_step.py``'s torch and FSDP2 builds.

Legend: A expert rows (token-to-expert assignments, sorted by expert), P padded rows, E experts, K in-features,
N out-features.

The conversion is torchtitan's (``torchtitan/components/quantization/float8.py``) on this model, torchao 0.18:

* the attention projections ``attn.qkv`` and ``attn.proj`` become ``Float8Linear`` through
  ``convert_to_float8_training`` with the tensorwise recipe (dynamic scales, e4m3 forward, e5m2 gradients);
  each is first an ``nn.Linear`` holding the plain build's own ``Parameter`` (``from_float`` keeps it);
* the experts' packed ``[E, N, K]`` weights become ``Float8TrainingWeightWrapperTensor`` parameters through
  ``quantize_(..., Float8TrainingOpConfig())``: FP8 rowwise scaled grouped GEMMs (``torch._scaled_grouped_mm``,
  CUDA SM90). torchao 0.18 takes token groups already aligned to 16 rows (its own padding asserts "not yet
  supported"), so each expert GEMM pads its groups as torchtitan's token dispatcher does
  ([Note: experts padded to 16 rows]);
* the tied embedding / LM head and the routers stay bf16 (torchtitan filters "output" and "router.gate").

Masters stay fp32 and shared: the converted modules hold the model's parameters (the experts' wrappers hold
the same storage), so the build starts from the same weights as the others. Compute is bf16: the plain build
casts its other leaves at each use, and torchao quantizes the fp32 masters straight to FP8 (as under
torchtitan's autocast, where the weights stay fp32); under FSDP2 the weights arrive in bf16 by its
``MixedPrecisionPolicy`` (torchao's wrapper casts before the all-gather).

``convert_to_float8_training`` also patches inductor's Triton min/max codegen process-wide (torchao's
workaround for triton-lang/triton#11111, numerically identical), so builds compiled after the first
conversion compile with it.

[Note: experts padded to 16 rows]
``torch._scaled_grouped_mm`` needs each group's end offset a multiple of 16 (and the wgrad's token dimension
too: the FP8 operands' rows are 16-byte aligned). Each group is padded with zero rows to a multiple of 16,
at least 16 (an empty expert gets 16 zero rows, as torchtitan's ``generate_permute_indices``), into a buffer
of the static size ``round_up(A + 16 E, 16)``: no host sync, one shape per step for ``torch.compile``. Zero
rows add nothing to the outputs, the wgrads or the rowwise/per-group amaxes. torchtitan pads once around the
whole expert MLP; here each grouped GEMM pads and unpads (the MoE block calls fc1 and fc2 apart), and under
``torch.compile`` the unpad, GELU and pad between them fuse into one pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ALIGN = 16  # rows per token group of torch._scaled_grouped_mm ([Note: experts padded to 16 rows])
ATTENTION = ("attn.qkv", "attn.proj")  # the converted projections' names within a block
MIN_TORCHAO = (0, 18)  # the version whose moe_training API this file was written against


def import_error() -> str | None:
    """None when torchao's float8 training and MoE training import (and are recent enough); else why not."""
    try:
        import torchao
        import torchao.float8  # noqa: F401
        import torchao.prototype.moe_training.config  # noqa: F401
    except Exception as exc:  # an ImportError, or a torchao built for another torch failing at import
        return f"torchao is not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    version = tuple(int(p) for p in torchao.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version < MIN_TORCHAO:
        return f"torchao {torchao.__version__} is older than {'.'.join(map(str, MIN_TORCHAO))}"
    return None


def experts_why(device: torch.device) -> str | None:
    """Why the experts cannot run torchao's FP8 rowwise grouped GEMMs on ``device`` (None: they can)."""
    if device.type != "cuda":
        return ("torch._scaled_grouped_mm and torchao's Triton FP8 quantization kernels need CUDA (SM90); "
                f"this device is {device.type}")
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"torch._scaled_grouped_mm's FP8 rowwise kernels are built for SM90; this device is sm_{major}{minor}"
    return None


def peer_why(precision: str, device: torch.device) -> str | None:
    """Why the torch and FSDP2 builds of ``precision`` are not run (None: they run converted). On a GPU the
    peer is the whole recipe or nothing; on a CPU (a smoke run) its experts stay bf16 and its rows say so."""
    if precision != "fp8_per_tensor":
        return ("the torchao peer (torchtitan's float8: tensorwise attention projections, rowwise grouped "
                "experts) is compared under fp8_per_tensor; no peer is built for " + precision)
    why = import_error()
    if why is None and device.type == "cuda":
        why = experts_why(device)
    return why


def pad_plan(m_splits_E: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src_P, dst_A, offs_E)`` for ``rows`` rows sorted by expert, ``m_splits_E`` per expert: padded row
    p takes row ``src_P[p]`` (``rows``: a zero row), row a lands at ``dst_A[a]``, and ``offs_E`` (int32) are
    the padded groups' end offsets ([Note: experts padded to 16 rows])."""
    E = m_splits_E.numel()
    padded_E = (m_splits_E.clamp_min(1) + ALIGN - 1) // ALIGN * ALIGN
    offs_E = padded_E.cumsum(0)
    ends_E = m_splits_E.cumsum(0)
    a = torch.arange(rows, device=m_splits_E.device)
    expert_A = torch.searchsorted(ends_E, a, right=True)
    dst_A = a + (offs_E - padded_E - ends_E + m_splits_E)[expert_A]
    P = (rows + E * ALIGN + ALIGN - 1) // ALIGN * ALIGN  # a static bound on padded_E.sum()
    src_P = torch.full((P,), rows, dtype=a.dtype, device=a.device).scatter_(0, dst_A, a)
    return src_P, dst_A, offs_E.to(torch.int32)


class Float8Experts(nn.Module):
    """The plain build's packed experts (``[E, N, K]``, one ``torch._grouped_mm``) with each token group padded
    to 16 rows; once ``quantize_`` wraps ``weight``, torchao's ``__torch_function__`` runs the grouped GEMM in
    FP8 rowwise. The weight is used as it is (fp32 master, or FSDP2's bf16): torchao quantizes either."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x_AK: torch.Tensor, m_splits_E: torch.Tensor) -> torch.Tensor:
        src_P, dst_A, offs_E = pad_plan(m_splits_E, x_AK.shape[0])
        x_PK = F.pad(x_AK, (0, 0, 0, 1))[src_P]  # the appended zero row fills the padding
        y_PN = torch._grouped_mm(x_PK, self.weight.transpose(-2, -1), offs=offs_E)
        return y_PN[dst_A]


def _linear(leaf: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` holding ``leaf``'s own weight ``Parameter`` (not a copy)."""
    n, k = leaf.weight.shape
    linear = nn.Linear(k, n, bias=False, device="meta")
    linear.weight = leaf.weight
    return linear


def convert(model: nn.Module, *, tokens: int, experts: bool) -> dict[str, Any]:
    """Converts the plain ``MoEGPT(sharded=False, experts="grouped_mm")`` in place (before ``fully_shard``,
    ``compile`` or DDP, as torchtitan orders them) and returns the facts its rows record. ``tokens``: rows of
    one attention GEMM (a microbatch on a rank); ``experts``: convert the experts too (:func:`experts_why`)."""
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    for block in model.blocks:
        for name in ATTENTION:
            parent, attr = block.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            leaf = getattr(parent, attr)
            if leaf.weight is model.embedding.weight:
                raise ValueError(f"{name} shares the embedding's weight; only untied projections are converted")
            setattr(parent, attr, _linear(leaf))
    # The wgrad's inner dimension is the tokens, which _scaled_mm needs a multiple of 16 (here S-1 a row: 8 x 2047
    # in the large preset's b8). torchao's one flag pads all three GEMMs' FP8 operands, a copy where it is no need.
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), pad_inner_dim=tokens % ALIGN != 0)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn.endswith(ATTENTION))
    facts: dict[str, Any] = {
        "recipe": "torchao", "torchao": torchao.__version__,
        "fp8_linears": f"Float8Linear tensorwise on {', '.join(ATTENTION)} (pad_inner_dim={config.pad_inner_dim})",
        "bf16_kept": "embedding/lm_head (tied), routers"}
    if experts:
        for block in model.blocks:
            for name in ("fc1", "fc2"):
                setattr(block.moe, name, Float8Experts(getattr(block.moe, name).weight))
        quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, _: isinstance(m, Float8Experts))
        facts.update(fp8_experts=True, experts="torchao FP8 rowwise scaled grouped GEMMs (Float8TrainingOpConfig), "
                                               "token groups padded to 16 rows")
    else:
        facts.update(fp8_experts=False, experts="torch._grouped_mm bf16, not converted: " + str(experts_why(
            next(model.parameters()).device)))
    return facts
