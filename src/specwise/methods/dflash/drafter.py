"""``dflash``: a block-diffusion drafter drafts ``block_size - 1`` tokens in one forward
(Chen, Liang, Liu 2026; docs/algorithms.md §7); the target verifies them as a chain, or as a draft tree.

Per step:

1. **Catch up.** The target's features at the positions it committed last step (the old root and
   the accepted drafts; at the start, the prompt) become context vectors, and every draft layer
   caches their keys and values. The block's own keys and values are never cached, so the
   drafter's cache follows exactly the accepted prefix.
2. **Draft.** The block ``[root, MASK x (B-1)]`` at positions ``P .. P+B-1`` runs through the layers
   once, each entry attending to at most ``window`` context keys and to the whole block; entry k's
   argmax is the draft token at position P+k.
3. **Tree (``tree_top_k > 1``).** The same forward gives a distribution at every block position, so
   the alternatives cost no further drafter forward: level l of the tree offers the ``tree_top_k``
   most likely tokens of position P+l under each of the ``tree_top_k`` best nodes of level l-1,
   a node's score being the sum of its path's log-probabilities (EAGLE-2's expansion, with
   children that do not depend on their parent), and the ``total_tokens`` best nodes are verified
   in one tree forward. The drafter's positions are marginals given only the anchor, so a sibling
   below an accepted alternative is a guess; the tree buys the cases where the argmax is wrong.
   For the shipped gemma-3-270m drafter it raised the accepted length but not speed (see
   docs/benchmarks/dflash-tree-greedy-report.md and dflash-tree-t0.7-report.md), so chains are the default.
4. **Dynamic length (``min_path_prob``).** A chain keeps its leading drafts whose path probability
   under the drafter (the product of the argmax probabilities up to them) reaches the threshold; a
   tree drops the nodes below it. On a hard step fewer rows are verified, on an easy one the
   whole ``depth``; with none above it the step verifies the root alone.

Verification: the drafts (chain or tree) are a deterministic function of the context, so each is
proposed with a point mass. Greedy decoding compares them with the target's argmax; sampling uses
speculative sampling with delta proposals (accept with probability p(x), else sample from p with x
removed, renormalized), which is exact and accepts with the same probability as DFlash's
sample-match rule. Sampled drafts with the ratio test were not chosen: the drafter's per-position
distributions are marginals given only the anchor, far flatter than the target's, and the ratio
test would accept them less often than their argmax.

Long contexts: at most ``window`` context keys per block with relative rotary positions, so any
length works.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specwise.drafters.base import check_int, check_probability_threshold, register_drafter, warn_renamed
from specwise.drafters.checkpoint import load_vocabulary_module
from specwise.drafters.trained import (
    DrafterModule,
    TrainedDrafter,
    TrainedDrafterConfig,
    TrainedState,
    check_placement,
    load_or_shipped,
)
from specwise.engine.tree import best_nodes_tree, log_threshold
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError
from specwise.interop.formats import check_method
from specwise.methods.dflash.interop import read_dflash
from specwise.methods.dflash.network import DFlashConfig, DFlashModel
from specwise.models.common import HeadCache

DRAFTER = DrafterModule("a", "DFlash drafter")


@dataclass(frozen=True)
class DFlashDrafterConfig(TrainedDrafterConfig):
    """Options of ``dflash``.

    ``depth`` was called ``num_draft_tokens``, which elsewhere is a fixed K (``pld``, ``draft``);
    the old spelling still works (deprecated)."""

    RENAMED_OPTIONS: ClassVar[dict[str, str]] = {**TrainedDrafterConfig.RENAMED_OPTIONS, "num_draft_tokens": "depth"}

    # chain length, or tree depth (<= block_size - 1); None = the drafter's tuned default, else all B-1
    depth: int | None = None
    tree_top_k: int = 1  # alternatives per tree level; 1 = verify the argmax chain
    total_tokens: int = 8  # draft nodes verified per step when tree_top_k > 1 (the root excluded)
    # with all drafts of the shipped drafter, faster than the few fixed drafts it replaced, paired per prompt
    # (see docs/benchmarks/dynamic-budget-confirm-report.md and dynamic-budget-greedy-report.md)
    min_path_prob: float = 0.3  # verify only drafts whose path probability under the drafter reaches this

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("depth", self.depth, optional=True)
        for name in ("tree_top_k", "total_tokens"):
            check_int(name, getattr(self, name))
        check_probability_threshold("min_path_prob", self.min_path_prob)

    @property
    def chain_draft_tokens(self) -> int | None:
        return self.depth


def load_dflash(path, target) -> DFlashModel:
    """Load a DFlash drafter checkpoint for ``target`` (in the target's dtype and on its device).

    The checkpoint may record a tuned ``default_draft_tokens`` beside the architecture; it is kept
    as the model's ``default_draft_tokens`` attribute.

    A directory in the speculators or z-lab format is read by
    :func:`specwise.methods.dflash.interop.read_dflash`.

    Raises:
        DrafterError: not a DFlash checkpoint, trained for another target, a public drafter that does
            not fit the target, or weights that do not fit.
    """
    if check_method(path, "dflash") is not None:
        return read_dflash(path, target)
    model, found = load_vocabulary_module(path, target, "dflash", DRAFTER.the(), DFlashConfig,
                                          lambda config, vocab: DFlashModel(target, config, vocab, initialize=False),
                                          tuple_fields=("feature_layers",), extras=("default_draft_tokens",))
    model.default_draft_tokens = found["default_draft_tokens"]
    return model


#: what ``specwise export`` loads (specwise.methods): the drafter network, as generate loads it
load_network = load_dflash


@dataclass
class DFlashState:
    """One generation's DFlash state: a KV cache per drafter layer, and target features not yet in them."""

    caches: list[HeadCache]
    pending: list[torch.Tensor] = field(default_factory=list)  # [n, F*H] target features


@register_drafter("dflash", DFlashDrafterConfig,
                  "DFlash block-diffusion drafter: a whole block in one forward", order=60)
class DFlashDrafter(TrainedDrafter):
    """DFlash drafting.

    Args:
        target: the :class:`specwise.targets.hf.Target`.
        config: :class:`DFlashDrafterConfig`; ``config.drafter_path`` names the drafter unless ``model``
            is given; without either, the one shipped for the target is used.
        model: an already built :class:`DFlashModel` (in the target's dtype, on its device).

    Raises:
        DrafterError: no drafter given and none ships for the target, one trained for another
            target, or one in another dtype / on another device.
        ConfigError: ``depth`` above ``block_size - 1``, or ``tree_top_k`` above the draft vocabulary.

    Attributes:
        depth: the chain length or tree depth drafted per step (the option, else the drafter's
            tuned default, else ``block_size - 1``).
    """

    def __init__(self, target, config: DFlashDrafterConfig, model: DFlashModel | None = None) -> None:
        self.config = config
        if model is None:
            model = load_or_shipped(target, "dflash", config.drafter_path, DRAFTER, load_dflash)
        check_placement(target, DRAFTER, model.fc.weight)
        drafts = model.config.block_size - 1
        if config.depth is not None and config.depth > drafts:
            raise ConfigError(f"depth={config.depth} but a block of {model.config.block_size} "
                              f"drafts at most {drafts}.")
        if config.tree_top_k > model.config.draft_vocab_size:
            raise ConfigError(f"tree_top_k ({config.tree_top_k}) exceeds the drafter's draft vocabulary "
                              f"({model.config.draft_vocab_size} tokens).")
        self.model = model
        tuned = getattr(model, "default_draft_tokens", None)
        self.depth = min(config.depth or tuned or drafts, drafts)
        self.target_hidden_layers = tuple(model.config.feature_layers)
        self.setup_lookup(target, model.origin)

    @property
    def num_draft_tokens(self) -> int:
        """Deprecated spelling of :attr:`depth`."""
        warn_renamed(type(self).__name__, "num_draft_tokens", "depth")
        return self.depth

    def start_model(self, ctx: DraftContext) -> DFlashState:
        cfg, dtype, device = self.model.config, self.model.dtype, self.model.fc.weight.device
        state = DFlashState([HeadCache(cfg.kv_heads, cfg.head_dim, dtype, device) for _ in range(cfg.num_layers)])
        self._queue(state, ctx.hidden_states)
        return state

    def _queue(self, state: DFlashState, hidden_states: dict[int, torch.Tensor]) -> None:
        state.pending.append(torch.cat([hidden_states[i] for i in self.target_hidden_layers], dim=-1))

    def observe_model(self, model_state: DFlashState, feedback: StepFeedback) -> None:
        self._queue(model_state, feedback.hidden_states)

    @torch.inference_mode()
    def _catch_up(self, state: DFlashState) -> None:
        if not state.pending:
            return
        features = torch.cat(state.pending)
        state.pending = []
        start = state.caches[0].length
        positions = torch.arange(start, start + features.shape[0], device=features.device)
        context = self.model.fuse(features)
        for cache, (k, v) in zip(state.caches, self.model.context_keys_values(context, positions)):
            cache.append(k, v)

    @torch.inference_mode()
    def draft(self, state: TrainedState, ctx: DraftContext, lookup: torch.Tensor | None) -> Proposal:
        """The block's chain or tree (steps 1-4 of the module docstring; ``lookup`` is not used)."""
        caches = state.model.caches
        count = min(self.depth, ctx.max_draft_tokens)
        if count <= 0:  # the committed context waits for the next step that drafts (one batched catch-up)
            return Proposal.empty(ctx.token_ids.device)
        self._catch_up(state.model)
        model, size = self.model, self.model.config.block_size
        length = caches[0].length  # = the root's position
        begin = max(0, length - model.config.attention_window)
        device = ctx.token_ids.device
        x = model.block_input(ctx.token_ids[-1])  # shape: [B, H]
        positions = torch.arange(length, length + size, device=device)
        context_kv = [(c.keys[begin:length], c.values[begin:length]) for c in caches]
        h = model.run_block(x, positions, context_kv)  # the block sees its whole window and itself
        logits = model.logits(h[1: count + 1])  # shape: [count, Vd]
        if self.config.tree_top_k == 1:
            return self._chain(logits)
        return self._tree(logits)

    def _chain(self, logits: torch.Tensor) -> Proposal:
        """The argmax chain, cut before the first draft whose path probability is below
        ``min_path_prob`` (module docstring, step 4). ``logits``: ``[D, Vd]``."""
        best = logits.argmax(dim=-1)
        if self.config.min_path_prob > 0:
            path_logp = torch.log_softmax(logits.float(), dim=-1).max(dim=-1).values.cumsum(0)  # shape: [D]
            best = best[: int((path_logp >= log_threshold(self.config.min_path_prob)).sum())]
            if best.numel() == 0:
                return Proposal.empty(logits.device)
        return Proposal(self.model.vocab[best])

    def _tree(self, logits: torch.Tensor) -> Proposal:
        """A draft tree from the block's per-position distributions (module docstring, step 3).

        Args:
            logits: ``[D, Vd]``, the draft-vocabulary logits of block positions 1..D.

        Returns:
            a tree :class:`Proposal` of at most ``total_tokens`` nodes (those whose path probability
            reaches ``min_path_prob``), siblings most likely first; empty when none does.
        """
        k = self.config.tree_top_k
        logp = torch.log_softmax(logits.float(), dim=-1).clamp_max(0.0)  # scores never rise along a path
        level_score, level_index = logp.topk(k, dim=-1)  # shape: [D, k], most likely first
        score, index = level_score[0], level_index[0]
        parent = torch.full((k,), -1, dtype=torch.long, device=logits.device)
        frontier = torch.arange(k, device=logits.device)  # creation indices of the nodes expanded next
        for level in range(1, logits.shape[0]):
            width = frontier.numel()
            created = score.numel()
            scores = (score[frontier][:, None] + level_score[level][None, :]).flatten()  # shape: [width*k]
            score = torch.cat([score, scores])
            index = torch.cat([index, level_index[level].repeat(width)])
            parent = torch.cat([parent, frontier.repeat_interleave(k)])
            frontier = created + scores.topk(min(k, scores.numel())).indices
        chosen, parents = best_nodes_tree(score, parent, self.config.total_tokens,
                                          log_threshold(self.config.min_path_prob))
        if chosen.numel() == 0:
            return Proposal.empty(logits.device)
        return Proposal(self.model.vocab[index[chosen]], parents=parents)
