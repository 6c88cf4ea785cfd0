"""The distillation recipe every trained drafter builds on: a draft network learns the target's
distribution from a featured corpus (:class:`DraftLMRecipe`).

Data: a self-distillation corpus with target features (top-k log-probs over the draft vocabulary
per position, :mod:`specwise.training.features`). Loss: cross-entropy of the draft's distribution
against the target's renormalized top-k distribution at every position (forward KL up to a
constant), the standard distillation loss for draft models (DistillSpec, Zhou et al. 2024, finds
forward KL on on-policy target text a strong default).

Sequences longer than ``max_length`` are cut into windows; micro-batches group windows of similar
length up to ``batch_tokens`` padded tokens. One sequence in ``validation_every`` (by id hash) is
held out (:func:`is_validation`); validation replays greedy decoding on its target-written part
(:mod:`specwise.training.acceptance`). The draft LM's recipe is this one as it stands; the heads
that read target features (EAGLE, DFlash: :mod:`specwise.training.recipes.tapped`; Medusa) subclass
it or share its split.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
from torch import nn

from specwise.errors import ConfigError
from specwise.training.acceptance import ChainAcceptance, replay_chain
from specwise.training.features import iter_labelled
from specwise.training.losses import DistillLoss
from specwise.training.options import LOSS_ON
from specwise.training.trainer import Recipe


@dataclass(frozen=True)
class DraftRecipeConfig:
    """Data settings of the draft-LM recipe."""

    batch_tokens: int = 4096  # padded tokens per micro-batch
    max_length: int = 1024  # longest training window
    validation_every: int = 40  # one sequence in this many is held out for validation
    validation_sequences: int = 48  # at most this many greedy held-out sequences are replayed
    validation_draft_tokens: int = 5  # K of the replayed decoding
    # positions with a loss: "all", or "generated": those whose predicted token the target wrote (prompts
    # are then context only, and windows of prompt text alone are dropped)
    loss_on: str = "all"
    distill: DistillLoss = DistillLoss()  # the per-position loss (cross-entropy, optionally mixed with TV)

    def __post_init__(self) -> None:
        if self.loss_on not in LOSS_ON:
            raise ConfigError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}.")


@dataclass(frozen=True)
class _Example:
    tokens: torch.Tensor  # shape: [T] long
    top_index: torch.Tensor  # shape: [T, k] long, draft-vocabulary indices
    top_probs: torch.Tensor  # shape: [T, k] float32, renormalized target probabilities
    prompt_length: int
    mode: str
    hidden: torch.Tensor | None = None  # shape: [T, F*H] bf16 target features, for recipes that use them


def is_validation(seq_id: str, every: int) -> bool:
    """True for the corpus sequences held out for validation (a fixed hash of the prompt id)."""
    digest = hashlib.sha256(("validation:" + seq_id).encode()).digest()
    return int.from_bytes(digest[:4], "big") % every == 0


class DraftLMRecipe(Recipe):
    """Distillation of a draft LM on a featured corpus.

    Args:
        corpus_dir: corpus with features (``features-*.safetensors``).
        vocab: ``[Vd]`` int64 draft vocabulary (target ids) the features were made with.
        config: :class:`DraftRecipeConfig`.
        hidden_layers: target hidden states to load with each sequence (recipes of heads that read
            target features subclass this one).
        features_dir: where the features are (default: the corpus directory).

    Raises:
        ConfigError: the corpus has no shards or no features, or too little data.
    """

    def __init__(self, corpus_dir, vocab: torch.Tensor, config: DraftRecipeConfig = DraftRecipeConfig(),
                 hidden_layers: tuple[int, ...] = (), features_dir=None) -> None:
        self.config = config
        self.vocab = vocab.clone().long()
        self.train_examples: list[_Example] = []
        self.validation_examples: list[_Example] = []
        for seq in iter_labelled(corpus_dir, vocab, hidden_layers, features_dir):
            example = _Example(seq.tokens, seq.top_index, seq.top_probs, seq.prompt_length, seq.mode, seq.hidden)
            if is_validation(seq.id, config.validation_every):
                self.validation_examples.append(example)
            else:
                self.train_examples.append(example)
        if not self.train_examples:
            raise ConfigError(f"{corpus_dir} has no training sequences.")
        self.windows = []  # (example index, start, length)
        for i, ex in enumerate(self.train_examples):
            n = ex.tokens.numel()
            if config.loss_on == "generated" and n <= ex.prompt_length:
                continue  # prompt text alone
            for start in range(0, n, config.max_length):
                length = min(config.max_length, n - start)
                if length >= 2 and (config.loss_on == "all" or start + length >= ex.prompt_length):
                    self.windows.append((i, start, length))
        if not self.windows:
            raise ConfigError(f"{corpus_dir} has no training windows (loss_on={config.loss_on!r}).")
        self.validation_examples = [e for e in self.validation_examples if e.mode == "greedy"][: config.validation_sequences]

    @property
    def train_tokens(self) -> int:
        return sum(length for _, _, length in self.windows)

    def batches(self, epoch: int, seed: int) -> list[list[tuple[int, int, int]]]:
        order = list(self.windows)
        random.Random(seed * 1000 + epoch).shuffle(order)
        batches = []
        chunk = 256  # sort by length within chunks of windows: little padding, still shuffled
        for start in range(0, len(order), chunk):
            group: list[tuple[int, int, int]] = []
            for window in sorted(order[start: start + chunk], key=lambda w: w[2]):
                if group and window[2] * (len(group) + 1) > self.config.batch_tokens:
                    batches.append(group)
                    group = []
                group.append(window)
            if group:
                batches.append(group)
        random.Random(seed * 1000 + epoch + 1).shuffle(batches)
        return batches

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        width = max(length for _, _, length in batch)
        k = self.train_examples[0].top_index.shape[1]
        device = next(model.parameters()).device
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        top_index = torch.zeros((len(batch), width, k), dtype=torch.long)
        top_probs = torch.zeros((len(batch), width, k))
        mask = torch.zeros((len(batch), width))
        for row, (i, start, length) in enumerate(batch):
            ex = self.train_examples[i]
            ids[row, :length] = ex.tokens[start: start + length]
            top_index[row, :length] = ex.top_index[start: start + length]
            top_probs[row, :length] = ex.top_probs[start: start + length]
            mask[row, :length] = 1
            if self.config.loss_on == "generated":  # position t predicts the token at start + t + 1
                mask[row, : max(0, ex.prompt_length - start - 1)] = 0
        logits = model(ids.to(device))  # shape: [B, T, Vd]
        log_q = torch.log_softmax(logits.float(), dim=-1)
        per_position = self.config.distill.per_position(log_q, top_index.to(device), top_probs.to(device))  # shape: [B, T]
        tokens = int(mask.sum())
        return (per_position * mask.to(device)).sum() / max(tokens, 1), tokens

    @torch.no_grad()
    def validate(self, model: nn.Module) -> dict:
        """Replayed greedy decoding (K = ``validation_draft_tokens``) on held-out target-written text,
        plus the teacher-forced top-1 agreement with the target over all held-out positions."""
        if not self.validation_examples:
            return {}
        stats = ChainAcceptance(self.config.validation_draft_tokens)
        agree_total, positions = 0, 0
        device = next(model.parameters()).device
        for ex in self.validation_examples:
            tokens = ex.tokens[: self.config.max_length]
            logits = model(tokens[None].to(device))[0]  # shape: [T, Vd]
            draft_top = logits.argmax(-1).cpu()
            agree_teacher = draft_top == ex.top_index[: tokens.numel(), 0]
            agree_total += int(agree_teacher.sum())
            positions += agree_teacher.numel()
            # position t predicts token t + 1: replay over the tokens the target wrote
            agree_text = self.vocab[draft_top[:-1]] == tokens[1:]
            replay_chain(agree_text[ex.prompt_length - 1:], self.config.validation_draft_tokens, into=stats)
        return {"top1_agreement": round(agree_total / max(positions, 1), 4), **stats.as_dict()}
