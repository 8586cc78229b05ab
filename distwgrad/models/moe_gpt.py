"""A small GPT with a mixture-of-experts MLP, built only from distwgrad modules.

Legend: B sequences, S positions, T = B*S tokens, D ``d_model``, H heads, E experts, F ``d_ff`` (expert
hidden width), V vocabulary, A = T*top_k token-to-expert assignments.

``sharded=False`` builds the same architecture from plain ``torch`` ops on ``nn.Parameter``s of the same
names: the independent oracle of ``--check-parity`` (a distwgrad bug cannot hide on both sides). Both start
from :func:`init_full_weights`, so a model is a pure function of its config at any world size. The experts'
wgrads are deferred: ``distwgrad.drain_deferred_wgrads`` before ``distwgrad.finalize_model_grads``.

[Note: the model's mixed precision]
``param_dtype`` computes in that dtype over fp32 masters (the oracle casts inside autograd at each use, so
its gradients are fp32 too); RMSNorm's mean of squares, the router's softmax and the loss run in fp32. The
rotary tables are cast to the activations' dtype so an fp32 buffer does not promote bf16; the rotation itself runs
in fp32 with one rounding in eager mode on CUDA and under compile, in the activations' dtype elsewhere
(``distwgrad.ops.rotary``). Under FP8 the
router's GEMMs stay in ``param_dtype`` ([Note: a module out of FP8] in ``distwgrad/nn/linear.py``).

[Note: load balancing]
``aux_loss_coef > 0`` adds each MoE layer's Switch Transformer loss ``E * sum_e f_e * P_e`` (``f_e``: share
of assignments, no gradient; ``P_e``: mean router probability) to ``MoEGPT.loss``. Each rank balances the
tokens it routes, as Megatron-core does, so a batch split over ranks gets the mean of the ranks' losses.

[Note: tied embedding]
``lm_head`` uses ``embedding.weight`` itself: both uses accumulate into one buffer, the weight reduces once,
and ``named_parameters()`` and checkpoints list it once, as ``embedding.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distwgrad.nn import Embedding, GroupedLinear, Linear
from distwgrad.ops.rotary import rotate_halves
from distwgrad.parallel.experts import ExpertParallel
from distwgrad.weights import ShardedWeight

__all__ = ["MoEGPTConfig", "MoEGPT", "init_full_weights", "load_balancing_loss", "EXPERTS"]

EXPERTS = ("loop", "grouped_mm")  # the plain build's expert GEMMs (MoEGPT's ``experts``)


@dataclass(frozen=True)
class MoEGPTConfig:
    """Shape and initialisation of :class:`MoEGPT`; validated on construction."""

    vocab_size: int = 64
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    d_ff: int = 128
    init_std: float = 0.02
    seed: int = 0
    aux_loss_coef: float = 0.0  # the router's load-balancing loss in ``MoEGPT.loss`` ([Note: load balancing])

    def __post_init__(self) -> None:
        ints = {k: getattr(self, k) for k in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads",
                                               "n_experts", "top_k", "d_ff")}
        bad = {k: v for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0}
        if bad:
            raise ValueError(f"model sizes must be positive ints, got {bad}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must split into n_heads={self.n_heads} heads of even "
                             f"width (rotary embeddings rotate pairs)")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be at most n_experts={self.n_experts}")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be positive, got {self.init_std}")
        if not (isinstance(self.aux_loss_coef, (int, float)) and 0 <= self.aux_loss_coef < math.inf):
            raise ValueError(f"aux_loss_coef must be a finite number >= 0, got {self.aux_loss_coef!r}")

    def architecture(self) -> dict[str, Any]:
        """What a checkpoint must match: every field but ``aux_loss_coef``, so a run may resume with another."""
        return {k: v for k, v in self.__dict__.items() if k != "aux_loss_coef"}

    def num_params(self) -> int:
        """Parameters, the tied embedding counted once."""
        D, F_, E = self.d_model, self.d_ff, self.n_experts
        return self.vocab_size * D + self.n_layers * (4 * D * D + E * D + 2 * E * F_ * D)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: ``6 * N_active`` (the weights a token multiplies by) plus
        causal attention's ``6 * L * S * D`` (PaLM, appendix B)."""
        D, L = self.d_model, self.n_layers
        active = L * (4 * D * D + self.n_experts * D + 2 * self.top_k * self.d_ff * D) + self.vocab_size * D
        return 6 * active + 6 * L * self.seq_len * D


