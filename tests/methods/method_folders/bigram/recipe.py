"""``bigram``'s recipe: count which token follows which in the target's own continuations."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specwise.drafters.checkpoint import DrafterCheckpoint, save_checkpoint, target_fingerprint
from specwise.training.corpus import iter_corpus
from specwise.training.options import TrainOptions
from specwise.training.pipeline import TrainingJob
from specwise.training.recipes.base import register_recipe


@dataclass(frozen=True)
class BigramOptions(TrainOptions):
    """The shared options; counting needs none of its own."""


@register_recipe("bigram", BigramOptions, "count bigrams of the target's continuations")
def train_bigram(job: TrainingJob, options: BigramOptions) -> Path:
    """Write the counts of the corpus's continuations to ``job.out`` as a specwise checkpoint."""
    counts = torch.zeros(job.target.vocab_size, job.target.vocab_size)
    for seq in iter_corpus(job.corpus):
        tokens = seq.tokens[max(seq.prompt_length - 1, 0):]
        counts.index_put_((tokens[:-1], tokens[1:]), torch.ones(len(tokens) - 1), accumulate=True)
    checkpoint = DrafterCheckpoint("bigram", {"vocab_size": job.target.vocab_size}, job.target.name,
                                   target_fingerprint(job.target), {"table": counts})
    return save_checkpoint(checkpoint, job.out)
