"""``bigram``'s network: one ``[V, V]`` table of next-token scores."""

from __future__ import annotations

import torch
from torch import nn


class BigramTable(nn.Module):
    """Scores of the token after each token: ``table[a, b]`` for ``b`` following ``a``."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(vocab_size, vocab_size), requires_grad=False)

    def chain(self, last: int, length: int) -> list[int]:
        """The ``length`` most likely tokens after ``last``, each after the one before."""
        out = []
        for _ in range(length):
            last = int(self.table[last].argmax())
            out.append(last)
        return out
