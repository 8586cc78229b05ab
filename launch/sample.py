"""Text from exported weights: the plain-torch build of the model, the run's own tokenizer.

Commands::

    python -m distwgrad.launch.sample runs/a/export --prompt "Once upon a time"
    python -m distwgrad.launch.sample runs/a/export --prompt "To be" --max-new-tokens 200 --temperature 0.8 \
        --top-k 20 --seed 1

Loads ``config.json`` and the safetensors of an ``export`` folder into ``MoEGPT(sharded=False)`` (plain torch
modules, no process group, the CPU unless ``--device``), encodes ``--prompt`` with the tokenizer the run
trained with (``meta.json``: bytes, or the BPE in ``tokenizer.json``), and draws ``--max-new-tokens`` tokens,
each from the last ``seq_len`` tokens' logits divided by ``--temperature`` (0: the most likely token),
restricted to the ``--top-k`` likeliest (0: all); prints the prompt and the continuation. As nanoGPT's
``sample.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from . import tokenizer as tok
from .config import Parser
from .export import FORMAT, INDEX, WEIGHTS

__all__ = ["main", "load_model", "generate"]


def _read(folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} is no export folder: {name} is missing (python -m distwgrad.launch.export "
                         f"writes one)")
    with open(path) as f:
        return json.load(f)


def load_model(folder: str, device: str = "cpu") -> tuple[torch.nn.Module, dict]:
    """The plain-torch model with an export's weights, and the export's ``meta.json``."""
    from distwgrad.models import MoEGPT, MoEGPTConfig

    try:
        from safetensors.torch import load_file
    except ImportError as exc:  # an optional extra
        raise ValueError("sample needs safetensors: pip install 'distwgrad[export]'") from exc

    meta = _read(folder, "meta.json")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder!r}: meta.json has format {meta.get('format')!r}, expected {FORMAT!r}")
    config = _read(folder, "config.json")
    fields = {k: config[k] for k in MoEGPTConfig.__dataclass_fields__ if k in config}  # an older export: defaults
    model = MoEGPT(MoEGPTConfig(**fields), sharded=False, device=device)
    files = [WEIGHTS] if os.path.isfile(os.path.join(folder, WEIGHTS)) else \
        sorted(set(_read(folder, INDEX)["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(os.path.join(folder, file), device=device))
    params = dict(model.named_parameters())  # distinct: the tied lm_head is the embedding
    if set(params) != set(weights):
        raise ValueError(f"{folder!r}: the weights do not fit the model: missing {sorted(set(params) - set(weights))}, "
                         f"unexpected {sorted(set(weights) - set(params))}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    return model.eval(), meta


@torch.no_grad()
def generate(model: torch.nn.Module, ids: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """``ids`` continued by ``max_new_tokens`` sampled tokens."""
    device = next(model.parameters()).device
    out = torch.tensor([ids], dtype=torch.int64, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(out[:, -model.config.seq_len:])[0, -1].float()
        if temperature == 0:
            nxt = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)
        out = torch.cat([out, nxt.view(1, 1)], dim=1)
    return out[0].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="distwgrad.launch.sample", description=__doc__.split("Loads")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="an export folder (python -m distwgrad.launch.export)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to draw (default: 100)")
    parser.add_argument("--temperature", type=float, default=1.0, help="logits divided by it; 0: the likeliest "
                                                                      "token (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="draw among the K likeliest tokens (default: 0, all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")
    parser.add_argument("--device", default="cpu", help="where the model runs (default: cpu)")
    args = parser.parse_args(argv)
    bad = {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("top_k", args.top_k)) if v < 0}
    if bad or args.temperature < 0:
        parser.error(f"--max-new-tokens and --top-k must be >= 0 and --temperature >= 0, got {bad or args.temperature}")
    try:
        model, meta = load_model(args.folder, args.device)
        if meta.get("tokenizer") is None:
            raise ValueError(f"{args.folder!r}: the run trained without a tokenizer (the synthetic corpus or an "
                             f"unprepared token file): nothing to encode the prompt with")
        tokenizer = tok.load(args.folder, meta)
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise ValueError("--prompt encodes to no token")
        vocab = model.config.vocab_size
        if max(ids) >= vocab:
            raise ValueError(f"--prompt holds token {max(ids)}, outside the model's vocabulary of {vocab}")
    except ValueError as exc:
        parser.error(str(exc))
    out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(tokenizer.decode(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
