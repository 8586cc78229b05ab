"""A checkpoint's trained weights out of the job: full, unsharded fp32 tensors as safetensors.

Commands::

    # the newest complete checkpoint of a run (saved at any world size), in one process, no torchrun
    python -m distwgrad.launch.export runs/a/checkpoints --out runs/a/export
    # shards of at most 2 GB with an index (Hugging Face's layout), for a large model
    python -m distwgrad.launch.export runs/big/checkpoints/step_1000 --out runs/big/export --max-shard-gb 2

Writes, in ``--out``, for ``distwgrad.launch.sample``: safetensors (each distinct parameter once: the tied embedding
as ``embedding.weight``), ``config.json``, ``meta.json`` and a BPE's ``tokenizer.json``. Needs ``distwgrad[export]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

import torch

from .config import Parser

__all__ = ["main", "export", "FORMAT", "WEIGHTS", "INDEX"]

FORMAT = "distwgrad.export/1"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _safetensors():
    try:
        from safetensors.torch import save_file
    except ImportError as exc:  # an optional extra
        raise ValueError("export needs safetensors: pip install 'distwgrad[export]' (or pip install safetensors)") \
            from exc
    return save_file


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most ``max_bytes`` each (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def export(checkpoint: str, out: str, *, max_shard_gb: float = 5.0, overwrite: bool = False, say=print) -> dict:
    """Writes ``checkpoint``'s weights to ``out``; returns its ``meta.json``. Raises ``CheckpointError`` or
    ``ValueError`` naming a bad input."""
    from distwgrad.checkpoint import load_checkpoint, resolve_checkpoint
    from distwgrad.models import MoEGPT, MoEGPTConfig

    save_file = _safetensors()
    if not max_shard_gb > 0:
        raise ValueError(f"--max-shard-gb {max_shard_gb} must be positive")
    if os.path.exists(os.path.join(out, "meta.json")) and not overwrite:
        raise ValueError(f"--out {out!r} already holds an export; pass --overwrite to replace it, or another --out")
    path = resolve_checkpoint(checkpoint)
    with open(os.path.join(path, "meta.json")) as f:
        ckpt_meta = json.load(f)
    config = MoEGPTConfig(**ckpt_meta["model_config"])
    model = MoEGPT(config)  # no process group: a group of one, the checkpoint resharded into it
    with torch.random.fork_rng():
        step = load_checkpoint(path, model, expect={"model_config": ckpt_meta["model_config"]})
    tensors = {name: p.detach().float().contiguous().clone() for name, p in model.named_parameters()}
    os.makedirs(out, exist_ok=True)
    shards = _shards(tensors, int(max_shard_gb * 1e9))
    files = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(len(shards))]
    for name in os.listdir(out):  # an earlier export's weights, replaced (--overwrite)
        if name.endswith(".safetensors") or name == INDEX:
            os.remove(os.path.join(out, name))
    for file, shard in zip(files, shards):
        save_file(shard, os.path.join(out, file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
        _dump(index, os.path.join(out, INDEX))
    _dump({**dict(config.__dict__), "tie_word_embeddings": True, "architecture": "distwgrad.models.MoEGPT",
           "torch_dtype": "float32"}, os.path.join(out, "config.json"))
    data = ckpt_meta.get("data") or {}
    tokenizer = data.get("tokenizer")
    if tokenizer == "bpe":
        source = os.path.join(data.get("folder", ""), "tokenizer.json")
        if not os.path.isfile(source):
            raise ValueError(f"checkpoint {path!r} was trained on a BPE whose tokenizer.json is gone ({source})")
        shutil.copy(source, os.path.join(out, "tokenizer.json"))
    meta = {"format": FORMAT, "step": step, "checkpoint": os.path.abspath(path), "files": files,
            "tokenizer": tokenizer, "data": data, "parameters": sum(t.numel() for t in tensors.values())}
    _dump(meta, os.path.join(out, "meta.json"))
    say(f"exported {path} (step {step}, {meta['parameters']:,} parameters) to {out}: {', '.join(files)}"
        + ("" if tokenizer else " (no tokenizer: the run trained on the synthetic corpus or an unprepared file)"))
    return meta


def _dump(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="distwgrad.launch.export", description=__doc__.split("Writes,")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder (step_N), or a folder of them (the newest)")
    parser.add_argument("--out", required=True, help="folder for the safetensors, config.json and meta.json")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest shard, in GB (default: 5)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    args = parser.parse_args(argv)
    from distwgrad.checkpoint import CheckpointError

    try:
        export(args.checkpoint, args.out, max_shard_gb=args.max_shard_gb, overwrite=args.overwrite)
    except (ValueError, CheckpointError) as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
