"""``--check-parity``: the unsharded oracle trained in lockstep on rank 0, and its verdict.

[Note: parity]
Top-k routing makes training chaotic, so free-running sharded and unsharded losses part (docs/training.md).
So the oracle (``MoEGPT(sharded=False)``, same init) takes the sharded weights before every step and, on the
global batch, the loss, every gradient and the weights after AdamW (given the sharded gradient) are compared:
they differ by rounding only, so the tolerances are tight. The free-running oracle is reported, not judged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

import distwgrad
from distwgrad.checkpoint import full_tensor
from distwgrad.data import MarkovCorpus, TokenFile
from distwgrad.models import MoEGPT

from .config import TrainConfig
from .step import compile_blocks, forward_backward, optimizer_for, optimizer_step

__all__ = ["Lockstep", "parity_result", "PARITY_LOSS_ATOL", "PARITY_GRAD_RTOL", "PARITY_WEIGHT_RTOL", "PARITY_BF16"]

log = logging.getLogger("distwgrad.train")

# [Note: parity] tolerances. Measured on CPU (2 and 3 ranks, 30 and 200 steps) and one H200 (60 steps):
# loss <= 7e-7, gradient <= 2.3e-6 (relative to the weight's largest gradient entry), weights after the
# update 0 on CPU and 1.2e-7 on the GPU (AdamW is elementwise: given the same gradient and state a shard
# updates as the full tensor does, up to the GPU kernels' vectorisation). A bug is O(1): summing instead
# of averaging over ranks gives a gradient error of 1.0, a lost tied-embedding contribution 1.1.
PARITY_LOSS_ATOL = 1e-5  # ~40 fp32 ulps at a loss of 4
PARITY_GRAD_RTOL = 1e-4  # max |g - g_ref| / max |g_ref|, per weight
PARITY_WEIGHT_RTOL = 1e-6  # max |w - w_ref| / max |w_ref| after the optimizer step, per weight
# bf16 (--precision bf16): both sides compute in bf16 on fp32 masters, the reference casting its fp32 parameters at
# each use ([Note: the model's mixed precision] in distwgrad/models/moe_gpt.py). Measured on CPU (30 steps; 2 ranks,
# default sizes / 3 ranks, the tests' sizes): loss 2.4e-7 / 4.8e-7 (the same bf16 GEMMs on the same chunks give the
# same logits); gradient 5.1e-3 / 4.2e-2: the reference rounds each chunk's wgrad to bf16 (unit roundoff 2**-9 = 2e-3
# of the chunk's gradient, which cancellation between chunks can make large against the summed one) before adding it
# to the fp32 .grad, where distwgrad accumulates in fp32; weights 0.
PARITY_BF16 = {
    "loss_abs": 1e-3,  # room for GPU GEMMs whose bf16 logits differ by an ulp; a bug moves the loss by 1e-2+
    "grad_rel": 1e-1,  # 2.4x the worst measured; the bugs above give 1.0 and 1.1
    "weight_rel": PARITY_WEIGHT_RTOL,  # AdamW on fp32 masters: as in fp32
}


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _reference_model(config: TrainConfig, rt: Any) -> MoEGPT | None:
    """The reference on rank 0: plain eager torch, or under FP8 the distwgrad model whole on a group of one,
    compiled if the run is (inductor's bf16 roundings would otherwise become whole FP8 steps)."""
    mc, pd = config.model_config(), rt.param_dtype
    if config.recipe == "none":
        return MoEGPT(mc, device=rt.device, sharded=False, param_dtype=pd) if rt.rank == 0 else None
    solo = [dist.new_group([r]) for r in range(rt.world_size)]  # every rank creates every group
    if rt.rank != 0:
        return None
    ref = MoEGPT(mc, device=rt.device, sharded=True, group=solo[0], param_dtype=pd)
    if config.compile:
        compile_blocks(ref)
    return ref


class Lockstep:
    """The unsharded reference on rank 0, re-synchronised to the sharded weights before every step."""

    def __init__(self, config: TrainConfig, rt: Any, start: int) -> None:
        self.config, self.rt = config, rt
        self.ref = _reference_model(config, rt)
        self.opt = optimizer_for(self.ref, config) if self.ref is not None else None
        # Updates compare only when both optimizers share their history: not after a resume, where the
        # sharded AdamW state comes from the checkpoint and the reference's starts empty.
        self.compare_weights, self.stepped = start == 0, False
        self.worst = {"loss_abs": 0.0, "grad_rel": 0.0, "weight_rel": 0.0}
        self.ref_loss: list[float] = []

    def _gather(self, model: torch.nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in model.named_parameters():
            local = p.detach() if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
            out[name] = full_tensor(local, p)  # collective: every rank takes part
        return out

    def sync(self, model: torch.nn.Module) -> None:
        """Before a step: compare the reference's own last update with the sharded one, then adopt it."""
        full = self._gather(model, grads=False)
        if self.ref is None:
            return
        with torch.no_grad():
            for name, q in self.ref.named_parameters():
                if self.compare_weights and self.stepped:
                    self.worst["weight_rel"] = max(self.worst["weight_rel"], _max_rel(full[name], q))
                q.copy_(full[name])

    def check(self, model: torch.nn.Module, tokens_BS: torch.Tensor, loss: float, step: int) -> None:
        """After ``finalize_model_grads``: the reference's step on the global batch, compared."""
        grads = self._gather(model, grads=True)
        if self.ref is None:
            return
        # world x microbatches chunks of the global batch are exactly the ranks' microbatches, so the
        # reference quantizes the same activations under a per-tensor FP8 recipe.
        ref_loss = forward_backward(self.ref, tokens_BS.to(self.rt.device),
                                    self.config.microbatches * self.rt.world_size, self.config.recipe).item()
        distwgrad.finalize_model_grads([self.ref])  # plain parameters: a no-op, kept for symmetry
        self.ref_loss.append(ref_loss)
        self.worst["loss_abs"] = max(self.worst["loss_abs"], abs(loss - ref_loss))
        for name, q in self.ref.named_parameters():
            self.worst["grad_rel"] = max(self.worst["grad_rel"], _max_rel(grads[name], q.grad))
            q.grad = grads[name]  # the update is compared given the same gradient: see [Note: parity]
        optimizer_step(self.opt, self.config.lr_at(step))
        self.stepped = True

    def verdict(self, final_model: torch.nn.Module) -> dict[str, Any] | None:
        self.sync(final_model)  # compares the last step's update
        if self.ref is None:
            return None
        limits = _tolerances(self.rt)
        passed = all(self.worst[k] <= limits[k] for k in limits)
        return {"max_abs_diff": self.worst["loss_abs"], "max": dict(self.worst), "tolerance": limits,
                "weights_compared": self.compare_weights, "passed": passed, "reference_loss": self.ref_loss}


def _tolerances(rt: Any) -> dict[str, float]:
    if rt.param_dtype is None:
        return {"loss_abs": PARITY_LOSS_ATOL, "grad_rel": PARITY_GRAD_RTOL, "weight_rel": PARITY_WEIGHT_RTOL}
    return dict(PARITY_BF16)


def _free_running(config: TrainConfig, rt: Any, corpus: MarkovCorpus | TokenFile) -> list[float]:
    """The reference trained alone from the same init on the same global batches (rank 0)."""
    ref = MoEGPT(config.model_config(), device=rt.device, sharded=False, param_dtype=rt.param_dtype)
    opt = optimizer_for(ref, config)
    losses = []
    for step in range(1, config.steps + 1):
        tokens = corpus.global_batch(step, config.global_batch).to(rt.device)
        losses.append(forward_backward(ref, tokens, config.microbatches, config.recipe).item())
        distwgrad.finalize_model_grads([ref])
        optimizer_step(opt, config.lr_at(step))
    return losses


def parity_result(config, rt, corpus, r: dict[str, Any], hist) -> dict[str, Any]:
    """The lockstep verdict ``r`` with the free-running reference added (rank 0, after the last collective)."""
    free = _free_running(config, rt, corpus)
    ours = hist["loss"]
    r["free_running_steps"] = hist["steps"]
    r["free_running_loss"] = [free[s - 1] for s in hist["steps"]]
    r["free_running_max_abs_diff"] = max((abs(a - b) for a, b in zip(ours, r["free_running_loss"])),
                                         default=0.0)
    tol = r["tolerance"]
    log.info("parity (lockstep, %d steps, %s): max |loss diff| %.2e (tol %.0e), max rel grad diff %.2e "
             "(tol %.0e), max rel weight diff %.2e (tol %.0e): %s; free-running max |loss diff| %.2e "
             "(chaotic, not gated)", len(ours), rt.precision, r["max"]["loss_abs"], tol["loss_abs"],
             r["max"]["grad_rel"], tol["grad_rel"], r["max"]["weight_rel"], tol["weight_rel"],
             "PASSED" if r["passed"] else "FAILED", r["free_running_max_abs_diff"])
    return r
