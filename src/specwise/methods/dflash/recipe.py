"""Recipe: train a DFlash drafter (:class:`specwise.methods.dflash.network.DFlashModel`) on the frozen target
(docs/algorithms.md §7.3).

Data: a self-distillation corpus whose features hold the target's top-k log-probabilities over the
draft vocabulary and the hidden states of the drafter's feature layers. Each training window gets
``ceil(length / block_size)`` random anchors, drawn again every epoch; all its blocks run in one
forward, each seeing the context before its anchor and its own entries (bidirectionally). Loss:
block entry k against the target's renormalized top-k distribution of the token at ``anchor + k``
(soft cross-entropy), weighted ``exp(-(k - 1) / decay_gamma)``: an early miss truncates every later
draft, so early entries matter more.

Validation replays greedy decoding on held-out target-written text: a block's drafts depend only on
the context and the anchor, so drafting at every root at once and replaying the chain gives the
exact acceptance by block position and τ.

``specwise train dflash`` (:func:`train_dflash`, options :class:`DFlashOptions`) writes the
checkpoint; its features are EAGLE's when the feature layers are the same.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specwise.checks import check_int
from specwise.errors import ConfigError
from specwise.methods.dflash.network import DFlashConfig, DFlashModel
from specwise.training.options import default_of, option, redefault
from specwise.training.pipeline import TrainingJob, TrainingPlan, train_and_save
from specwise.training.recipes.base import register_recipe
from specwise.training.recipes.distill import DraftRecipeConfig
from specwise.training.recipes.tapped import TappedOptions, TappedRecipe, describe_data, tapped_features


@dataclass(frozen=True)
class DFlashRecipeConfig(DraftRecipeConfig):
    """Data and loss settings of the DFlash recipe."""

    batch_tokens: int = 2048  # padded sequence positions per micro-batch
    max_length: int = 1024  # longest training window
    block_size: int = 8  # B (must match the drafter's)
    decay_gamma: float = 4.0  # loss weight of block entry k is exp(-(k-1)/gamma) (ModelOpt's default for B = 8)
    loss_on: str = "all"  # or "generated": anchors only on tokens the target wrote (see DraftRecipeConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 2 or self.decay_gamma <= 0:
            raise ConfigError("block_size must be >= 2 and decay_gamma > 0.")


class DFlashRecipe(TappedRecipe):
    """Block-diffusion training of a DFlash drafter.

    Args:
        corpus_dir: corpus with features including ``hidden_layers``.
        vocab: ``[Vd]`` int64 draft vocabulary of the features.
        hidden_layers: the drafter's feature layers (the order is the concatenation order).
        config: :class:`DFlashRecipeConfig`.
        features_dir: where the features are (default: the corpus directory).

    Raises:
        ConfigError: no features, missing hidden states, or no training sequences.
    """

    def __init__(self, corpus_dir, vocab: torch.Tensor, hidden_layers: tuple[int, ...],
                 config: DFlashRecipeConfig = DFlashRecipeConfig(), features_dir=None) -> None:
        super().__init__(corpus_dir, vocab, hidden_layers, config, features_dir)
        self.config: DFlashRecipeConfig = config
        # an anchor needs context before it and a label after it
        self.windows = [w for w in self.windows if self._first_anchor(w) < w[2] - 1]
        if not self.windows:
            raise ConfigError(f"{corpus_dir} has no windows with room for a block.")

    @property
    def validation_depth(self) -> int:
        return self.config.block_size - 1

    def _first_anchor(self, window: tuple[int, int, int]) -> int:
        """The earliest anchor (window index) of a window: 1, or with ``loss_on="generated"`` the
        first token the target wrote (anchors are roots, and decoding's roots are generated)."""
        i, start, _ = window
        if self.config.loss_on == "generated":
            return max(1, self.train_examples[i].prompt_length - start)
        return 1

    def batches(self, epoch: int, seed: int) -> list:
        rng = random.Random(seed * 7919 + epoch)
        out = []
        for group in super().batches(epoch, seed):
            blocks = []
            for window in group:
                first, length = self._first_anchor(window), window[2]
                valid = list(range(first, length - 1))
                count = min(len(valid), math.ceil((length - first + 1) / self.config.block_size))
                blocks.append(sorted(rng.sample(valid, count)))
            out.append((group, blocks))
        return out

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        group, blocks = batch
        device = next(model.parameters()).device
        size = self.config.block_size
        width = max(length for _, _, length in group)
        count = max(len(b) for b in blocks)
        first = self.train_examples[group[0][0]]
        k, fh = first.top_index.shape[1], first.hidden.shape[1]
        feats = torch.zeros((len(group), width, fh), dtype=first.hidden.dtype)
        tokens = torch.zeros((len(group), width), dtype=torch.long)
        anchors = torch.ones((len(group), count), dtype=torch.long)
        top_index = torch.zeros((len(group), count, size - 1, k), dtype=torch.long)
        top_probs = torch.zeros((len(group), count, size - 1, k))
        mask = torch.zeros((len(group), count, size - 1))
        for row, ((i, start, length), chosen) in enumerate(zip(group, blocks)):
            ex = self.train_examples[i]
            feats[row, :length] = ex.hidden[start: start + length]
            tokens[row, :length] = ex.tokens[start: start + length]
            for b, anchor in enumerate(chosen):
                anchors[row, b] = anchor
                # entry j (0-based, the (j+1)-th draft) predicts index anchor+j+1: the target's top-k at anchor+j
                last = min(size - 1, length - 1 - anchor)
                top_index[row, b, :last] = ex.top_index[start + anchor: start + anchor + last]
                top_probs[row, b, :last] = ex.top_probs[start + anchor: start + anchor + last]
                mask[row, b, :last] = 1
        logits = model(feats.to(device), tokens.to(device), anchors.to(device))  # shape: [Bt, N, B-1, Vd]
        log_q = torch.log_softmax(logits.float(), dim=-1)
        per_entry = self.config.distill.per_position(log_q, top_index.to(device), top_probs.to(device))  # shape: [Bt, N, B-1]
        weights = torch.exp(-torch.arange(size - 1, dtype=torch.float32) / self.config.decay_gamma).to(device)
        weighted = mask.to(device) * weights
        return (per_entry * weighted).sum() / weighted.sum().clamp_min(1e-9), sum(length for _, _, length in group)

    def replay(self, model: nn.Module, ex, device) -> tuple[torch.Tensor, int, int] | None:
        """Draft a block at every generated token of one held-out text and match root r's entry j
        against the text."""
        drafts_per_block = self.config.block_size - 1
        length = min(ex.tokens.numel(), self.config.max_length)
        p = ex.prompt_length
        if p < 1 or length - p < 2:
            return None
        anchors = torch.arange(p, length)  # every generated token as a root
        features, tokens = ex.hidden[None, :length].to(device), ex.tokens[None, :length].to(device)
        drafts = torch.cat([self.vocab[model(features, tokens, chunk[None].to(device))[0].argmax(-1).cpu()]
                            for chunk in anchors.split(64)])  # shape: [R, B-1]
        roots = anchors.numel()
        matches = torch.zeros(roots, drafts_per_block, dtype=torch.bool)
        for j in range(drafts_per_block):
            later = anchors + j + 1
            ok = later < length
            matches[ok, j] = drafts[ok, j] == ex.tokens[later[ok]]
        first_ok = anchors + 1 < length
        agree = int((drafts[first_ok, 0] == self.vocab[ex.top_index[anchors[first_ok], 0]]).sum())
        return matches, agree, int(first_ok.sum())


@dataclass(frozen=True)
class DFlashOptions(TappedOptions):
    """Options of ``specwise train dflash``."""

    minutes: float = redefault(TappedOptions, "minutes", 45.0)
    lr: float = redefault(TappedOptions, "lr", 8e-4)
    batch_tokens: int = redefault(TappedOptions, "batch_tokens", default_of(DFlashRecipeConfig, "batch_tokens"))
    draft_vocab_size: int = redefault(TappedOptions, "draft_vocab_size", default_of(DFlashConfig, "draft_vocab_size"))
    block_size: int = option(default_of(DFlashRecipeConfig, "block_size"), "tokens per block, anchor included")
    dflash_layers: int = option(default_of(DFlashConfig, "num_layers"), "draft transformer layers")
    arch: str = option("specwise", "drafter's architecture: specwise (per-tap norms, a learned mask vector, windowed "
                       "context) or standard (the layout speculators and vLLM run: `specwise export` writes it "
                       "exactly)", choices=("specwise", "standard"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("block_size", self.block_size, 2)
        check_int("dflash_layers", self.dflash_layers, 1)
        if self.arch not in ("specwise", "standard"):
            raise ConfigError(f"arch must be specwise or standard, got {self.arch!r}.")


def mask_token(target) -> int:
    """The token the standard layout's mask entries embed: the tokenizer's mask token, else the first
    LM-head row past the tokenizer's vocabulary (padding rows never appear in text), else its unknown
    token.

    Raises:
        ConfigError: the target has none of those.
    """
    tokenizer = target.tokenizer
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < target.vocab_size:
        return len(tokenizer)
    if tokenizer.unk_token_id is not None:
        return int(tokenizer.unk_token_id)
    raise ConfigError(f"{target.name} has no mask, padding or unknown token for the standard DFlash layout's mask.")


@register_recipe("dflash", DFlashOptions, "train a DFlash block-diffusion drafter on the frozen target's features")
def train_dflash(job: TrainingJob, options: DFlashOptions) -> Path:
    """Train a DFlash drafter (:class:`DFlashRecipe`) and write its checkpoint to ``job.out``.

    The features (target top-k and the hidden states of the feature layers, by default the same
    low / middle / high layers as EAGLE's) go to :func:`specwise.training.pipeline.taps_features_dir`,
    shared with EAGLE.
    """

    layers, features = tapped_features(job, options)
    data = DFlashRecipeConfig(batch_tokens=options.batch_tokens, max_length=options.max_length,
                              block_size=options.block_size, loss_on=options.loss_on,
                              distill=options.distill_loss())
    recipe = DFlashRecipe(job.corpus, features.vocab, layers, data, features.directory)
    job.say(f"{describe_data(recipe, layers)}, block {options.block_size}")
    variant = ({"tap_norms": False, "mask_token_id": mask_token(job.target), "raw_embeddings": True, "window": None,
                "hidden_act": "silu"} if options.arch == "standard" else {"window": options.max_length})
    model = DFlashModel(job.target, DFlashConfig(feature_layers=layers, draft_vocab_size=options.draft_vocab_size,
                                                 block_size=options.block_size, num_layers=options.dflash_layers,
                                                 **variant), features.vocab)
    plan = TrainingPlan("DFlash block diffusion (random anchors, bidirectional blocks, soft cross-entropy on "
                        "target top-k, entry k weighted exp(-(k-1)/4), draft vocabulary)", model, recipe, data)
    return train_and_save(job, options, features, plan)
