"""Integrations with training frameworks that drive distwgrad's modules and weights.

``megatron``: the schedule hooks of megatron-core's ``ModelParallelConfig`` (``finalize_model_grads_func``,
``no_sync_func``, ``grad_sync_func``, ``param_sync_func``) and Megatron's grad-ready hooks, backed by
distwgrad's contribution accounting (``docs/megatron.md``). It does not import megatron-core.

Submodules load on first access, so ``import distwgrad.integrations`` stays cheap.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["megatron"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
