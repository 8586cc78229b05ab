"""A deterministic synthetic corpus: a seeded order-2 Markov chain over a small vocabulary.

Why synthetic: the training job must run anywhere (CI, an air-gapped GPU node) with no download, and its
loss must be comparable across world sizes, resumes and a single-process reference. So the global batch
of step ``s`` is a pure function of ``(seed, s)``: every rank generates it (it is small) and keeps its
own rows, and a run resumed on another number of ranks sees exactly the batches it would have seen.

Why order 2: the next token depends on the previous *two*, so a model has to attend to more than the
current position to get below the bigram entropy; the successors of each context are few and drawn
from a Zipf-like popularity, so even the unigram statistics take the loss well below ``ln(vocab)`` in a
few steps, and the chain's own entropy (:meth:`MarkovCorpus.entropy`) is the floor a perfect model reaches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["MarkovCorpus"]

_SUCCESSORS = 4  # likely next tokens per two-token context
_STEP_STREAM = 1_000_003  # a prime: seeds of step s and of the table never collide for s < 10**6


@dataclass(frozen=True)
class MarkovCorpus:
    """Sequences from an order-2 Markov chain with ``vocab_size`` tokens.

    Args:
        vocab_size: tokens are ``0 .. vocab_size - 1`` (at least ``_SUCCESSORS``).
        seq_len: tokens per training example; each sequence holds ``seq_len + 1`` tokens (inputs and
            next-token targets).
        seed: fixes the transition table and every batch.
    """

    vocab_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < _SUCCESSORS or self.seq_len < 1:
            raise ValueError(f"MarkovCorpus needs vocab_size >= {_SUCCESSORS} and seq_len >= 1, got "
                             f"vocab_size={self.vocab_size}, seq_len={self.seq_len}")
        # A frozen dataclass caches its derived table through object.__setattr__.
        object.__setattr__(self, "_probs", self._transition_table())

    def _transition_table(self) -> torch.Tensor:
        """``probs[a * V + b]``: the distribution of the token after ``a, b`` (float64, rows sum to 1)."""
        V = self.vocab_size
        g = torch.Generator().manual_seed(self.seed)
        popularity = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)  # Zipf(1) over a shuffled vocab
        popularity = popularity[torch.randperm(V, generator=g)]
        succ = torch.multinomial(popularity.expand(V * V, V), _SUCCESSORS, replacement=False, generator=g)
        weights = torch.rand(V * V, _SUCCESSORS, generator=g, dtype=torch.float64).mul(3).exp()
        probs = torch.zeros(V * V, V, dtype=torch.float64)
        probs.scatter_(1, succ, weights / weights.sum(1, keepdim=True))
        return probs

    def entropy(self) -> float:
        """Entropy rate (nats/token) under the uniform context mix: roughly the loss floor."""
        p = self._probs
        return float(-(p * p.clamp_min(1e-300).log()).sum(1).mean())

    def uniform_loss(self) -> float:
        """The loss of a model that knows nothing: ``ln(vocab_size)``."""
        return math.log(self.vocab_size)

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The ``[batch_size, seq_len + 1]`` int64 token block of ``step`` (on CPU, same on every rank)."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"global_batch needs step >= 0 and batch_size >= 1, got {step}, {batch_size}")
        V = self.vocab_size
        g = torch.Generator().manual_seed(self.seed * _STEP_STREAM + step + 1)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        tokens[:, :2] = torch.randint(0, V, (batch_size, 2), generator=g)
        for t in range(2, self.seq_len + 1):
            ctx = tokens[:, t - 2] * V + tokens[:, t - 1]
            tokens[:, t] = torch.multinomial(self._probs[ctx], 1, generator=g).squeeze(1)
        return tokens

    def local_batch(self, step: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's contiguous rows of the global batch; ``batch_size`` must divide by ``world_size``."""
        if world_size < 1 or not 0 <= rank < world_size or batch_size % world_size:
            raise ValueError(f"local_batch: global batch {batch_size} cannot be split over {world_size} "
                             f"ranks (rank {rank})")
        rows = batch_size // world_size
        return self.global_batch(step, batch_size)[rank * rows:(rank + 1) * rows]
