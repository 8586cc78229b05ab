"""Models built from distwgrad modules; the training job (``distwgrad.launch.train``) runs ``MoEGPT``."""

from distwgrad.models.moe_gpt import MoEGPT, MoEGPTConfig, init_full_weights

__all__ = ["MoEGPT", "MoEGPTConfig", "init_full_weights"]
