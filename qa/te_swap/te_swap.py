"""The import swap: TransformerEngine's public test files, unedited, run against distwgrad.

A pytest plugin (``-p te_swap`` with ``qa/te_swap`` on ``PYTHONPATH``; ``qa/te_swap/run.sh`` does both). On
load it puts a finder first on ``sys.meta_path`` that answers every import of ``transformer_engine`` and
``transformer_engine_torch``:

- ``transformer_engine.pytorch`` is ``distwgrad.nn`` (``.ops`` is ``distwgrad.nn.ops``, ``.distributed_weight``
  ``distwgrad.protocol``), ``transformer_engine.common.recipe`` is ``distwgrad.fp8.recipe`` (``_MODULES``):
  what a user's swap of the import gives them;
- the helpers TE's test files import from TE's internals (``is_fp8_available``,
  ``is_module_grouped_tensor_path_supported``, ``FP8GlobalStateManager.reset``, ...) answer for distwgrad
  (``_HELPERS``);
- any other name resolves to a placeholder (``_Missing``): the file imports, and only the tests that use
  one (attention, NVFP4, TE's quantizer objects) fail, each with ``MissingFromDistwgrad`` naming what
  distwgrad lacks.

Nothing here changes what distwgrad computes; a test passes or fails on distwgrad's own modules.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

import torch

_ROOTS = ("transformer_engine", "transformer_engine_torch")
_MODULES = {  # TransformerEngine's module -> distwgrad's
    "transformer_engine.pytorch": "distwgrad.nn",
    "transformer_engine.pytorch.ops": "distwgrad.nn.ops",
    "transformer_engine.pytorch.distributed_weight": "distwgrad.protocol",
    "transformer_engine.common.recipe": "distwgrad.fp8.recipe",
}


class MissingFromDistwgrad(NotImplementedError):
    """A test used a TransformerEngine name that distwgrad does not provide."""


_COLLECTING = [True]  # pytest imports the test files while it collects; tests run after


class _Missing:
    """A TransformerEngine name distwgrad does not provide. While pytest collects (the test files import, and
    build parametrize values such as TE quantizers), using it gives another placeholder; in a test, calling
    it, entering it or iterating it raises ``MissingFromDistwgrad`` naming it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        if _COLLECTING[0]:
            return _Missing(f"{self._name}(...)")
        raise MissingFromDistwgrad(f"{self._name} is not provided by distwgrad")

    def _refuse(self, *args, **kwargs):
        raise MissingFromDistwgrad(f"{self._name} is not provided by distwgrad")

    __enter__ = _refuse
    __iter__ = _refuse
    __bool__ = lambda self: False  # noqa: E731  a missing feature flag reads as off

    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<{self._name}: not provided by distwgrad>"

    def __mro_entries__(self, bases):  # ``class X(te.Missing)`` imports, instantiating it refuses
        return (_MissingBase,)


class _MissingBase:
    def __init__(self, *args, **kwargs):
        raise MissingFromDistwgrad(f"{type(self).__name__} derives from a name distwgrad does not provide")


def _cuda_capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def _availability(ok: bool, why: str):
    def check(return_reason: bool = False):
        return (ok, "" if ok else why) if return_reason else ok
    return check


class _FP8GlobalStateManager:
    """TE's global FP8 state; distwgrad keeps the active recipe in a context variable and no amax
    history, so there is nothing global to reset."""

    @staticmethod
    def reset() -> None:
        pass

    @staticmethod
    def is_fp8_available(return_reason: bool = False):
        return _HELPERS["transformer_engine.pytorch"]["is_fp8_available"](return_reason)


def _window_size(attn_mask_type: str, window_size=None):
    """TE's default sliding window for a mask type: what its test utilities' ``ModelConfig`` stores (its
    attention tests read it; distwgrad has no attention)."""
    if window_size is not None:
        return window_size
    return (-1, 0) if "causal" in attn_mask_type else (-1, -1)


def _helpers() -> dict[str, dict[str, object]]:
    fp8 = _cuda_capability() >= (8, 9)
    block = _cuda_capability() >= (9, 0)
    packed = lambda *args, **kwargs: True  # noqa: E731  distwgrad's packed grouped weights run everywhere
    top = {
        "is_fp8_available": _availability(fp8, "FP8 GEMMs need sm_89 or newer"),
        "is_fp8_block_scaling_available": _availability(block, "blockwise FP8 needs sm_90 or newer"),
        "is_mxfp8_available": _availability(False, "distwgrad has no MXFP8 recipe"),
        "is_nvfp4_available": _availability(False, "distwgrad has no NVFP4 recipe"),
        "is_bf16_available": _availability(not torch.cuda.is_available() or _cuda_capability() >= (8, 0),
                                           "bf16 needs sm_80 or newer"),
        "FP8GlobalStateManager": _FP8GlobalStateManager,
        "get_device_compute_capability": _cuda_capability,
    }
    return {
        "transformer_engine.pytorch": top,
        "transformer_engine.pytorch.quantization": top,
        "transformer_engine.pytorch.fp8": top,
        "transformer_engine.pytorch.utils": top,
        "transformer_engine.pytorch.attention.dot_product_attention.utils": {"check_set_window_size": _window_size},
        "transformer_engine.pytorch.module.grouped_linear": {"is_module_grouped_tensor_path_supported": packed},
        "transformer_engine.pytorch.ops.basic.grouped_linear": {"is_op_fuser_grouped_tensor_path_supported": packed},
    }


_HELPERS: dict[str, dict[str, object]] = {}


class _SwapModule(types.ModuleType):
    """A TransformerEngine module: distwgrad's module where there is one, then the helpers, then
    placeholders."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package: its submodules import through the finder too, and the
        # import system binds each one here as an attribute once loaded
        target = _MODULES.get(name)
        self._target = importlib.import_module(target) if target else None
        self.__dict__.update(_HELPERS.get(name, {}))

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if self._target is not None and hasattr(self._target, attr):
            return getattr(self._target, attr)
        child = f"{self.__name__}.{attr}"
        if any(known == child or known.startswith(child + ".") for known in (*_MODULES, *_HELPERS)):
            return importlib.import_module(child)  # ``from transformer_engine.common import recipe``
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _SwapModule(spec.name)

    def exec_module(self, module):
        pass


def pytest_collection_finish(session) -> None:
    """Collection is over: from here a missing name that a test calls raises."""
    _COLLECTING[0] = False


def install() -> None:
    """Answer ``transformer_engine`` imports with distwgrad's modules (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        _HELPERS.update(_helpers())
        sys.meta_path.insert(0, _Finder())


install()
