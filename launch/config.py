"""The training job's options: one frozen dataclass, validated on construction, and the CLI built from it.

Each field carries its help text (and choices) in ``metadata``; :func:`build_parser` turns every field
into one ``--flag`` so the CLI and the config cannot drift apart. Checks that need the world size (the
global batch must split evenly over ranks and microbatches) live in :meth:`TrainConfig.check_world_size`,
which the CLI calls with torchrun's ``WORLD_SIZE`` before any process group exists.

Bad options end the process with one line, ``train: error: ...``, and exit code 2 (argparse's code for
usage errors); under torchrun only rank 0 prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

from distwgrad.models import MoEGPTConfig

__all__ = ["TrainConfig", "RECIPES", "DEVICES", "build_parser", "parse_args"]

RECIPES = ("none", "fp8_per_tensor", "fp8_per_tensor_te", "fp8_blockwise")  # launch/train.py: _RECIPES
DEVICES = ("auto", "cpu", "cuda")
_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(MoEGPTConfig))


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run of ``distwgrad.launch.train`` depends on (saved in ``report.json``)."""

    # model (see distwgrad.models.MoEGPTConfig)
    vocab_size: int = _opt(64, "vocabulary size of the model and of the synthetic corpus")
    seq_len: int = _opt(64, "tokens per training sequence")
    d_model: int = _opt(64, "model width")
    n_layers: int = _opt(2, "transformer blocks")
    n_heads: int = _opt(4, "attention heads (d_model / n_heads must be even)")
    n_experts: int = _opt(4, "experts per MoE layer")
    top_k: int = _opt(2, "experts each token is routed to")
    d_ff: int = _opt(128, "hidden width of each expert")
    init_std: float = _opt(0.02, "standard deviation of the initial weights")
    seed: int = _opt(0, "seed of the initial weights and of the corpus")
    # training
    steps: int = _opt(200, "train until this step (a resumed run continues to it)")
    global_batch: int = _opt(16, "sequences per step over all ranks; divisible by world size * microbatches")
    microbatches: int = _opt(2, "microbatches per step on each rank (gradients accumulate)")
    lr: float = _opt(1e-2, "AdamW learning rate (constant)")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    recipe: str = _opt("none", "precision recipe", choices=RECIPES)
    device: str = _opt("auto", "auto: cuda:LOCAL_RANK with NCCL if CUDA is available, else cpu with gloo",
                       choices=DEVICES)
    # output
    out: str = _opt("runs/moe_gpt", "run folder: report.json, loss.png, checkpoints/step_N")
    log_every: int = _opt(10, "log a line every N steps on rank 0 (0: never)")
    save_every: int = _opt(0, "save a checkpoint every N steps, and at the last step (0: never)")
    resume: str | None = _opt(None, "resume from a checkpoint folder, or the latest complete step_N in it")
    check_parity: bool = _opt(False, "also train an unsharded single-process copy and compare losses")
    progress: bool = _opt(True, "show a progress bar on rank 0")

    def __post_init__(self) -> None:
        positive = {k: getattr(self, k) for k in ("steps", "global_batch", "microbatches")}
        non_negative = {k: getattr(self, k) for k in ("log_every", "save_every")}
        bad = {k: v for k, v in positive.items() if not _is_int(v) or v <= 0}
        bad.update({k: v for k, v in non_negative.items() if not _is_int(v) or v < 0})
        if bad:
            raise ValueError(f"these options must be positive (log/save intervals: non-negative) ints: {bad}")
        if self.global_batch % self.microbatches:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by "
                             f"microbatches={self.microbatches}")
        if self.recipe not in RECIPES or self.device not in DEVICES:
            raise ValueError(f"recipe={self.recipe!r} must be one of {RECIPES}, device={self.device!r} one of "
                             f"{DEVICES}")
        if not self.lr > 0 or not self.weight_decay >= 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={self.lr}, "
                             f"weight_decay={self.weight_decay}")
        if not self.out:
            raise ValueError("out must name a folder, got an empty string")
        self.model_config()  # validates the model fields

    def model_config(self) -> MoEGPTConfig:
        return MoEGPTConfig(**{k: getattr(self, k) for k in _MODEL_FIELDS})

    def check_world_size(self, world_size: int) -> None:
        """Raises ``ValueError`` if the global batch cannot be split evenly over ``world_size`` ranks."""
        if self.global_batch % (world_size * self.microbatches):
            raise ValueError(f"global_batch={self.global_batch} must be divisible by world size * "
                             f"microbatches = {world_size} * {self.microbatches} = "
                             f"{world_size * self.microbatches}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and only rank 0 of a torchrun job prints it."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser(prog: str = "train", description: str | None = None) -> argparse.ArgumentParser:
    """One ``--flag`` per :class:`TrainConfig` field; defaults, help and choices come from the field."""
    parser = _Parser(prog=prog, description=description,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"default": f.default, "help": f.metadata["help"] + " (default: %(default)s)"}
        if f.type in (bool, "bool"):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = {"int": int, "float": float}.get(str(f.type), str)
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            kw["metavar"] = "/".join(f.metadata["choices"]) if "choices" in f.metadata else f.name.upper()
        parser.add_argument(flag, **kw)
    return parser


def parse_args(argv: list[str] | None = None, *, prog: str = "train",
               description: str | None = None) -> TrainConfig:
    """CLI -> validated :class:`TrainConfig`; exits with code 2 and one line on a bad option.

    The world-size check uses torchrun's ``WORLD_SIZE`` (1 without torchrun).
    """
    parser = build_parser(prog, description)
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(**vars(args))
        config.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as exc:
        parser.error(str(exc))
    return config
