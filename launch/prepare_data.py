"""Text to token files for the training job's ``--data``.

Commands::

    # bytes as tokens (vocabulary 256): nothing to train, nothing to download
    python -m distwgrad.launch.prepare_data corpus.txt --out data/corpus
    # a BPE of 4096 tokens trained on the text itself (pip install 'distwgrad[text]'), 5% held out
    python -m distwgrad.launch.prepare_data a.txt b.txt --out data/ab --tokenizer bpe --vocab-size 4096 \
        --val-fraction 0.05
    # then train on it, reporting the validation loss every 20 steps
    torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --data data/corpus --eval-every 20

Writes, in ``--out``: ``train.bin`` and ``val.bin`` (nanoGPT's flat little-endian ``uint16``, validation the
last ``--val-fraction``), ``meta.json`` (the job's ``--vocab-size``), a BPE's ``tokenizer.json``; each renamed
into place, so an interrupted run leaves the folder as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from . import tokenizer as tok
from .config import Parser

__all__ = ["main", "prepare", "META_FILE", "FORMAT"]

META_FILE = "meta.json"
FORMAT = "distwgrad.data/1"


def _read(path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"text file {path!r}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"text file {path!r} is not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _write(path: str, tokens: np.ndarray) -> None:
    tmp = path + ".tmp"
    tokens.astype("<u2").tofile(tmp)
    os.replace(tmp, path)


def prepare(files: list[str], out: str, *, tokenizer: str = "byte", vocab_size: int | None = None,
            val_fraction: float = 0.1, overwrite: bool = False, say=print) -> dict:
    """Encodes ``files`` into ``out``; returns the ``meta.json`` it wrote. ``ValueError`` names a bad input."""
    if not files:
        raise ValueError("no text file given")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction} must be at least 0 and below 1")
    if os.path.exists(os.path.join(out, "train.bin")) and not overwrite:
        raise ValueError(f"--out {out!r} already holds train.bin; pass --overwrite to replace it, or choose another "
                         f"folder")
    texts = [_read(f) for f in files]
    empty = [f for f, t in zip(files, texts) if not t]
    if empty:
        raise ValueError(f"text files {empty} are empty")
    tk = tok.train(tokenizer, list(files), vocab_size)
    parts = []
    for f, text in zip(files, texts):
        ids = np.asarray(tk.encode(text), dtype=np.int64)
        say(f"{f}: {len(text):,} characters, {len(ids):,} tokens")
        parts.append(ids)
    tokens = np.concatenate(parts)
    n_val = int(round(len(tokens) * val_fraction))
    if val_fraction and n_val < 2:
        raise ValueError(f"--val-fraction {val_fraction} of {len(tokens)} tokens leaves {n_val} for validation; "
                         f"give more text or a larger fraction (or 0 for none)")
    if len(tokens) - n_val < 2:
        raise ValueError(f"{len(tokens)} tokens leave {len(tokens) - n_val} for training; give more text")
    os.makedirs(out, exist_ok=True)
    _write(os.path.join(out, "train.bin"), tokens[:len(tokens) - n_val])
    if n_val:
        _write(os.path.join(out, "val.bin"), tokens[len(tokens) - n_val:])
    elif os.path.exists(os.path.join(out, "val.bin")):
        os.remove(os.path.join(out, "val.bin"))  # --overwrite with no validation split: no stale one
    tk.save(out)
    meta = {"format": FORMAT, "tokenizer": tk.name, "vocab_size": tk.vocab_size,
            "train_tokens": int(len(tokens) - n_val), "val_tokens": int(n_val), "dtype": "uint16",
            "sources": [os.path.abspath(f) for f in files]}
    tmp = os.path.join(out, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(out, META_FILE))
    say(f"wrote {out}: train.bin {meta['train_tokens']:,} tokens, val.bin {meta['val_tokens']:,} tokens, "
        f"{tk.name} tokenizer of {tk.vocab_size} tokens")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="distwgrad.launch.prepare_data", description=__doc__.split("Writes,")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="TEXT", help="UTF-8 text files, encoded in this order")
    parser.add_argument("--out", required=True, help="folder for train.bin, val.bin, meta.json (and tokenizer.json)")
    parser.add_argument("--tokenizer", default="byte", choices=tok.TOKENIZERS,
                        help="byte: UTF-8 bytes (vocabulary 256); bpe: a byte-level BPE trained on the text "
                             "(needs pip install 'distwgrad[text]') (default: byte)")
    parser.add_argument("--vocab-size", type=int, default=None, help="the BPE's vocabulary (default: 4096)")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="share of the tokens, from the end, held out as val.bin (default: 0.1; 0: none)")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run in --out")
    args = parser.parse_args(argv)
    try:
        prepare(args.files, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                val_fraction=args.val_fraction, overwrite=args.overwrite)
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