def init_full_weights(config: MoEGPTConfig) -> dict[str, torch.Tensor]:
    """Full fp32 weights by parameter name, deterministic in ``config.seed``; output projections
    scaled by ``1/sqrt(2 * n_layers)`` (GPT-2) so the residual stream does not grow with depth."""
    c = config
    g = torch.Generator().manual_seed(c.seed)
    normal = lambda *shape, std=c.init_std: torch.randn(*shape, generator=g) * std
    out_std = c.init_std / math.sqrt(2 * c.n_layers)
    weights = {"embedding.weight": normal(c.vocab_size, c.d_model)}
    for i in range(c.n_layers):
        p = f"blocks.{i}."
        weights[p + "attn.qkv.weight"] = normal(3 * c.d_model, c.d_model)
        weights[p + "attn.proj.weight"] = normal(c.d_model, c.d_model, std=out_std)
        weights[p + "moe.router.weight"] = normal(c.n_experts, c.d_model)
        weights[p + "moe.fc1.weight"] = normal(c.n_experts, c.d_ff, c.d_model)
        weights[p + "moe.fc2.weight"] = normal(c.n_experts, c.d_model, c.d_ff, std=out_std)
    return weights


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim, computed in fp32 and returned in ``x``'s dtype: torch's
    ``F.rms_norm``, one fused kernel each way on CUDA where ``x * rsqrt(mean(x^2) + eps)`` in fp32 takes about
    seven passes over ``x`` in eager mode (on the CPU its bits are that formula's: ``tests/test_moe_gpt_norm.py``)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def _rotary_tables(seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


# --- the oracle's leaves (sharded=False): plain torch, no distwgrad code -------------------------------

class _TorchLeaf(nn.Module):
    """A plain parameter, cast to ``param_dtype`` inside autograd at each use ([Note: the model's mixed precision])."""

    def __init__(self, weight: torch.Tensor, param_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight, self.param_dtype = weight, param_dtype

    def w(self) -> torch.Tensor:
        return self.weight if self.param_dtype is None else self.weight.to(self.param_dtype)


class _TorchEmbedding(_TorchLeaf):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w())


class _TorchLinear(_TorchLeaf):
    """``F.linear`` without bias on a given (possibly tied) parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w())


class _TorchExperts(_TorchLeaf):
    """A packed ``[E, N, K]`` weight on each expert's contiguous tokens: a ``F.linear`` loop or one
    ``torch._grouped_mm`` (int32 end offsets; bf16 needs K and N multiples of 8)."""

    def __init__(self, weight: torch.Tensor, param_dtype: torch.dtype | None, experts: str) -> None:
        super().__init__(weight, param_dtype)
        self.experts = experts

    def forward(self, x_AK: torch.Tensor, m_splits_E: torch.Tensor) -> torch.Tensor:
        w_ENK = self.w()
        if self.experts == "grouped_mm":
            offs_E = m_splits_E.cumsum(0).to(torch.int32)
            return torch._grouped_mm(x_AK, w_ENK.transpose(-2, -1), offs=offs_E)
        groups = x_AK.split(m_splits_E.tolist())
        return torch.cat([F.linear(x, w) for x, w in zip(groups, w_ENK.unbind(0))])


def _linear(sharded: bool, weight: torch.Tensor, param_dtype: torch.dtype | None = None, *,
            fp8_exempt: bool = False) -> nn.Module:
    if not sharded:
        return _TorchLinear(weight, param_dtype)
    n, k = getattr(weight, "full_shape", weight.shape)
    return Linear(k, n, bias=False, weight=weight, fp8_exempt=fp8_exempt)


def _experts(sharded: bool, weight: torch.Tensor, param_dtype: torch.dtype | None = None,
             experts: str = "loop") -> nn.Module:
    """distwgrad ``GroupedLinear`` (packed weight, deferred wgrads) or the oracle's plain-torch experts."""
    if not sharded:
        return _TorchExperts(weight, param_dtype, experts)
    e, n, k = getattr(weight, "full_shape", weight.shape)
    layer = GroupedLinear(e, k, n, bias=False, single_grouped_weight=True, delay_wgrad_compute=True,
                          device="meta")  # built on "meta", then given the real weight
    layer.weight = weight  # type: ignore[assignment]  # any (distributed) tensor; nn.Module registers it
    return layer


# --- the model -------------------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with rotary positions."""

    def __init__(self, config: MoEGPTConfig, qkv: nn.Module, proj: nn.Module) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv, self.proj = qkv, proj
        cos, sin = _rotary_tables(config.seq_len, config.d_model // config.n_heads)
        device = next(qkv.parameters()).device
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = (t.view(B, S, self.n_heads, D // self.n_heads).transpose(1, 2)
                   for t in self.qkv(x_BSD).split(D, dim=-1))
        # fp32 tables, cast to the activations' dtype ([Note: the model's mixed precision])
        cos, sin = (self.get_buffer(n)[:S].to(q.dtype) for n in ("cos", "sin"))
        y_BHSd = F.scaled_dot_product_attention(rotate_halves(q, cos, sin), rotate_halves(k, cos, sin), v,
                                                 is_causal=True)
        return self.proj(y_BHSd.transpose(1, 2).reshape(B, S, D))


def combine(y_AD: torch.Tensor, order_A: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's ``top_k`` expert outputs summed; ``order_A``: the expert sort ([Note: the experts' combine])."""
    return torch.empty_like(y_AD).index_copy(0, order_A, y_AD).view(-1, top_k, y_AD.shape[-1]).sum(dim=1)


def load_balancing_loss(probs_TE: torch.Tensor, m_splits_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` from the router's fp32 softmax and assignments per expert ([Note: load balancing])."""
    T, E = probs_TE.shape
    f_E = m_splits_E.to(probs_TE.dtype) / (T * top_k)
    return E * (f_E * probs_TE.mean(dim=0)).sum()


class MoE(nn.Module):
    """Top-k routed experts: a softmax router, then gate-weighted ``fc2(gelu(fc1(x)))`` per expert.

    [Note: the experts' combine]
    Tokens are stably sorted by expert (``GroupedLinear``'s ``m_splits`` layout); outputs go back by
    ``index_copy`` through the sort and each token's ``top_k`` rows are summed: unlike a bf16 ``index_add``
    (CUDA atomics) this is deterministic, and bit-equal for ``top_k <= 2``.
    """

    def __init__(self, config: MoEGPTConfig, router: nn.Module, fc1: nn.Module, fc2: nn.Module,
                 ep: ExpertParallel | None = None) -> None:
        """``ep``: experts split over an expert-parallel group ([Note: expert-parallel dispatch])."""
        super().__init__()
        self.top_k, self.n_experts, self.balance = config.top_k, config.n_experts, config.aux_loss_coef > 0
        self.router, self.fc1, self.fc2, self.ep = router, fc1, fc2, ep
        self.aux_loss: torch.Tensor | None = None  # the last forward's ([Note: load balancing])

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        E = self.n_experts
        probs_TE = self.router(x_TD).float().softmax(dim=-1)
        gate_TK, expert_TK = probs_TE.topk(self.top_k, dim=-1)
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)
        expert_A = expert_TK.reshape(-1)
        order_A = torch.argsort(expert_A, stable=True)
        token_A = order_A // self.top_k
        # tokens per expert without a host sync (CUDA bincount reads the max on the host): integer adds,
        # the same counts as torch.bincount(expert_A, minlength=E), in int64 as it gives them
        m_splits_E = torch.zeros(E, dtype=torch.int64, device=expert_A.device).scatter_add_(
            0, expert_A, torch.ones_like(expert_A))
        self.aux_loss = load_balancing_loss(probs_TE, m_splits_E, self.top_k) if self.balance else None
        x_AD = x_TD[token_A]
        if self.ep is None:
            y_AD = self.fc2(F.gelu(self.fc1(x_AD, m_splits_E)), m_splits_E)
        else:
            x_local, m_local, route = self.ep.dispatch(x_AD, m_splits_E, overlap=self._drain_experts)
            y_AD = self.ep.combine(self.fc2(F.gelu(self.fc1(x_local, m_local)), m_local), route)
        y_AD = y_AD * gate_TK.reshape(-1)[order_A].unsqueeze(1).to(x_TD.dtype)
        return combine(y_AD, order_A, self.top_k)

    def _drain_experts(self) -> None:
        """Runs the experts' queued wgrads while the dispatch's gradient travels ([Note: the dispatch's
        backward hides behind the experts' wgrads] in ``distwgrad/parallel/experts.py``)."""
        fc: Any
        for fc in (self.fc2, self.fc1):  # the order backward queued them in
            while getattr(fc, "pending_backward_dw", 0):
                fc.backward_dw()


class Block(nn.Module):
    """``expert_weight``: builds the experts' packed weights (default ``weight``); ``ep``: as ``MoE``'s."""

    def __init__(self, config: MoEGPTConfig, weight: Callable[[str], torch.Tensor], prefix: str,
                 sharded: bool, param_dtype: torch.dtype | None, experts: str,
                 expert_weight: Callable[[str], torch.Tensor] | None = None, ep: ExpertParallel | None = None) -> None:
        super().__init__()
        expert_weight = expert_weight or weight
        lin = lambda name, **kw: _linear(sharded, weight(prefix + name), param_dtype, **kw)
        exp = lambda name: _experts(sharded, expert_weight(prefix + name), param_dtype, experts)
        self.attn = CausalSelfAttention(config, lin("attn.qkv.weight"), lin("attn.proj.weight"))
        router = lin("moe.router.weight", fp8_exempt=True)  # never FP8: [Note: the model's mixed precision]
        self.moe = MoE(config, router, exp("moe.fc1.weight"), exp("moe.fc2.weight"), ep)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.attn(rms_norm(x_BSD))
        return x_BSD + self.moe(rms_norm(x_BSD).flatten(0, 1)).view_as(x_BSD)


class MoEGPT(nn.Module):
    """Decoder-only transformer: tied embedding, causal attention, MoE MLP, parameter-free norms.

    Args:
        config: the model's shape and seed; device: where the weights live.
        group: the process group they shard over (None: the default group, if any).
        sharded: distwgrad modules on ``ShardedWeight``s (True), or the plain-torch oracle (False).
        param_dtype: compute dtype over fp32 masters ([Note: the model's mixed precision]); None: fp32.
        experts: the plain build's expert GEMMs, ``"loop"`` or ``"grouped_mm"``.
        ep_mesh: expert parallelism: a ``DeviceMesh`` with dims ``("ep", "dp")`` ([Note: expert-parallel dispatch]).
    """

    def __init__(self, config: MoEGPTConfig, *, device: torch.device | str | None = None, group: Any = None,
                 sharded: bool = True, param_dtype: torch.dtype | None = None, experts: str = "loop",
                 ep_mesh: Any = None) -> None:
        super().__init__()
        if not isinstance(config, MoEGPTConfig):
            raise TypeError(f"config must be a MoEGPTConfig, got {type(config).__name__}")
        if experts not in EXPERTS or (sharded and experts != "loop"):
            raise ValueError(f"experts={experts!r} must be one of {EXPERTS}; {EXPERTS[1:]} only with "
                             f"sharded=False (got sharded={sharded})")
        if param_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got "
                             f"{param_dtype!r}")
        self.config, self.param_dtype = config, param_dtype
        full = init_full_weights(config)

        def weight(name: str) -> torch.Tensor:
            t = full.pop(name).to(device)
            if not sharded:
                return nn.Parameter(t)
            # async_reduce: each reduce-scatter overlaps the rest of backward; finalize waits for it.
            return ShardedWeight.from_full(t, group=group, async_reduce=True, param_dtype=param_dtype)

        ep, expert_weight = None, None
        if ep_mesh is not None:
            if not sharded or getattr(ep_mesh, "mesh_dim_names", None) != ("ep", "dp"):
                raise ValueError(f"ep_mesh must be a DeviceMesh with dims ('ep', 'dp') and sharded=True, got "
                                 f"{ep_mesh!r} with sharded={sharded}")
            ep = ExpertParallel(config.n_experts, ep_mesh.get_group("ep"))

            def expert_weight(name: str) -> torch.Tensor:
                t = ep.local_slice(full.pop(name)).to(device)
                w = ShardedWeight.from_full(t, group=ep_mesh.get_group("dp"), async_reduce=True,
                                            param_dtype=param_dtype)
                w.spread_over_experts(ep_mesh)
                return w

        c = config
        self.embedding: nn.Module
        if sharded:
            self.embedding = Embedding(c.vocab_size, c.d_model, weight=weight("embedding.weight"))
        else:
            self.embedding = _TorchEmbedding(weight("embedding.weight"), param_dtype)
        self.blocks = nn.ModuleList(Block(c, weight, f"blocks.{i}.", sharded, param_dtype, experts, expert_weight, ep)
                                    for i in range(c.n_layers))
        # [Note: tied embedding]: the same object, not a copy.
        self.lm_head = _linear(sharded, self.embedding.weight, param_dtype)
        assert not full, f"unused initial weights {sorted(full)}"

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, S, V]`` for token ids ``[B, S]`` (S at most ``config.seq_len``)."""
        if ids_BS.dim() != 2 or ids_BS.shape[1] > self.config.seq_len:
            raise ValueError(f"ids must be [batch, seq <= {self.config.seq_len}], got {tuple(ids_BS.shape)}")
        x_BSD = self.embedding(ids_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.lm_head(rms_norm(x_BSD))

    def loss(self, ids_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in fp32, plus ``aux_loss_coef`` times the load-balancing losses."""
        logits_BSV = self(ids_BS)
        ce = F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())
        if not self.config.aux_loss_coef:
            return ce
        aux = torch.stack([b.moe.aux_loss for b in self.blocks]).sum()  # type: ignore[misc]
        return ce + self.config.aux_loss_coef * aux
