"""``LayerNormLinear``: y = norm(x) W^T + b, TransformerEngine's ``te.LayerNormLinear``.

``Linear`` on the normalized input, so GEMMs, deferred wgrads, ``main_grad`` and FP8 are Linear's; the norm's
parameters get their gradients in the main backward (``nn/_norm.py``): only ``weight`` and ``bias`` defer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distwgrad.nn._norm import apply_norm, init_norm
from distwgrad.nn.linear import Linear

__all__ = ["LayerNormLinear"]


class LayerNormLinear(Linear):
    """A normalization followed by a :class:`distwgrad.nn.Linear`, with TransformerEngine's names.

    Args:
        normalization: ``"LayerNorm"`` (``layer_norm_weight``, ``layer_norm_bias``) or ``"RMSNorm"`` (weight only).
        zero_centered_gamma: the norm scales by ``1 + layer_norm_weight`` (zeros at first).
        return_layernorm_output: also return the norm's output: ``(out, ln_out)`` or ``(out, bias, ln_out)``.
        eps: the norm's epsilon; the rest as in :class:`Linear`.
    """

    deferred_param_names = ("weight", "bias")

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *, bias: bool | torch.Tensor = True,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, params_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, delay_wgrad_compute: bool = False,
                 fuse_wgrad_accumulation: bool = False, weight: torch.Tensor | None = None,
                 init_method: Callable[[torch.Tensor], object] | None = None, return_bias: bool = False,
                 fp8_exempt: bool = False, sequence_parallel: bool = False, tp_group=None, tp_size: int = 1,
                 parallel_mode: str | None = None) -> None:
        super().__init__(in_features, out_features, bias, params_dtype=params_dtype, device=device,
                         delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                         weight=weight, init_method=init_method, return_bias=return_bias, fp8_exempt=fp8_exempt,
                         sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=tp_size,
                         parallel_mode=parallel_mode)
        self.wgrad_store.owner = f"LayerNormLinear({in_features}, {out_features})"
        self.return_layernorm_output = bool(return_layernorm_output)
        init_norm(self, in_features, normalization=normalization, eps=eps, zero_centered_gamma=zero_centered_gamma,
                  dtype=self._compute_dtype, device=self.weight.device)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        self._check_input(inp)
        ln_out = apply_norm(self, inp)
        out = super().forward(ln_out, is_first_microbatch)
        if not self.return_layernorm_output:
            return out
        return (*out, ln_out) if self.return_bias else (out, ln_out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalization={self.normalization}, eps={self.eps}"
