"""The training job's data: a synthetic Markov corpus (the default: no download) and nanoGPT-style token files.

Both give step ``s``'s global batch as a pure function of ``(seed, s)``: every rank builds it and keeps its
rows, so a resume on another number of ranks, or an unsharded reference, sees the same batches. The chain is
order 2 so a model must look past the current token to beat the bigram entropy; :meth:`MarkovCorpus.entropy`
is the loss floor. ``eval_batch(i, ...)`` is a fixed validation batch: ``val.bin``, or chain steps never trained.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MarkovCorpus", "TokenFile", "DataError", "data_meta", "token_file_path"]


class DataError(ValueError):
    """A token file the job cannot use (missing, too short, tokens outside the vocabulary)."""

_SUCCESSORS = 4  # likely next tokens per two-token context
_MAX_CONTEXTS = 1 << 18  # contexts stored; a larger V * V is hashed onto them (16 MB of tables)
_STEP_STREAM = 1_000_003  # a prime: seeds of step s and of the table never collide for s < 10**6
_EVAL_STEP = 10**6  # the Markov corpus's validation batches: steps from here on, which no run trains on
_META = "meta.json"
_FORMAT = "distwgrad.data/1"


@dataclass(frozen=True)
class MarkovCorpus:
    """Sequences of ``seq_len + 1`` tokens (inputs and targets) from an order-2 Markov chain over ``vocab_size``.
    The context ``(a * V + b) mod min(V * V, 2**18)`` hashes pairs of a large vocabulary: small tables at any V."""

    vocab_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < _SUCCESSORS or self.seq_len < 1:
            raise ValueError(f"MarkovCorpus needs vocab_size >= {_SUCCESSORS} and seq_len >= 1, got "
                             f"vocab_size={self.vocab_size}, seq_len={self.seq_len}")
        # A frozen dataclass caches its derived tables through object.__setattr__.
        succ, weights = self._transition_table()
        object.__setattr__(self, "_succ", succ)
        object.__setattr__(self, "_weights", weights)
        cdf = weights.cumsum(1)
        cdf[:, -1] = 2.0  # u < 1 always lands in a slot, whatever the rounding of the sum
        object.__setattr__(self, "_cdf", cdf)

    @property
    def contexts(self) -> int:
        return min(self.vocab_size ** 2, _MAX_CONTEXTS)

    def _transition_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Context ``c``'s Zipf-drawn successors ``succ[c]`` (may repeat) and their probabilities ``weights[c]``."""
        V, C = self.vocab_size, self.contexts
        g = torch.Generator().manual_seed(self.seed)
        popularity = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
        popularity = popularity[torch.randperm(V, generator=g)]
        succ = torch.multinomial(popularity, C * _SUCCESSORS, replacement=True, generator=g).view(C, _SUCCESSORS)
        weights = torch.rand(C, _SUCCESSORS, generator=g, dtype=torch.float64).mul(3).exp()
        return succ, weights / weights.sum(1, keepdim=True)

    def entropy(self) -> float:
        """Entropy rate (nats/token) under the uniform context mix: roughly the loss floor."""
        same = self._succ.unsqueeze(2) == self._succ.unsqueeze(1)  # [C, 4, 4]
        p_token = (same * self._weights.unsqueeze(1)).sum(2)  # each slot's token's probability
        return float(-(self._weights * p_token.log()).sum(1).mean())

    def uniform_loss(self) -> float:
        return math.log(self.vocab_size)

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The ``[batch_size, seq_len + 1]`` int64 token block of ``step`` (on CPU, same on every rank)."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"global_batch needs step >= 0 and batch_size >= 1, got {step}, {batch_size}")
        V, C = self.vocab_size, self.contexts
        g = torch.Generator().manual_seed(self.seed * _STEP_STREAM + step + 1)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        tokens[:, :2] = torch.randint(0, V, (batch_size, 2), generator=g)
        u_BS = torch.rand(batch_size, self.seq_len + 1, generator=g, dtype=torch.float64)
        for t in range(2, self.seq_len + 1):  # inverse-CDF draw of each row's next slot
            ctx = (tokens[:, t - 2] * V + tokens[:, t - 1]) % C
            slot = (u_BS[:, t, None] >= self._cdf[ctx]).sum(1, keepdim=True)
            tokens[:, t] = self._succ[ctx].gather(1, slot).squeeze(1)
        return tokens

    def local_batch(self, step: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's contiguous rows of the global batch; ``batch_size`` must divide by ``world_size``."""
        rows = _rows(batch_size, rank, world_size)
        return self.global_batch(step, batch_size)[rows]

    def eval_batch(self, i: int, batch_size: int) -> torch.Tensor:
        """The ``i``-th validation batch: fresh samples of the chain, from steps no run trains on."""
        return self.global_batch(_EVAL_STEP + i, batch_size)

    def validation(self) -> MarkovCorpus:
        return self

    def capacity(self) -> int:
        """Windows a batch can hold: any number."""
        return 1 << 62

    def describe(self) -> dict:
        return {"kind": "markov", "uniform_loss": self.uniform_loss(), "entropy_floor": self.entropy(),
                "validation": f"steps {_EVAL_STEP}+ of the chain"}


def token_file_path(path: str) -> str:
    """``--data``'s token file: ``path`` itself, or ``path/train.bin`` for a folder."""
    return os.path.join(path, "train.bin") if os.path.isdir(path) else path


def data_meta(path: str) -> dict | None:
    """The ``meta.json`` beside ``--data``'s token file (written by ``prepare_data``), or None without one."""
    meta_path = os.path.join(os.path.dirname(token_file_path(path)) or ".", _META)
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(f"--data {path!r}: unreadable {meta_path}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(meta.get("vocab_size"), int):
        raise DataError(f"--data {path!r}: {meta_path} is not a {_FORMAT} meta.json (written by "
                        f"python -m distwgrad.launch.prepare_data)")
    return meta


def _rows(batch_size: int, rank: int, world_size: int) -> slice:
    if world_size < 1 or not 0 <= rank < world_size or batch_size % world_size:
        raise ValueError(f"local_batch: global batch {batch_size} cannot be split over {world_size} "
                         f"ranks (rank {rank})")
    rows = batch_size // world_size
    return slice(rank * rows, (rank + 1) * rows)


@dataclass(frozen=True)
class TokenFile:
    """Random windows of ``seq_len + 1`` tokens from a flat little-endian ``uint16`` file (nanoGPT's ``train.bin``).

    Step ``s`` draws distinct windows on a randomly shifted grid: no two rows of a step overlap, and any position
    can start a window. ``DataError``: a missing or truncated file, under two windows, a token ``>= vocab_size``.
    """

    path: str
    vocab_size: int
    seq_len: int
    seed: int = 0
    split: str = "train"  # which of a prepared folder's files: "train" or "val"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", self._file())
        if not os.path.isfile(self.path):
            raise DataError(f"--data {self.path!r}: no such file")
        size = os.path.getsize(self.path)
        if size == 0:
            raise DataError(f"--data {self.path!r}: the file is empty")
        if size % 2:
            raise DataError(f"--data {self.path!r}: {size} bytes is not a whole number of uint16 tokens "
                            f"(a truncated file?)")
        meta = data_meta(self.path)
        want = None if meta is None else meta.get(f"{self.split}_tokens")
        if want is not None and want != size // 2:
            raise DataError(f"--data {self.path!r}: holds {size // 2} tokens, but its meta.json says {want} (a "
                            f"truncated or replaced file: prepare the data again)")
        tokens = np.memmap(self.path, dtype="<u2", mode="r")
        if len(tokens) // (self.seq_len + 1) < 2:
            raise DataError(f"--data {self.path!r}: {len(tokens)} tokens hold fewer than 2 windows of "
                            f"seq_len + 1 = {self.seq_len + 1}")
        largest = int(tokens.max())
        if largest >= self.vocab_size:
            raise DataError(f"--data {self.path!r}: its largest token is {largest}, outside --vocab-size "
                            f"{self.vocab_size} (need vocab_size > {largest})")
        object.__setattr__(self, "_tokens", tokens)
        object.__setattr__(self, "largest_token", largest)

    def _windows(self, step: int, batch_size: int) -> list[int]:
        """Start offsets of the step's ``batch_size`` distinct, non-overlapping windows."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"global_batch needs step >= 0 and batch_size >= 1, got {step}, {batch_size}")
        W = self.seq_len + 1
        g = torch.Generator().manual_seed(self.seed * _STEP_STREAM + step + 1)
        shift = int(torch.randint(0, W, (1,), generator=g))
        n = (len(self._tokens) - shift) // W
        if n < batch_size:
            raise DataError(f"--data {self.path!r}: {len(self._tokens)} tokens hold {n} windows of {W}, "
                            f"fewer than the global batch of {batch_size}")
        chosen: dict[int, None] = {}  # insertion-ordered set: a draw that repeats is drawn again
        while len(chosen) < batch_size:
            for i in torch.randint(0, n, (2 * batch_size,), generator=g).tolist():
                if len(chosen) < batch_size:
                    chosen.setdefault(i)
        return [shift + i * W for i in chosen]

    def _read(self, starts: list[int]) -> torch.Tensor:
        W = self.seq_len + 1
        return torch.from_numpy(np.stack([self._tokens[s:s + W].astype(np.int64) for s in starts]))

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The ``[batch_size, seq_len + 1]`` int64 token block of ``step`` (on CPU, same on every rank)."""
        return self._read(self._windows(step, batch_size))

    def local_batch(self, step: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's rows of the global batch, reading only those windows."""
        return self._read(self._windows(step, batch_size)[_rows(batch_size, rank, world_size)])

    def _file(self) -> str:
        path = token_file_path(self.path)
        return path if self.split == "train" else os.path.join(os.path.dirname(path) or ".", "val.bin")

    def validation(self) -> TokenFile:
        """The prepared folder's ``val.bin`` beside this file; ``DataError`` without one."""
        val = os.path.join(os.path.dirname(self.path) or ".", "val.bin")
        if not os.path.isfile(val):
            raise DataError(f"--eval-every needs validation tokens: no val.bin beside {self.path!r} (prepare the "
                            f"data with python -m distwgrad.launch.prepare_data --val-fraction F)")
        return TokenFile(self.path, self.vocab_size, self.seq_len, self.seed, split="val")

    def eval_batch(self, i: int, batch_size: int) -> torch.Tensor:
        """The ``i``-th validation batch, the same at every evaluation."""
        return self.global_batch(i, batch_size)

    def capacity(self) -> int:
        """Windows any step's draw can hold (the random shift costs at most one)."""
        return len(self._tokens) // (self.seq_len + 1) - 1

    def describe(self) -> dict:
        meta = data_meta(self.path)
        return {"kind": "token_file", "path": os.path.abspath(self.path), "tokens": len(self._tokens),
                "largest_token": self.largest_token, "uniform_loss": math.log(self.vocab_size),
                "entropy_floor": None, "tokenizer": None if meta is None else meta.get("tokenizer"),
                "folder": os.path.abspath(os.path.dirname(self.path) or ".")}
