"""Deferred wgrad scheduling, the accumulation contract, and the step's finalize."""

from distwgrad.wgrad.accumulate import add_to_grad, main_grad_of
from distwgrad.wgrad.finalize import distributed_parameters, finalize_model_grads, name_weights
from distwgrad.wgrad.scheduler import (
    deferred_modules,
    deferred_wgrad_scope,
    drain_deferred_wgrads,
    undrained,
)
from distwgrad.wgrad.store import DeferredWgradError, WeightGradStore

__all__ = ["add_to_grad", "main_grad_of", "finalize_model_grads", "distributed_parameters", "name_weights",
           "deferred_modules", "deferred_wgrad_scope", "drain_deferred_wgrads", "undrained",
           "DeferredWgradError", "WeightGradStore"]
