"""Recipe: train Medusa heads on the frozen target (Medusa-1; Cai et al. 2024, docs/algorithms.md §3.2).

Data: a self-distillation corpus whose features hold the target's top-k log-probabilities over the
draft vocabulary and its final hidden state at every position (:mod:`specwise.training.features`).
Each position is an independent example (the heads see one hidden state), so batches are random
positions from the whole corpus. Loss: head k at position t against the target's renormalized
top-k distribution at position t+k (the target's prediction of token t+k+1 given the text), a soft
cross-entropy weighted ``head_decay ** (k - 1)`` (the paper's 0.8^k up to a constant).

Validation, on held-out target-written text: each head's teacher-forced top-1 / top-``rank_limit``
agreement with the target's greedy token and the greedy replay of a top-1 chain (acceptance by
depth, τ). The static tree is calibrated on greedy text too (:meth:`MedusaRecipe.calibration_ranks`):
the held-out sequences are few (one in ``validation_every``, and a quarter of those greedy), so
greedy *training* sequences join them ("held-in" data, as Medusa calibrates); heads of a few hundred
thousand parameters barely overfit a corpus of this size.

``specwise train medusa`` (:func:`train_medusa`, options :class:`MedusaOptions`) trains the heads,
calibrates their static tree (:mod:`specwise.methods.medusa.calibration`) and writes the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specwise.checks import check_int
from specwise.errors import ConfigError
from specwise.methods.medusa.calibration import calibrate_tree
from specwise.methods.medusa.network import MedusaConfig, MedusaHeads, final_hidden_layer
from specwise.training.acceptance import ChainAcceptance, replay_depths
from specwise.training.features import iter_labelled
from specwise.training.losses import DistillLoss
from specwise.training.options import LOSS_ON, TrainOptions, default_of, option, redefault
from specwise.training.pipeline import TrainingJob, TrainingPlan, featurize, taps_features_dir, train_and_save
from specwise.training.recipes.base import register_recipe
from specwise.training.recipes.distill import is_validation
from specwise.training.trainer import Recipe


@dataclass(frozen=True)
class MedusaRecipeConfig:
    """Data and loss settings of the Medusa recipe."""

    batch_tokens: int = 2048  # positions per micro-batch
    head_decay: float = 0.8  # loss weight of head k is head_decay ** (k - 1)
    validation_every: int = 40  # one sequence in this many is held out (same split as the other recipes)
    validation_sequences: int = 96  # at most this many greedy held-out sequences are evaluated
    calibration_sequences: int = 400  # greedy training sequences (held-in) that also calibrate the tree
    rank_limit: int = 10  # ranks per head considered for the tree (Medusa's TOPK)
    # positions trained on: "all", or "generated": hidden states whose next token the target wrote
    # (decoding's roots); "generated" did no better and overfits the held-in calibration (docs/training.md)
    loss_on: str = "all"
    distill: DistillLoss = DistillLoss()  # the per-position loss (cross-entropy, optionally mixed with TV)

    def __post_init__(self) -> None:
        if self.batch_tokens < 1 or not 0 < self.head_decay <= 1 or self.rank_limit < 1:
            raise ConfigError("batch_tokens and rank_limit must be >= 1 and head_decay in (0, 1].")
        if self.loss_on not in LOSS_ON:
            raise ConfigError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}.")


class MedusaRecipe(Recipe):
    """Medusa-1 training of heads on the target's final hidden states.

    Args:
        corpus_dir: corpus with features including ``hidden_layer``.
        vocab: ``[Vd]`` int64 draft vocabulary of the features.
        hidden_layer: HF ``hidden_states`` index of the target's final hidden state.
        num_heads: K, the heads trained.
        config: :class:`MedusaRecipeConfig`.
        features_dir: where the features are (default: the corpus directory).

    Raises:
        ConfigError: no features, missing hidden states, or no training sequences.
    """

    def __init__(self, corpus_dir, vocab: torch.Tensor, hidden_layer: int, num_heads: int,
                 config: MedusaRecipeConfig = MedusaRecipeConfig(), features_dir=None) -> None:
        self.config = config
        self.num_heads = num_heads
        self.vocab = vocab.clone().long()
        hidden, top_index, top_probs, left, generated = [], [], [], [], []
        self.validation_examples = []
        self.calibration_examples = []  # greedy training sequences
        for seq in iter_labelled(corpus_dir, vocab, (hidden_layer,), features_dir):
            if is_validation(seq.id, config.validation_every):
                if seq.mode == "greedy" and len(self.validation_examples) < config.validation_sequences:
                    self.validation_examples.append(seq)
                continue
            if seq.mode == "greedy" and len(self.calibration_examples) < config.calibration_sequences:
                self.calibration_examples.append(seq)
            n = seq.tokens.numel()
            hidden.append(seq.hidden)
            top_index.append(seq.top_index.to(torch.int32))
            top_probs.append(seq.top_probs.to(torch.bfloat16))
            left.append(torch.arange(n - 1, -1, -1, dtype=torch.int32))  # positions after t in its sequence
            generated.append(torch.arange(n) >= seq.prompt_length - 1)  # the next token is the target's
        if not hidden:
            raise ConfigError(f"{corpus_dir} has no training sequences.")
        self.hidden = torch.cat(hidden)  # shape: [N, H] bf16
        self.top_index = torch.cat(top_index)  # shape: [N, k] int32
        self.top_probs = torch.cat(top_probs)  # shape: [N, k] bf16
        self.left = torch.cat(left)  # shape: [N] int32
        # a head k example needs the target's distribution k positions later in the same sequence
        usable = self.left >= 1
        if config.loss_on == "generated":
            usable &= torch.cat(generated)
        self.positions = torch.nonzero(usable).flatten()
        if not self.positions.numel():
            raise ConfigError(f"{corpus_dir} has no training positions (loss_on={config.loss_on!r}).")

    @property
    def train_tokens(self) -> int:
        return int(self.positions.numel())

    def scale_sample(self, count: int = 65536, seed: int = 0) -> torch.Tensor:
        """``[count, H]`` training hidden states to set the heads' per-dimension scale from."""
        pick = torch.randperm(self.hidden.shape[0], generator=torch.Generator().manual_seed(seed))[:count]
        return self.hidden[pick]

    def batches(self, epoch: int, seed: int) -> list[torch.Tensor]:
        order = self.positions[torch.randperm(self.positions.numel(),
                                              generator=torch.Generator().manual_seed(seed * 1000 + epoch))]
        return list(order.split(self.config.batch_tokens))

    def loss(self, model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        device = next(model.parameters()).device
        logits = model(self.hidden[batch].to(device))  # shape: [K, B, Vd]
        total, weight_sum = 0.0, 0.0
        for j in range(self.num_heads):  # head j+1 predicts from the target's distribution j+1 later
            later = (batch + j + 1).clamp_max(self.left.numel() - 1)
            mask = (self.left[batch] >= j + 1).to(device=device, dtype=torch.float32)  # shape: [B]
            log_q = torch.log_softmax(logits[j].float(), dim=-1)
            per_position = self.config.distill.per_position(  # shape: [B]
                log_q, self.top_index[later].long().to(device), self.top_probs[later].float().to(device))
            weight = self.config.head_decay ** j
            total = total + weight * (per_position * mask).sum() / mask.sum().clamp_min(1.0)
            weight_sum += weight
        return total / weight_sum, int(batch.numel())

    @torch.no_grad()
    def calibration_ranks(self, model: nn.Module, examples: list | None = None) -> torch.Tensor:
        """Ranks of the target's greedy continuation under each head, on greedy text.

        Args:
            model: the heads.
            examples: the greedy sequences to read (default: the held-out ones and
                ``calibration_sequences`` greedy training sequences).

        Returns:
            ``[N, K]`` long: row r is a root (a generated token), ``[r, j]`` the rank (< rank_limit)
            under head j+1, read at the position before the root, of the token j+1 positions after
            the root, or -1 (outside the ranks, or past the text). See
            :func:`specwise.methods.medusa.tree.rank_paths`.
        """
        device = next(model.parameters()).device
        k, limit = self.num_heads, self.config.rank_limit
        rows = []
        for ex in (self.validation_examples + self.calibration_examples) if examples is None else examples:
            p, n = ex.prompt_length, ex.tokens.numel()
            if p < 1 or n - p < 2:
                continue
            # the root r (generated token at index p + r) was chosen by the target at index p + r - 1
            logits = model(ex.hidden[p - 1: n - 1].to(device))  # shape: [K, R, Vd]
            top = self.vocab[logits.float().topk(limit, dim=-1).indices.cpu()]  # shape: [K, R, limit]
            roots = n - p
            ranks = torch.full((roots, k), -1, dtype=torch.long)
            for j in range(k):
                later = torch.arange(roots) + p + j + 1  # the token j+1 after the root
                ok = later < n
                hit = top[j][ok] == ex.tokens[later[ok]][:, None]  # shape: [R', limit]
                found = hit.any(-1)
                rank = torch.where(found, hit.float().argmax(-1), torch.full_like(found, -1, dtype=torch.long))
                ranks[: int(ok.sum()), j] = rank
            rows.append(ranks)
        return torch.cat(rows) if rows else torch.zeros((0, k), dtype=torch.long)

    @torch.no_grad()
    def validate(self, model: nn.Module) -> dict:
        """Per-head top-1 / top-``rank_limit`` accuracy against the target's greedy text, and the greedy
        replay of a top-1 chain (acceptance by depth, τ)."""
        ranks = self.calibration_ranks(model, self.validation_examples)
        if ranks.numel() == 0:
            return {}
        valid = torch.stack([self._reachable(ranks.shape[0], j) for j in range(self.num_heads)], dim=1)
        top1 = [round(float(((ranks[:, j] == 0) & valid[:, j]).sum() / valid[:, j].sum().clamp_min(1)), 4)
                for j in range(self.num_heads)]
        topk = [round(float(((ranks[:, j] >= 0) & valid[:, j]).sum() / valid[:, j].sum().clamp_min(1)), 4)
                for j in range(self.num_heads)]
        stats = ChainAcceptance(self.num_heads)
        start = 0
        for ex in self.validation_examples:  # replay per text: a chain never crosses texts
            roots = ex.tokens.numel() - ex.prompt_length
            if ex.prompt_length < 1 or roots < 2:
                continue
            replay_depths(ranks[start: start + roots] == 0, stats)  # [r, j]: head j+1's top-1 is token r+j+1
            start += roots
        # the chain of each head's top-1 token (τ and acceptance by depth, as the other recipes report)
        return {"head_top1": top1, f"head_top{self.config.rank_limit}": topk, **stats.as_dict()}

    def _reachable(self, count: int, j: int) -> torch.Tensor:
        """``[count]`` bool: roots whose token j+1 ahead lies inside its text."""
        out = []
        for ex in self.validation_examples:
            roots = ex.tokens.numel() - ex.prompt_length
            if ex.prompt_length < 1 or roots < 2:
                continue
            out.append(torch.arange(roots) + j + 1 < roots)
        return torch.cat(out)[:count]


@dataclass(frozen=True)
class MedusaOptions(TrainOptions):
    """Options of ``specwise train medusa``."""

    minutes: float = redefault(TrainOptions, "minutes", 30.0)
    lr: float = redefault(TrainOptions, "lr", 1e-3)
    batch_tokens: int = redefault(TrainOptions, "batch_tokens", default_of(MedusaRecipeConfig, "batch_tokens"))
    draft_vocab_size: int = redefault(TrainOptions, "draft_vocab_size", default_of(MedusaConfig, "draft_vocab_size"))
    num_heads: int = option(default_of(MedusaConfig, "num_heads"), "heads trained")
    medusa_layers: int = option(default_of(MedusaConfig, "num_layers"), "residual blocks per head")
    arch: str = option("specwise", "heads' architecture: specwise (blocks on the per-dimension-scaled hidden "
                       "state) or standard (Medusa's own blocks; with --draft-vocab-size set to the target's "
                       "vocabulary, `specwise export --format medusa` writes them exactly)",
                       choices=("specwise", "standard"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_heads", self.num_heads, 1)
        check_int("medusa_layers", self.medusa_layers, 1)
        if self.arch not in ("specwise", "standard"):
            raise ConfigError(f"arch must be specwise or standard, got {self.arch!r}.")


@register_recipe("medusa", MedusaOptions, "train Medusa heads on the frozen target's final hidden state")
def train_medusa(job: TrainingJob, options: MedusaOptions) -> Path:
    """Train Medusa heads (:class:`MedusaRecipe`), calibrate their static tree on greedy text and this
    machine's measured verification cost (:mod:`specwise.methods.medusa.calibration`), and write the
    checkpoint to ``job.out``.

    The features (target top-k and its final hidden state) go to
    :func:`specwise.training.pipeline.taps_features_dir`.
    """

    layer = final_hidden_layer(job.target)
    features = featurize(job, options.top_k, options.draft_vocab_size, (layer,), taps_features_dir(job.corpus, (layer,)),
                         init_from=options.init_from)
    data = MedusaRecipeConfig(batch_tokens=options.batch_tokens, loss_on=options.loss_on,
                              distill=options.distill_loss())
    recipe = MedusaRecipe(job.corpus, features.vocab, layer, options.num_heads, data, features.directory)
    job.say(f"training {options.num_heads} heads on {recipe.train_tokens} positions, "
            f"{len(recipe.validation_examples)} validation sequences")
    model = MedusaHeads(job.target, MedusaConfig(num_heads=options.num_heads, num_layers=options.medusa_layers,
                                                 draft_vocab_size=options.draft_vocab_size, hidden_layer=layer),
                        features.vocab)
    if options.arch == "specwise":
        model.set_scale(recipe.scale_sample())
    plan = TrainingPlan("Medusa-1 heads on the frozen target (soft cross-entropy on target top-k, draft vocabulary, "
                        "head k weighted 0.8^(k-1))", model, recipe, data,
                        extra_architecture=lambda heads: {"tree": calibrate_tree(heads, recipe, job.target, job.say)})
    return train_and_save(job, options, features, plan)
