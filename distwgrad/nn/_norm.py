"""What LayerNormLinear and LayerNormMLP share: the input normalization and the MLP activations.

The normalization is ordinary torch autograd: its parameters (``layer_norm_weight``, and
``layer_norm_bias`` for LayerNorm) get their gradients from the main backward, never from
``backward_dw()``, exactly as in TransformerEngine, so they keep DDP's post-backward hook.
``zero_centered_gamma`` is TE's: gamma starts at zero and the norm scales by ``1 + gamma``.

Activations carry TransformerEngine's names; a gated one (``*glu``) applies ``act`` to the first half of
fc1's output and multiplies by the second half, so fc1 is ``2 * ffn_hidden_size`` wide. ``gelu`` is TE's
tanh approximation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NORMALIZATIONS", "ACTIVATIONS", "init_norm", "apply_norm", "activation"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


_BASE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu, "qgelu": _qgelu, "relu": F.relu, "srelu": _srelu, "silu": F.silu,
}
_GATED = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu", "swiglu": "silu"}
ACTIVATIONS = tuple(_BASE) + tuple(_GATED)


def activation(name: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
    """``(fn, gated)`` for TransformerEngine's activation ``name``; ``fn`` maps fc1's output to fc2's input."""
    if name in _BASE:
        return _BASE[name], False
    if name in _GATED:
        act = _BASE[_GATED[name]]

        def gated(h: torch.Tensor) -> torch.Tensor:
            a, b = h.chunk(2, dim=-1)
            return act(a) * b
        return gated, True
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def init_norm(module: Any, hidden: int, *, normalization: str, eps: float, zero_centered_gamma: bool,
              dtype: torch.dtype, device) -> None:
    """Registers ``layer_norm_weight`` (ones, or zeros with ``zero_centered_gamma``) and, for LayerNorm,
    ``layer_norm_bias`` (zeros) on ``module``; sets ``normalization``, ``eps``, ``zero_centered_gamma``."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    module.normalization, module.eps, module.zero_centered_gamma = normalization, float(eps), bool(zero_centered_gamma)
    init = torch.zeros if zero_centered_gamma else torch.ones
    module.layer_norm_weight = nn.Parameter(init(hidden, dtype=dtype, device=device))
    if normalization == "LayerNorm":
        module.layer_norm_bias = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device))
    else:
        module.register_parameter("layer_norm_bias", None)


def apply_norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The module's normalization of ``x`` over its last dim (torch autograd; see the module docstring)."""
    gamma = module.layer_norm_weight
    if module.zero_centered_gamma:
        gamma = 1 + gamma
    shape = (x.shape[-1],)
    if module.normalization == "LayerNorm":
        return F.layer_norm(x, shape, gamma, module.layer_norm_bias, module.eps)
    return F.rms_norm(x, shape, gamma, module.eps)
