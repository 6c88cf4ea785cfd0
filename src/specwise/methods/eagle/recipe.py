"""Recipe: train an EAGLE-3 head (:class:`specwise.methods.eagle.network.EagleHead`) on the frozen target.

Data: a self-distillation corpus whose features hold the target's top-k log-probabilities over the
draft vocabulary and the hidden states of the head's feature layers
(:mod:`specwise.training.features`). Loss: the EAGLE-3 training-time test (Li et al. 2025,
docs/algorithms.md §4.3): the head is unrolled ``ttt_steps`` draft steps over every window, step j
reading its own step-(j-1) outputs, and step j's soft cross-entropy against the target's
renormalized top-k distribution is weighted ``step_decay ** j``. With ``loss_on="generated"`` the
loss covers only positions whose predicted token the target wrote (the continuations, not the human
prompts; EAGLE's reference trains on assistant turns only): prompt tokens are still read as context,
but the output layer, two thirds of the head's cost, skips them, and windows of prompt text alone
are not trained on. On the shipped head's corpus and time budget it did not beat ``"all"``, on
held-out replay nor in decoding (docs/benchmarks/loss-on-generated-greedy-report.md and
-t0.7-report.md; the training comparison is in docs/notes/train.md), so ``"all"`` stays the default.

Validation replays greedy chain decoding on held-out target-written text: with the unroll teacher
forced, draft j at root r equals what decoding would have drafted whenever drafts 0..j-1 were
accepted, so acceptance by depth and τ of a chain of ``validation_draft_tokens`` are exact.

``specwise train eagle`` (:func:`train_eagle`, options :class:`EagleOptions`) writes the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specwise.checks import check_int
from specwise.errors import ConfigError
from specwise.methods.eagle.network import STANDARD_ARCHITECTURE, EagleConfig, EagleHead
from specwise.training.options import default_of, option, redefault
from specwise.training.pipeline import TrainingJob, TrainingPlan, train_and_save
from specwise.training.recipes.base import register_recipe
from specwise.training.recipes.distill import DraftRecipeConfig
from specwise.training.recipes.tapped import TappedOptions, TappedRecipe, describe_data, tapped_features


@dataclass(frozen=True)
class EagleRecipeConfig(DraftRecipeConfig):
    """Data and loss settings of the EAGLE-3 recipe."""

    ttt_steps: int = 3  # draft steps unrolled in training (J)
    step_decay: float = 0.8  # loss weight of step j is step_decay ** j (EAGLE-3's reference value)
    validation_draft_tokens: int = 6  # chain depth of the replayed validation decoding
    loss_on: str = "all"  # see DraftRecipeConfig; "generated" did no better (module docstring)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttt_steps < 1 or not 0 < self.step_decay <= 1:
            raise ConfigError("ttt_steps must be >= 1 and step_decay in (0, 1].")


class EagleRecipe(TappedRecipe):
    """Training-time-test training of an EAGLE-3 head.

    Args:
        corpus_dir: corpus with features including ``hidden_layers``.
        vocab: ``[Vd]`` int64 draft vocabulary of the features.
        hidden_layers: the head's feature layers (the order is the concatenation order).
        config: :class:`EagleRecipeConfig`.
        features_dir: where the features are (default: the corpus directory).

    Raises:
        ConfigError: no features, missing hidden states, or no training sequences.
    """

    def __init__(self, corpus_dir, vocab: torch.Tensor, hidden_layers: tuple[int, ...],
                 config: EagleRecipeConfig = EagleRecipeConfig(), features_dir=None) -> None:
        super().__init__(corpus_dir, vocab, hidden_layers, config, features_dir)
        self.config: EagleRecipeConfig = config

    @property
    def validation_depth(self) -> int:
        return self.config.validation_draft_tokens

    def _batch(self, batch, steps: int):
        """Pad a micro-batch: features ``[B, W, F*H]``, next ids / top-k / validity ``[B, W+J-1, ...]``
        (validity 0 on padding and, with ``loss_on="generated"``, where the predicted token is a prompt's)."""
        width = max(length for _, _, length in batch)
        first = self.train_examples[batch[0][0]]
        k, fh = first.top_index.shape[1], first.hidden.shape[1]
        span = width + steps - 1
        feats = torch.zeros((len(batch), width, fh), dtype=first.hidden.dtype)
        next_ids = torch.zeros((len(batch), span), dtype=torch.long)
        top_index = torch.zeros((len(batch), span, k), dtype=torch.long)
        top_probs = torch.zeros((len(batch), span, k))
        valid = torch.zeros((len(batch), span))
        rows = torch.zeros((len(batch), width))
        for row, (i, start, length) in enumerate(batch):
            ex = self.train_examples[i]
            feats[row, :length] = ex.hidden[start: start + length]
            m = min(length + steps - 1, ex.tokens.numel() - start - 1)  # tokens after index start+t
            next_ids[row, :m] = ex.tokens[start + 1: start + 1 + m]
            top_index[row, :m] = ex.top_index[start + 1: start + 1 + m]
            top_probs[row, :m] = ex.top_probs[start + 1: start + 1 + m]
            valid[row, :m] = 1
            if self.config.loss_on == "generated":
                # span index s holds the target's distribution for the token at start + 2 + s
                valid[row, : max(0, ex.prompt_length - start - 2)] = 0
            rows[row, :length] = 1
        return feats, next_ids, top_index, top_probs, valid, rows

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        steps = self.config.ttt_steps
        device = next(model.parameters()).device
        feats, next_ids, top_index, top_probs, valid, rows = (t.to(device) for t in self._batch(batch, steps))
        width = feats.shape[1]
        # step j's row t predicts the token after index t+j+1: top-k row t+j of the padded arrays
        masks = [(valid[:, j: j + width] * rows) > 0 for j in range(steps)]
        outputs = model(feats, next_ids, steps, masks)  # steps x [M_j, Vd]
        total, weight_sum = 0.0, 0.0
        for j, (logits, mask) in enumerate(zip(outputs, masks)):
            log_q = torch.log_softmax(logits.float(), dim=-1)
            per_position = self.config.distill.per_position(  # shape: [M_j]
                log_q, top_index[:, j: j + width][mask], top_probs[:, j: j + width][mask])
            weight = self.config.step_decay ** j
            total = total + weight * per_position.sum() / max(per_position.numel(), 1)
            weight_sum += weight
        return total / weight_sum, int(rows.sum())

    def replay(self, model: nn.Module, ex, device) -> tuple[torch.Tensor, int, int] | None:
        """Unroll the head ``validation_draft_tokens`` steps at every position of one held-out text
        (teacher forced) and match root r's draft j against the text."""
        depth = self.config.validation_draft_tokens
        length = min(ex.tokens.numel(), self.config.max_length) - 1  # indices t with a next token
        if length < 2 or ex.prompt_length >= length:
            return None
        next_ids = torch.zeros(length + depth - 1, dtype=torch.long)
        next_ids[:length] = ex.tokens[1: length + 1]
        outputs = model(ex.hidden[None, :length].to(device), next_ids[None].to(device), depth)
        drafts = torch.stack([self.vocab[o[0].argmax(-1).cpu()] for o in outputs], dim=1)  # shape: [T, K]
        agree = drafts[:, 0] == self.vocab[ex.top_index[1: length + 1, 0]]
        # root r = generated token r sits at index p + r; its draft j is row p + r - 1, step j,
        # and predicts the token at index p + r + j + 1
        p = ex.prompt_length
        tokens = ex.tokens[: length + 1]
        roots = length + 1 - p  # generated tokens in the window
        matches = torch.zeros(roots, depth, dtype=torch.bool)
        for j in range(depth):
            r = torch.arange(roots)
            target_index = p + r + j + 1
            ok = target_index <= length
            matches[ok, j] = drafts[(p + r - 1)[ok], j] == tokens[target_index[ok]]
        return matches, int(agree.sum()), agree.numel()


@dataclass(frozen=True)
class EagleOptions(TappedOptions):
    """Options of ``specwise train eagle``."""

    minutes: float = redefault(TappedOptions, "minutes", 45.0)
    lr: float = redefault(TappedOptions, "lr", 8e-4)
    batch_tokens: int = redefault(TappedOptions, "batch_tokens", default_of(EagleRecipeConfig, "batch_tokens"))
    draft_vocab_size: int = redefault(TappedOptions, "draft_vocab_size", default_of(EagleConfig, "draft_vocab_size"))
    ttt_steps: int = option(default_of(EagleRecipeConfig, "ttt_steps"), "draft steps unrolled in training")
    arch: str = option("specwise", "head architecture: specwise (per-tap norms, GELU, windowed attention) or "
                       "standard (the EAGLE-3 layer vLLM, SGLang and llama.cpp serve: `specwise export` "
                       "writes it exactly)", choices=("specwise", "standard"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("ttt_steps", self.ttt_steps, 1)
        if self.arch not in ("specwise", "standard"):
            raise ConfigError(f"arch must be specwise or standard, got {self.arch!r}.")


@register_recipe("eagle", EagleOptions, "train an EAGLE-3 head on the frozen target's features")
def train_eagle(job: TrainingJob, options: EagleOptions) -> Path:
    """Train an EAGLE-3 head (:class:`EagleRecipe`) and write its checkpoint to ``job.out``.

    The features (target top-k and the hidden states of the head's feature layers) go to
    :func:`specwise.training.pipeline.taps_features_dir`.
    """

    layers, features = tapped_features(job, options)
    data = EagleRecipeConfig(batch_tokens=options.batch_tokens, max_length=options.max_length,
                             ttt_steps=options.ttt_steps, loss_on=options.loss_on,
                             distill=options.distill_loss())
    recipe = EagleRecipe(job.corpus, features.vocab, layers, data, features.directory)
    job.say(describe_data(recipe, layers))
    variant = STANDARD_ARCHITECTURE if options.arch == "standard" else {"window": options.max_length}
    model = EagleHead(job.target, EagleConfig(feature_layers=layers, draft_vocab_size=options.draft_vocab_size,
                                              **variant), features.vocab)
    plan = TrainingPlan("EAGLE-3 training-time test (soft cross-entropy on target top-k, draft vocabulary)",
                        model, recipe, data)
    return train_and_save(job, options, features, plan)
