"""The training job's options: one frozen dataclass, validated on construction, and the CLI built from it.

Each field carries its help and group in ``metadata`` and becomes one ``--flag`` (:func:`build_parser`), so
CLI and config cannot drift. A ``--model`` preset fills only fields left at None. Checks that need the world
size live in :meth:`TrainConfig.check_world_size`, run with torchrun's ``WORLD_SIZE`` before any process
group exists. A bad option is one line on rank 0 and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

from distwgrad.data import data_meta
from distwgrad.fp8.recipes import RECIPES as REGISTERED_RECIPES
from distwgrad.fp8.recipes import Recipe, recipe_by_name
from distwgrad.models import MoEGPTConfig
from distwgrad.parallel.schedules import SCHEDULES, check_pipeline_config

__all__ = ["Parser", "TrainConfig", "RECIPES", "DEVICES", "PRECISIONS", "PRESETS", "GROUPS", "build_parser",
           "parse_args", "fp8_recipe"]

RECIPES = ("none", *REGISTERED_RECIPES)  # the registry of distwgrad.fp8.recipes, at import
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")  # auto: bf16 on CUDA, fp32 on CPU (launch/train.py: _param_dtype)
_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(MoEGPTConfig))

# Model sizes, batch and learning rate by --model name; explicit flags override. Every global batch
# divides by 1, 2, 4 and 8 ranks x the microbatches.
PRESETS: dict[str, dict[str, Any]] = {
    # 168 k parameters: the CPU default, 200 steps in about a minute on 2 CPU ranks
    "tiny": dict(vocab_size=64, seq_len=64, d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, d_ff=128,
                 global_batch=16, microbatches=2, lr=1e-2, warmup_steps=0),
    # 2.4 M parameters: CPU benchmarks, 0.3 s a step on 2 CPU ranks (docs/training.md, Numbers)
    "small": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4, n_experts=8, top_k=2,
                  d_ff=256, global_batch=16, microbatches=2, lr=3e-3, warmup_steps=0),
    # 1.27 B parameters (336 M active per token): fp32 masters + AdamW are 20 GB, so it fits one H200
    # unsharded and 2-8 sharded; 32 sequences of 2048 tokens a step
    "large": dict(vocab_size=32768, seq_len=2048, d_model=2048, n_layers=8, n_heads=16, n_experts=16, top_k=2,
                  d_ff=2048, global_batch=32, microbatches=2, lr=3e-4, warmup_steps=20),
    # 4.97 B parameters, FP8-sized GEMMs (d_model 4096, d_ff 8192): fp32 masters + AdamW are 80 GB, so
    # unsharded it needs one H200 (an H100 holds 80 GB), or 2-8 ranks sharded; 16 sequences of 2048 tokens
    "xl": dict(vocab_size=32768, seq_len=2048, d_model=4096, n_layers=8, n_heads=32, n_experts=8, top_k=2,
               d_ff=8192, global_batch=16, microbatches=2, lr=1.5e-4, warmup_steps=20),
}
_PRESET_FIELDS = tuple(PRESETS["tiny"])


def fp8_recipe(name: str) -> Recipe | None:
    """The FP8 recipe of ``--recipe name`` (None for ``none``), for the eager step and ``--cuda-graph`` alike."""
    if name not in RECIPES:
        raise ValueError(f"recipe={name!r} must be one of {RECIPES}")
    return recipe_by_name(name)


def _opt(default: Any, help: str, group: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group, **extra})


# --help's sections, in order: each field names its own
GROUPS = ("model", "data", "training", "precision and speed", "parallelism", "checkpoints", "output")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run of ``distwgrad.launch.train`` depends on (saved in ``report.json``)."""

    # model (see distwgrad.models.MoEGPTConfig); None: from the --model preset
    model: str = _opt("tiny", "preset of the sizes, batch and lr; explicit flags override it", "model",
                      choices=tuple(PRESETS))
    vocab_size: int | None = _opt(None, "vocabulary (default: --data's meta.json or --model)", "model")
    seq_len: int | None = _opt(None, "tokens per training sequence", "model")
    d_model: int | None = _opt(None, "model width", "model")
    n_layers: int | None = _opt(None, "transformer blocks", "model")
    n_heads: int | None = _opt(None, "attention heads", "model")
    n_experts: int | None = _opt(None, "experts per MoE layer", "model")
    top_k: int | None = _opt(None, "experts per token", "model")
    d_ff: int | None = _opt(None, "hidden width of each expert", "model")
    init_std: float = _opt(0.02, "initial weights' standard deviation", "model")
    seed: int = _opt(0, "seed of the weights and the data", "model")
    aux_loss_coef: float = _opt(0.0, "routers' load-balancing loss weight", "model")
    # data
    data: str | None = _opt(None, "a folder prepare_data wrote (its meta.json sets --vocab-size), or any nanoGPT "
                            "uint16 token file (default: a synthetic Markov corpus)", "data", metavar="DIR|FILE")
    eval_every: int = _opt(0, "validation loss every N steps and at the last (val.bin, or held-out synthetic "
                           "samples) (0: never)", "data")
    eval_batches: int = _opt(4, "validation batches per evaluation", "data")
    # training
    steps: int = _opt(200, "train until this step (a resumed run continues to it)", "training")
    global_batch: int | None = _opt(None, "sequences per step over all ranks; divisible by world size * "
                                    "microbatches", "training")
    microbatches: int | None = _opt(None, "microbatches per step on each rank (gradients accumulate)", "training")
    lr: float | None = _opt(None, "AdamW learning rate (after the warm-up)", "training")
    warmup_steps: int | None = _opt(None, "linear warm-up: step s trains at lr * min(1, s / N) (0: none)",
                                    "training")
    weight_decay: float = _opt(0.0, "AdamW weight decay", "training")
    gc_every: int = _opt(50, "a generation-1 collection every N steps, automatic collection off (0: left on)",
                         "training")
    # precision and speed
    precision: str = _opt("auto", "compute dtype, masters always fp32: auto is bf16 on CUDA, fp32 on CPU",
                          "precision and speed", choices=PRECISIONS)
    recipe: str = _opt("none", "FP8 recipe: the GEMMs in FP8, the rest in --precision", "precision and speed",
                       choices=RECIPES)
    fp8_weight_cache: bool = _opt(True, "FP8 weights quantized once a step, not each microbatch (docs/fp8.md)",
                                  "precision and speed")
    cuda_graph: bool = _opt(False, "replay each block from CUDA graphs (CUDA; FP8 on one rank; docs/cuda_graphs.md)",
                            "precision and speed")
    compile: bool = _opt(False, "torch.compile each transformer block's forward (with --cuda-graph: then "
                         "graphed)", "precision and speed")
    # parallelism
    device: str = _opt("auto", "auto: cuda:LOCAL_RANK over NCCL if CUDA is available, else cpu over gloo",
                       "parallelism", choices=DEVICES)
    coalesce: bool = _opt(True, "one all-gather and one reduce-scatter a block, the next prefetched (not with "
                          "--ep)", "parallelism")
    pp: int = _opt(1, "pipeline ranks: the world is pp x data-parallel ranks (docs/pipeline.md)", "parallelism")
    pp_schedule: str = _opt("1F1B", "torch's schedule (docs/pipeline.md)", "parallelism",
                            choices=tuple(SCHEDULES), metavar="NAME")
    pp_microbatches: int | None = _opt(None, "microbatches a step (default: --microbatches)", "parallelism")
    ep: int = _opt(1, "expert-parallel ranks, n_experts / ep experts each (docs/experts.md)", "parallelism")
    timeout: float = _opt(600.0, "seconds any collective may wait before the job stops with exit code 3",
                          "parallelism")
    # checkpoints
    save_every: int = _opt(0, "save a checkpoint every N steps and at the last (0: never)", "checkpoints")
    keep_last: int = _opt(0, "keep only the newest K complete checkpoints (0: all)", "checkpoints")
    resume: str | None = _opt(None, "a checkpoint folder, or the newest complete step_N in a folder of them",
                              "checkpoints", metavar="DIR")
    # output
    out: str = _opt("runs/moe_gpt", "run folder: report.json, loss.png, checkpoints/step_N", "output", metavar="DIR")
    overwrite: bool = _opt(False, "start a new run in an --out that holds a finished one (its report.json and "
                           "loss.png are replaced)", "output")
    log_every: int = _opt(10, "log a line every N steps on rank 0 (0: never)", "output")
    progress: bool = _opt(True, "progress bar on rank 0 when stderr is a terminal", "output")
    tensorboard: str | None = _opt(None, "also write TensorBoard scalars to this folder (pip install "
                                   "'distwgrad[tensorboard]')", "output", metavar="DIR")
    check_parity: bool = _opt(False, "also train an unsharded single-process copy and compare (exit code 1 if "
                              "they disagree)", "output")

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"model={self.model!r} must be one of {tuple(PRESETS)}")
        meta = data_meta(self.data) if self.data and self.vocab_size is None else None
        if meta is not None:  # a prepared folder's vocabulary, over the preset's
            object.__setattr__(self, "vocab_size", meta["vocab_size"])
        for k, v in PRESETS[self.model].items():  # a frozen dataclass fills its defaults this way
            if getattr(self, k) is None:
                object.__setattr__(self, k, v)
        positive = {k: getattr(self, k) for k in ("steps", "global_batch", "microbatches")}
        positive["eval_batches"] = self.eval_batches
        non_negative = {k: getattr(self, k) for k in ("log_every", "save_every", "warmup_steps", "keep_last",
                                                       "gc_every", "eval_every")}
        bad = {k: v for k, v in positive.items() if not _is_int(v) or v <= 0}
        bad.update({k: v for k, v in non_negative.items() if not _is_int(v) or v < 0})
        if bad:
            raise ValueError(f"these options must be positive (log/save/eval/gc intervals, warm-up, keep-last: "
                             f"non-negative) ints: {bad}")
        if self.global_batch % self.microbatches:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by "
                             f"microbatches={self.microbatches}")
        if self.recipe not in RECIPES or self.device not in DEVICES or self.precision not in PRECISIONS:
            raise ValueError(f"recipe={self.recipe!r} must be one of {RECIPES}, device={self.device!r} one of "
                             f"{DEVICES}, precision={self.precision!r} one of {PRECISIONS}")
        if not self.lr > 0 or not self.weight_decay >= 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={self.lr}, "
                             f"weight_decay={self.weight_decay}")
        if not (isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r} must be a positive number of seconds")
        if not self.out:
            raise ValueError("out must name a folder, got an empty string")
        if self.cuda_graph:
            self._check_cuda_graph()
        self._check_pipeline()
        self._check_experts()
        if self.aux_loss_coef and (self.pp > 1 or self.cuda_graph or self.compile):
            given = [k for k, v in (("--pp", self.pp > 1), ("--cuda-graph", self.cuda_graph),
                                    ("--compile", self.compile)) if v]
            raise ValueError(f"--aux-loss-coef {self.aux_loss_coef} does not run with {', '.join(given)} yet (each "
                             f"layer's loss is kept by Python in the forward); leave "
                             f"{'it' if len(given) == 1 else 'them'} out, or use --aux-loss-coef 0")
        self.model_config()  # validates the model fields

    @property
    def step_microbatches(self) -> int:
        """Microbatches per step on each data-parallel rank: the pipeline's with --pp, else --microbatches."""
        return self.pp_microbatches or self.microbatches  # type: ignore[return-value]

    def _check_pipeline(self) -> None:
        """What ``--pp`` refuses without knowing the world size."""
        if not _is_int(self.pp) or self.pp < 1:
            raise ValueError(f"pp={self.pp!r} must be a positive int")
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={self.pp_schedule!r} must be one of {tuple(SCHEDULES)}")
        if self.pp_microbatches is not None:
            if not _is_int(self.pp_microbatches) or self.pp_microbatches < 1:
                raise ValueError(f"pp_microbatches={self.pp_microbatches!r} must be a positive int")
            if self.pp == 1:
                raise ValueError(f"--pp-microbatches {self.pp_microbatches} needs --pp > 1 (without a pipeline, "
                                 f"--microbatches sets the microbatches)")
        if self.pp == 1:
            return
        unsupported = {"--cuda-graph": self.cuda_graph, "--compile": self.compile, "--check-parity": self.check_parity,
                       "--eval-every": self.eval_every}
        given = [k for k, v in unsupported.items() if v]
        if given:
            raise ValueError(f"--pp {self.pp} does not run with {', '.join(given)} yet; leave "
                             f"{'it' if len(given) == 1 else 'them'} out, or use --pp 1")

    def _check_experts(self) -> None:
        """What ``--ep`` refuses without knowing the world size."""
        if not _is_int(self.ep) or self.ep < 1:
            raise ValueError(f"ep={self.ep!r} must be a positive int")
        if self.ep == 1:
            return
        if self.n_experts % self.ep:
            raise ValueError(f"--ep {self.ep} must divide --n-experts {self.n_experts} (each rank holds n_experts / ep "
                             f"experts)")
        unsupported = {"--pp": self.pp > 1, "--cuda-graph": self.cuda_graph, "--compile": self.compile,
                       "--check-parity": self.check_parity, "--eval-every": self.eval_every}
        given = [k for k, v in unsupported.items() if v]
        if given:
            raise ValueError(f"--ep {self.ep} does not run with {', '.join(given)} yet; leave "
                             f"{'it' if len(given) == 1 else 'them'} out, or use --ep 1")

    def _check_cuda_graph(self) -> None:
        """What ``--cuda-graph`` refuses without the world size ([Note: the graphed step] in launch/cuda_graph.py)."""
        if self.device == "cpu":
            raise ValueError("--cuda-graph needs CUDA devices with NCCL, but device='cpu' runs on the CPU over gloo "
                             "(CUDA graphs capture CUDA kernels and NCCL collectives only); use --device cuda or "
                             "auto on a CUDA machine, or leave out --cuda-graph")

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (1-based): linear warm-up, then ``lr``; pure, so a resume continues it."""
        if not self.warmup_steps:
            return self.lr
        return self.lr * min(1.0, step / self.warmup_steps)

    def model_config(self) -> MoEGPTConfig:
        return MoEGPTConfig(**{k: getattr(self, k) for k in _MODEL_FIELDS})

    def check_world_size(self, world_size: int) -> None:
        """Raises ``ValueError`` if the batch, ``--pp``, ``--ep`` or ``--cuda-graph`` do not fit ``world_size``."""
        if world_size % self.pp:
            raise ValueError(f"--pp {self.pp} must divide the world size {world_size} (the world is pp x "
                             f"data-parallel ranks)")
        if world_size % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the world size {world_size} (the experts' mesh is ep x "
                             f"dp ranks)")
        dp, micro = world_size // self.pp, self.step_microbatches
        if self.global_batch % (dp * micro):
            what = "world size" if self.pp == 1 else f"data-parallel ranks (world {world_size} / pp {self.pp})"
            raise ValueError(f"global_batch={self.global_batch} must be divisible by {what} * microbatches = "
                             f"{dp} * {micro} = {dp * micro}")
        if self.pp > 1:
            check_pipeline_config(self.pp_schedule, pp_size=self.pp, n_layers=self.n_layers,  # type: ignore[arg-type]
                                  n_microbatches=micro)
        if self.cuda_graph and self.recipe != "none" and world_size > 1:
            raise ValueError(f"--cuda-graph with recipe={self.recipe!r} runs on one rank only, got world size "
                             f"{world_size}: sharded over ranks, the graphs would all-reduce every weight's amax (or "
                             f"block-scale grid) inside each replay, an NCCL capture not yet run on several GPUs; "
                             f"use --recipe none, or leave out --cuda-graph")
        if self.cuda_graph and self.coalesce and world_size > 1:
            raise ValueError(f"--cuda-graph on {world_size} ranks needs --no-coalesce: a coalesced unit gathers and "
                             f"reduces from Python hooks, which a graph replay skips")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Parser(argparse.ArgumentParser):
    """argparse whose error is one line, printed by rank 0 only; the others wait ``OTHER_RANKS_EXIT_S`` before
    exiting, or torchrun could kill rank 0 before its line is out. Every ``distwgrad.launch`` command uses it."""

    OTHER_RANKS_EXIT_S = 5.0

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        else:
            time.sleep(self.OTHER_RANKS_EXIT_S)
        sys.exit(2)


def build_parser(prog: str = "train", description: str | None = None) -> argparse.ArgumentParser:
    """One ``--flag`` per :class:`TrainConfig` field, in its group's section, help and choices from the field."""
    parser = Parser(prog=prog, description=description, usage="%(prog)s [options]",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sections = {g: parser.add_argument_group(g) for g in GROUPS}
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        shown = "from --model" if f.name in _PRESET_FIELDS else "%(default)s"
        if f.type in (bool, "bool"):
            shown = "on" if f.default else "off"
        said = ("default:" in f.metadata["help"] or "(0:" in f.metadata["help"]
                or (f.default is None and f.name not in _PRESET_FIELDS))  # no default to show, or said
        kw: dict[str, Any] = {"default": f.default,
                              "help": f.metadata["help"] + ("" if said else f" (default: {shown})")}
        if f.type in (bool, "bool"):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = {"int": int, "float": float}.get(str(f.type).removesuffix(" | None"), str)
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            kw["metavar"] = f.metadata.get("metavar") or ("/".join(f.metadata["choices"]) if "choices" in f.metadata
                                                          else {int: "N", float: "X"}.get(kw["type"], "PATH"))
        sections[f.metadata["group"]].add_argument(flag, **kw)
    return parser


def parse_args(argv: list[str] | None = None, *, prog: str = "train",
               description: str | None = None) -> TrainConfig:
    """CLI -> validated :class:`TrainConfig` (world size from ``WORLD_SIZE``); a bad option exits with code 2."""
    parser = build_parser(prog, description)
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(**vars(args))
        config.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as exc:
        parser.error(str(exc))
    return config
