"""Recipe: distil a small draft LM (:class:`specwise.methods.draft.network.DraftLM`) from the target,
on the distillation recipe every trained drafter builds on (:mod:`specwise.training.recipes.distill`).

``specwise train draft`` (:func:`train_draft`, options :class:`DraftOptions`) labels the corpus
beside its shards and writes the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specwise.checks import check_int
from specwise.errors import ConfigError
from specwise.methods.draft.network import DraftLM, DraftLMConfig
from specwise.training.options import TrainOptions, default_of, option, redefault
from specwise.training.pipeline import TrainingJob, TrainingPlan, featurize, train_and_save
from specwise.training.recipes.base import register_recipe
from specwise.training.recipes.distill import DraftLMRecipe, DraftRecipeConfig


@dataclass(frozen=True)
class DraftOptions(TrainOptions):
    """Options of ``specwise train draft``."""

    batch_tokens: int = redefault(TrainOptions, "batch_tokens", default_of(DraftRecipeConfig, "batch_tokens"))
    draft_vocab_size: int = redefault(TrainOptions, "draft_vocab_size", default_of(DraftLMConfig, "draft_vocab_size"))
    init_layers: tuple[int, ...] = option(default_of(DraftLMConfig, "init_layers"),
                                          "target layers its own layers start from, e.g. 0,-1")
    borrowed_layers: int = option(default_of(DraftLMConfig, "borrowed_layers"),
                                  "run the target's first N layers first (frozen, not stored)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.init_layers or not all(isinstance(i, int) for i in self.init_layers):
            raise ConfigError(f"init_layers must be one or more layer indices, got {self.init_layers!r}.")
        check_int("borrowed_layers", self.borrowed_layers, 0)


@register_recipe("draft", DraftOptions, "distil a small draft LM from the target")
def train_draft(job: TrainingJob, options: DraftOptions) -> Path:
    """Distil a draft LM (:class:`DraftLMRecipe`) and write its checkpoint to ``job.out``."""

    features = featurize(job, options.top_k, options.draft_vocab_size, init_from=options.init_from)
    data = DraftRecipeConfig(batch_tokens=options.batch_tokens, loss_on=options.loss_on, distill=options.distill_loss())
    recipe = DraftLMRecipe(job.corpus, features.vocab, data)
    job.say(f"training on {recipe.train_tokens} tokens ({len(recipe.train_examples)} sequences), "
            f"{len(recipe.validation_examples)} validation sequences")
    model = DraftLM(job.target, DraftLMConfig(init_layers=options.init_layers, draft_vocab_size=options.draft_vocab_size,
                                              borrowed_layers=options.borrowed_layers), features.vocab)
    plan = TrainingPlan("draft-lm distillation (soft cross-entropy on target top-k, draft vocabulary)",
                        model.to_own(torch.float32), recipe, data)
    return train_and_save(job, options, features, plan)
