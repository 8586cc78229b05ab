"""``ops.GroupedLinear``: TransformerEngine's fusible-ops grouped linear (``te.ops.GroupedLinear``).

:class:`distwgrad.nn.GroupedLinear` with the ops path's constructor, init and ``forward(x, split_sizes)``.
Under ``delay_wgrad_compute`` only the weights wait for ``backward_dw()`` (and carry
``skip_backward_post_hook``); the biases' gradients come from the main backward.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence

import torch

from distwgrad.nn.grouped_linear import GroupedLinear as _GroupedLinear
from distwgrad.protocol import is_distributed_weight

__all__ = ["GroupedLinear"]

_WEIGHT_NAME = re.compile(r"weight\d*")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class GroupedLinear(_GroupedLinear):
    """``num_groups`` linear maps on consecutive token groups: ``y_i = x_i W_i^T + b_i``.

    Args (TransformerEngine's):
        num_groups, in_features, out_features: G, K and N. dtype: fp32, fp16 or bf16.
        rng_state_tracker_function: returns a tracker whose ``fork()`` the weights are initialised in.
        accumulate_into_main_grad: wgrads add into fp32 ``main_grad`` ([Note: the fused .grad contract]).
        single_grouped_weight, single_grouped_bias: one packed ``weight`` ``[G, N, K]`` / ``bias`` ``[G, N]``;
            with a bias, both or neither. scale_bias: refused (not implemented).

    ``forward(x, split_sizes)``: a size per group (int64 tensor or ints), summing to ``x``'s leading tokens.
    """

    num_extra_inputs = 1  # split_sizes: ops.Sequential hands it over
    _biases_in_main_backward = True

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 rng_state_tracker_function: Callable[[], object] | None = None,
                 accumulate_into_main_grad: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, delay_wgrad_compute: bool = False,
                 scale_bias: bool = False) -> None:
        owner = f"ops.GroupedLinear({num_groups}, {in_features}, {out_features})"
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"{owner}: dtype must be one of {_DTYPES}, got {dtype!r}")
        if bias and bool(single_grouped_bias) != bool(single_grouped_weight):
            raise ValueError(f"{owner}: single_grouped_weight={single_grouped_weight!r} with "
                             f"single_grouped_bias={single_grouped_bias!r}: distwgrad packs the weights and the "
                             f"biases together or neither")
        if scale_bias:
            raise ValueError(f"{owner}: scale_bias=True (the bias times a per-token probability, an extra input) "
                             f"is not implemented; add the scaled bias outside the op")
        if rng_state_tracker_function is not None and not callable(rng_state_tracker_function):
            raise TypeError(f"{owner}: rng_state_tracker_function must be callable, got "
                            f"{rng_state_tracker_function!r}")
        super().__init__(num_groups, in_features, out_features, bias, params_dtype=dtype, device=device,
                         single_grouped_weight=single_grouped_weight, delay_wgrad_compute=delay_wgrad_compute,
                         fuse_wgrad_accumulation=accumulate_into_main_grad)
        self.num_groups, self.single_grouped_bias = num_groups, bool(single_grouped_bias and bias)
        self._rng_state_tracker_function = rng_state_tracker_function
        self.wgrad_store.owner = owner
        # TE's registration order, which parameters() follows: every weight, then every bias
        ordered = sorted(self._parameters.items(), key=lambda item: not _WEIGHT_NAME.fullmatch(item[0]))
        self._parameters = dict(ordered)
        self.reset_parameters()

    @property
    def has_bias(self) -> bool:
        return self.use_bias

    def reset_parameters(self) -> None:
        """TE's init: each group's weight Kaiming-uniform (``a=sqrt(5)``) in the tracker's ``fork()``, biases zero."""
        params = self._weights() + self._biases()
        if any(is_distributed_weight(p) for p in params):
            raise ValueError(f"{self.wgrad_store.owner}.reset_parameters(): a distributed weight is initialised "
                             f"from its full value (ShardedWeight.from_full), not in place")
        if any(p.device.type == "meta" for p in params):
            return
        with torch.no_grad():
            for w in self._weights():
                for matrix in (w.unbind(0) if self.single_grouped_weight else [w]):
                    tracker = self._rng_state_tracker_function
                    with tracker().fork() if tracker is not None else contextlib.nullcontext():
                        torch.nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
            for b in self._biases():
                b.zero_()

    def forward(self, input: torch.Tensor, split_sizes: Sequence[int] | torch.Tensor):  # noqa: A002  TE's name
        if self.fuse_wgrad_accumulation and any(getattr(w, "overwrite_main_grad", False) for w in self._weights()):
            raise ValueError(f"{self.wgrad_store.owner}: overwrite_main_grad=True on a weight is not supported "
                             f"(the wgrad is always added into main_grad); zero main_grad instead")
        return super().forward(input, split_sizes)

    def _defers(self, name: str) -> bool:
        return _WEIGHT_NAME.fullmatch(name) is not None

    def _deferred(self, p: torch.Tensor) -> bool:
        return self.delay_wgrad_compute and any(p is w for w in self._weights())
