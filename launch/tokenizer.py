"""The tokenizers of the job's token files: bytes (the default) or a BPE trained on the corpus itself.

``prepare_data`` picks one and records it in the data folder's ``meta.json``; ``sample`` loads the same one
from an export (``load``). Byte-level: every UTF-8 byte is a token (vocabulary 256), nothing to train or
store. BPE: Hugging Face ``tokenizers``' byte-level BPE trained on the given text (an optional extra,
``pip install distwgrad[text]``; trained locally, nothing is downloaded), saved as ``tokenizer.json``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

__all__ = ["ByteTokenizer", "BpeTokenizer", "TOKENIZERS", "train", "load", "TOKENIZER_FILE"]

TOKENIZERS = ("byte", "bpe")
TOKENIZER_FILE = "tokenizer.json"
MAX_VOCAB = 1 << 16  # token files hold uint16


class ByteTokenizer:
    """Each UTF-8 byte a token: vocabulary 256; decoding replaces invalid sequences (a cut multi-byte char)."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, folder: str) -> None:
        """Nothing to save: the name in ``meta.json`` is the whole tokenizer."""


class BpeTokenizer:
    """A byte-level BPE (``tokenizers``), trained on the corpus, held as ``tokenizer.json``."""

    name = "bpe"

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save(self, folder: str) -> None:
        self._tok.save(os.path.join(folder, TOKENIZER_FILE))


def _tokenizers_module():
    try:
        import tokenizers
    except ImportError as exc:  # an optional extra
        raise ValueError("--tokenizer bpe needs Hugging Face tokenizers: pip install 'distwgrad[text]' (or "
                         "pip install tokenizers); --tokenizer byte needs nothing") from exc
    return tokenizers


def train(kind: str, files: list[str], vocab_size: int | None) -> ByteTokenizer | BpeTokenizer:
    """The tokenizer ``kind`` for ``files``: bytes as they are, or a BPE of ``vocab_size`` (default 4096)
    trained on them."""
    if kind not in TOKENIZERS:
        raise ValueError(f"--tokenizer {kind!r} must be one of {TOKENIZERS}")
    if kind == "byte":
        if vocab_size not in (None, 256):
            raise ValueError(f"--vocab-size {vocab_size}: the byte tokenizer's vocabulary is 256 (leave it out, or "
                             f"use --tokenizer bpe)")
        return ByteTokenizer()
    vocab_size = 4096 if vocab_size is None else vocab_size
    if not 257 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"--vocab-size {vocab_size} must be between 257 (the 256 bytes and a merge) and "
                         f"{MAX_VOCAB} (tokens are stored as uint16)")
    tk = _tokenizers_module()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return BpeTokenizer(tok)


def load(folder: str, meta: dict[str, Any]) -> ByteTokenizer | BpeTokenizer:
    """The tokenizer ``meta`` (a data folder's or an export's ``meta.json``) names, from ``folder``."""
    kind = meta.get("tokenizer")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        path = os.path.join(folder, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"{folder!r}: meta.json names a BPE tokenizer but {TOKENIZER_FILE} is missing")
        return BpeTokenizer(_tokenizers_module().Tokenizer.from_file(path))
    raise ValueError(f"{folder!r}: meta.json names no known tokenizer (tokenizer={kind!r}, expected one of "
                     f"{TOKENIZERS})")
