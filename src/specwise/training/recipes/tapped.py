"""What the EAGLE and DFlash recipes share: both drafters read the target's hidden states at a few
feature layers (low / middle / high by default), train on the draft-LM recipe's windows of the
corpus, and are validated by replaying greedy chain decoding on held-out target-written text
(:mod:`specwise.training.recipes.distill`).

:class:`TappedRecipe` is their data base class (its subclasses say how one held-out text is
replayed), :class:`TappedOptions` their shared options, :func:`tapped_features` their features pass
(into :func:`specwise.training.pipeline.taps_features_dir`, so both read one copy).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from specwise.checks import check_int
from specwise.training.acceptance import ChainAcceptance, replay_depths
from specwise.training.options import TrainOptions, default_of, option
from specwise.training.pipeline import Features, TrainingJob, feature_layers, featurize, taps_features_dir
from specwise.training.recipes.distill import DraftLMRecipe, DraftRecipeConfig


@dataclass(frozen=True)
class TappedOptions(TrainOptions):
    """Options of the recipes whose drafter reads target hidden states (``eagle``, ``dflash``)."""

    feature_layers: tuple[int, ...] | None = option(
        None, "target hidden_states indices to fuse, e.g. 2,9,15 (default: low, middle, high)")
    max_length: int = option(default_of(DraftRecipeConfig, "max_length"), "longest training window")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("max_length", self.max_length, 1)


def tapped_features(job: TrainingJob, options: TappedOptions) -> tuple[tuple[int, ...], Features]:
    """``(feature layers, features)``: the features pass with the hidden states of
    ``options.feature_layers`` (else the default taps for the target's depth)."""
    layers = feature_layers(job.target, options.feature_layers)
    features = featurize(job, options.top_k, options.draft_vocab_size, layers, taps_features_dir(job.corpus, layers),
                         init_from=options.init_from)
    return layers, features


def describe_data(recipe: DraftLMRecipe, layers: tuple[int, ...]) -> str:
    """The progress line saying what a tapped recipe trains on."""
    return (f"training on {recipe.train_tokens} tokens ({len(recipe.train_examples)} sequences), "
            f"{len(recipe.validation_examples)} validation sequences, feature layers {list(layers)}")


class TappedRecipe(DraftLMRecipe):
    """The draft-LM recipe's windows and validation split, with the target's hidden states at
    ``hidden_layers`` loaded per sequence, validated by replayed greedy chain decoding.

    Args:
        corpus_dir: corpus with features including ``hidden_layers``.
        vocab: ``[Vd]`` int64 draft vocabulary of the features.
        hidden_layers: the drafter's feature layers (the order is the concatenation order).
        config: the recipe's data settings (a :class:`DraftRecipeConfig` subclass).
        features_dir: where the features are (default: the corpus directory).

    Raises:
        ConfigError: no features, missing hidden states, or no training sequences.
    """

    def __init__(self, corpus_dir, vocab: torch.Tensor, hidden_layers: tuple[int, ...],
                 config: DraftRecipeConfig, features_dir=None) -> None:
        super().__init__(corpus_dir, vocab, config, hidden_layers, features_dir)

    @property
    @abstractmethod
    def validation_depth(self) -> int:
        """Drafts per replayed verification step (the chain depth)."""

    @abstractmethod
    def replay(self, model: nn.Module, example, device) -> tuple[torch.Tensor, int, int] | None:
        """Draft at every root of one held-out text.

        Returns:
            ``(matches [R, validation_depth] bool, first-draft agreements, positions compared)``:
            ``matches[r, j]`` is whether root r's draft j equals the text's token, for
            :func:`specwise.training.acceptance.replay_depths`; ``None`` for a text too short to replay.
        """

    @torch.no_grad()
    def validate(self, model: nn.Module) -> dict:
        """Replayed greedy chain decoding on held-out target-written text (acceptance by depth, τ),
        and the first draft's agreement with the target's top-1."""
        if not self.validation_examples:
            return {}
        stats = ChainAcceptance(self.validation_depth)
        agree_total, positions = 0, 0
        device = next(model.parameters()).device
        for example in self.validation_examples:
            replayed = self.replay(model, example, device)
            if replayed is None:
                continue
            matches, agree, compared = replayed
            agree_total += agree
            positions += compared
            replay_depths(matches, stats)
        return {"top1_agreement": round(agree_total / max(positions, 1), 4), **stats.as_dict()}
